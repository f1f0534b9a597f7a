"""Gates on each head's output before the heads merge, as x-transformers 2.x spells them.

gate_value_heads: out_h *= sigmoid(w_h . x + b_h), one gate per head from the block input, w = 0 and b = 10 at
init (nearly open), so a head can learn to add nothing (arXiv:2306.12929, "attend to nothing").
Hybrid gated attention (HyGA, x-transformers' output_gate / gate_values options): one gate
out *= act(G_x(x) + G_h(o)), the sum of an input gate G_x from the block input x (gate_values) and an output
gate G_h from the merged attention output o itself (output_gate), either or both. Each gate gives one logit per
head feature, or with its `headwise` option one per head (broadcast over the head's features), and is a
bias-less linear map zero at init (a gate of 1/2), or with its rank r a low-rank map W_up act(W_down .) with a
SiLU in the middle (low_rank_silu_gates; identity without it), W_up zero at init. act is sigmoid, or SiLU with
swiglu_values. gate_values alone, without any of these options, is AlphaFold2's gate instead (mixing.Output).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import checks
from ..config import AttentionConfig
from . import head_scale
from .mixing import Output
from .score_options import ScoreOptions


def hybrid(a: AttentionConfig) -> bool:
    """Whether an attention config asks for the fused gate (so its gate_values is that gate's input gate, not
    AlphaFold2's)."""
    o = a.scores
    return o is not None and (o.output_gate or (a.gate_values and (
        o.gate_values_rank is not None or o.gate_values_headwise or o.swiglu_values)))


def problems(a: AttentionConfig, dim: int) -> list[str]:
    """What the fused gate's options cannot be (scoring's checks call this): each needs its gate; a low-rank gate's rank is below
    its input or output width, and is not headwise (x-transformers' rules)."""
    o, found = a.scores, []
    inner = a.heads * a.dim_head
    if not a.gate_values and (o.gate_values_headwise or o.gate_values_rank is not None):
        found.append("attn_gate_values_headwise / attn_gate_values_rank shape the input gate: they need "
                     "attn_gate_values=True")
    if o.swiglu_values and not (a.gate_values or o.output_gate):
        found.append("attn_swiglu_values sets the fused gate's activation: it needs attn_gate_values=True or "
                     "attn_output_gate=True")
    if not o.low_rank_silu_gates and o.gate_values_rank is None and o.output_gate_rank is None:
        found.append("attn_low_rank_silu_gates=False changes a low-rank gate: it needs attn_gate_values_rank or "
                     "attn_output_gate_rank")
    for name, rank, headwise, width_in in (("gate_values", o.gate_values_rank, o.gate_values_headwise, dim),
                                           ("output_gate", o.output_gate_rank, o.output_gate_headwise, inner)):
        if rank is None:
            continue
        if wrong := checks.whole(rank, f"attn_{name}_rank"):
            found += wrong
        elif headwise:
            found.append(f"attn_{name}_rank and attn_{name}_headwise conflict: a headwise gate projects straight "
                         "to one logit per head; choose one")
        elif rank >= max(width_in, inner):
            found.append(f"attn_{name}_rank must be below the gate's input ({width_in}) or output ({inner}) width "
                         f"to be low rank, got {rank}")
    return found


def projection(dim_in: int, dim_out: int, rank: int | None, silu: bool) -> nn.Module:
    """A gate's logits: bias-less, zero at init; full rank, or W_up act(W_down x) through `rank` features."""
    if rank is None:
        linear = nn.Linear(dim_in, dim_out, bias=False)
        nn.init.zeros_(linear.weight)
        return linear
    low = nn.Sequential(nn.Linear(dim_in, rank, bias=False), nn.SiLU() if silu else nn.Identity(),
                        nn.Linear(rank, dim_out, bias=False))
    nn.init.zeros_(low[2].weight)
    return low


class HeadGates(nn.Module):
    """Gates the heads' outputs (b, h, n, dv), then runs the block's output stage (merge and project)."""

    def __init__(self, output: nn.Module, dim: int, heads: int, dim_value: int, value_heads: bool,
                 o: ScoreOptions | None, input_gate: bool):
        super().__init__()
        self.output = output
        self.value_heads = None
        if value_heads:
            self.value_heads = nn.Linear(dim, heads)
            nn.init.zeros_(self.value_heads.weight)
            nn.init.constant_(self.value_heads.bias, 10.0)
        inner = heads * dim_value
        self.in_gate = self.out_gate = None
        if input_gate:
            self.in_gate = projection(dim, heads if o.gate_values_headwise else inner, o.gate_values_rank,
                                      o.low_rank_silu_gates)
        if o is not None and o.output_gate:
            self.out_gate = projection(inner, heads if o.output_gate_headwise else inner, o.output_gate_rank,
                                       o.low_rank_silu_gates)
        self.act = torch.sigmoid if o is None or not o.swiglu_values else nn.functional.silu

    def forward(self, out: Tensor, x: Tensor) -> Tensor:
        b, h, n, d = out.shape
        if self.value_heads is not None:
            out = out * torch.sigmoid(self.value_heads(x)).transpose(1, 2)[..., None]     # (b, h, n, 1)
        logits = 0
        if self.in_gate is not None:
            logits = logits + self.in_gate(x).view(b, n, h, -1).transpose(1, 2)            # (b, h, n, 1 | d)
        if self.out_gate is not None:
            merged = out.transpose(1, 2).reshape(b, n, h * d)
            logits = logits + self.out_gate(merged).view(b, n, h, -1).transpose(1, 2)
        if self.in_gate is not None or self.out_gate is not None:
            out = out * self.act(logits)
        return self.output(out, x)


def output_stage(dim: int, cfg: AttentionConfig) -> nn.Module:
    """The block's output stage: merge and project (mixing.Output, with AlphaFold2's gate_values unless it is
    the fused gate's input), behind the gates the config asks for and NormFormer's head scale (attn_head_scale,
    head_scale.py)."""
    fused, o = hybrid(cfg), cfg.scores
    output = Output(dim, cfg.heads, cfg.dim_head, cfg.gate_values and not fused, cfg.on_attn, cfg.out_bias)
    if fused or (o is not None and o.gate_value_heads):
        output = HeadGates(output, dim, cfg.heads, cfg.dim_head, o.gate_value_heads, o, cfg.gate_values and fused)
    return head_scale.wrap(output, cfg)
