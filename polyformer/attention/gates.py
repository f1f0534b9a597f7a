"""Gates on each head's output before the heads merge, as x-transformers 2.x spells them.

gate_value_heads: out_h *= sigmoid(w_h . x + b_h), one gate per head from the block input, w = 0 and b = 10 at
init (nearly open), so a head can learn to add nothing (arXiv:2306.12929, "attend to nothing").
output_gate: out *= sigmoid(W o), from the merged attention output o itself, W bias-less and zero at init (a
gate of 1/2); per feature, or with output_gate_headwise one gate per head (x-transformers' output gate).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import AttentionConfig
from . import head_scale
from .mixing import Output


class HeadGates(nn.Module):
    """Gates the heads' outputs (b, h, n, dv), then runs the block's output stage (merge and project)."""

    def __init__(self, output: nn.Module, dim: int, heads: int, dim_value: int, value_heads: bool,
                 output_gate: bool, headwise: bool):
        super().__init__()
        self.output = output
        self.value_heads = None
        if value_heads:
            self.value_heads = nn.Linear(dim, heads)
            nn.init.zeros_(self.value_heads.weight)
            nn.init.constant_(self.value_heads.bias, 10.0)
        self.out_gate = None
        if output_gate:
            self.out_gate = nn.Linear(heads * dim_value, heads if headwise else heads * dim_value, bias=False)
            nn.init.zeros_(self.out_gate.weight)

    def forward(self, out: Tensor, x: Tensor) -> Tensor:
        b, h, n, d = out.shape
        if self.value_heads is not None:
            out = out * torch.sigmoid(self.value_heads(x)).transpose(1, 2)[..., None]     # (b, h, n, 1)
        if self.out_gate is not None:
            logits = self.out_gate(out.transpose(1, 2).reshape(b, n, h * d))              # (b, n, h | h d)
            out = out * torch.sigmoid(logits.view(b, n, h, -1).transpose(1, 2))
        return self.output(out, x)


def wrap(output: nn.Module, dim: int, cfg: AttentionConfig) -> nn.Module:
    """The output stage behind the gates the config asks for, or as it is."""
    o = cfg.scores
    if o is None or not (o.gate_value_heads or o.output_gate):
        return output
    return HeadGates(output, dim, cfg.heads, cfg.dim_head, o.gate_value_heads, o.output_gate, o.output_gate_headwise)


def output_stage(dim: int, cfg: AttentionConfig) -> nn.Module:
    """The block's output stage: merge and project (mixing.Output), behind the gates and NormFormer's head scale
    (attn_head_scale, head_scale.py) the config asks for."""
    output = Output(dim, cfg.heads, cfg.dim_head, cfg.gate_values, cfg.on_attn, cfg.out_bias)
    return head_scale.wrap(wrap(output, dim, cfg), cfg)
