"""Stages around the kernel: talking heads (arXiv:2003.02436), value gating (AlphaFold2), and the
output projection with attention-on-attention (arXiv:1908.06954)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import pooled


class TalkingHeads(nn.Module):
    """A learned heads x heads mix of per-head score maps, initialised to the identity."""

    def __init__(self, heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(heads))

    def forward(self, maps: Tensor) -> Tensor:
        return torch.einsum("bhij,hk->bkij", maps, self.weight.to(maps.dtype))


class Output(nn.Module):
    """Merges heads and projects back to `dim`.

    gate_values: out *= sigmoid(W x + b), per head feature, W = 0 and b = 1 at init (AlphaFold2).
    on_attn: a GLU on the merged heads, out = (A o) * sigmoid(B o) (attention-on-attention, in the
    form without the queries concatenated).
    bias: the projection has a bias (attention-on-attention's always has one).
    """

    def __init__(self, dim: int, heads: int, dim_value: int, gate_values: bool, on_attn: bool,
                 bias: bool = False):
        super().__init__()
        inner = heads * dim_value
        self.heads = heads
        self.gate = None
        if gate_values:
            self.gate = nn.Linear(dim, inner)
            nn.init.zeros_(self.gate.weight)
            nn.init.ones_(self.gate.bias)
        self.on_attn = on_attn
        self.proj = nn.Linear(inner, dim * 2 if on_attn else dim, bias=on_attn or bias)

    def forward(self, out: Tensor, x: Tensor) -> Tensor:
        b, h, n, d = out.shape
        out = out.transpose(1, 2).reshape(b, n, h * d)          # merge heads
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(x))
        out = pooled.linear(self.proj, out)
        if self.on_attn:
            value, gate = out.chunk(2, dim=-1)
            out = value * torch.sigmoid(gate)
        return out
