"""A lone MoE layer and an explicit reference of what it computes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from polyformer.interfaces import Context
from polyformer.keywords import parse_layers
from polyformer.moe.experts import Experts
from polyformer.moe.layer import MoeFeedForward

ACTS = {"gelu": F.gelu, "swish": F.silu, "relu": F.relu, "relu_squared": lambda t: F.relu(t) ** 2}


def moe_layer(dim: int = 8, causal: bool = False, seed: int = 0, **keywords) -> MoeFeedForward:
    torch.manual_seed(seed)
    cfg = parse_layers(dict(dim=dim, depth=1, causal=causal, ff_moe=True, **keywords))
    return MoeFeedForward(dim, cfg).eval()


def context(x: torch.Tensor, causal: bool = False, mask: torch.Tensor | None = None) -> Context:
    return Context(pos=torch.arange(x.shape[1])[None], mask=mask, causal=causal)


def expert_out(ex: Experts, x: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e on x (..., dim), written out: act(x W_in + b) (GLU: value * act(gate)), then W_out."""
    h = x @ ex.w_in[e] + (ex.b_in[e] if ex.b_in is not None else 0)
    act = ACTS[activation(ex)]
    if ex.glu:
        value, gate = h.chunk(2, dim=-1)
        h = value * act(gate)
    else:
        h = act(h)
    return h @ ex.w_out[e] + (ex.b_out[e] if ex.b_out is not None else 0)


def activation(ex: Experts) -> str:
    kind = type(ex.act).__name__
    return {"GELU": "gelu", "SiLU": "swish", "ReLU": "relu", "ReluSquared": "relu_squared"}[kind]


def reference_keep(experts: torch.Tensor, real: torch.Tensor, num: int, k: int, c: float | None,
                   absolute: int | None, causal: bool) -> torch.Tensor:
    """The paper's priority, token by token: a choice of token i for expert e is kept iff fewer than the
    capacity of the row's earlier real tokens chose e (running capacity ceil(c (i+1) k / E) in a decoder,
    ceil(c n k / E) in an encoder, or the absolute one)."""
    b, n, _ = experts.shape
    keep = torch.zeros(experts.shape, dtype=torch.bool)
    for row in range(b):
        seen = [0] * num
        real_n = int(real[row].sum())
        i = 0
        for t in range(n):
            if not real[row, t]:
                continue
            if absolute is not None:
                cap = absolute
            else:
                cap = math.ceil(c * ((i + 1) if causal else real_n) * k / num - 1e-9)
            for j in range(k):
                e = int(experts[row, t, j])
                keep[row, t, j] = seen[e] < cap
                seen[e] += 1
            i += 1
    return keep


def reference_output(layer: MoeFeedForward, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """sum over the kept chosen experts of gate * expert(x), gates from softmax(x W_r^T) in float32."""
    o = layer.options
    probs = torch.softmax(x.float() @ layer.router.weight.float().T, dim=-1)
    gates, experts = probs.topk(o.top_k, dim=-1)
    if o.renormalized:
        gates = gates / gates.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for j in range(o.top_k):
        for e in range(o.num_experts):
            chosen = experts[..., j] == e
            if keep is not None:
                chosen = chosen & keep[..., j]
            out = out + torch.where(chosen[..., None], gates[..., j, None] * expert_out(layer.experts, x, e), 0.0)
    if layer.shared is not None:
        out = out + expert_out(layer.shared, x, 0)
    return out

