"""Fixed sinusoidal positions (arXiv:1706.03762), and position-infused attention (arXiv:2012.15832)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..precision import upcast


def sinusoidal(pos: Tensor, dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32) -> Tensor:
    """(b|1, n) positions -> (b|1, n, dim): [sin(p w_i), cos(p w_i)] with w_i = base^(-2i/dim),
    computed in `dtype`."""
    half = dim // 2
    freq = torch.exp(-math.log(base) * torch.arange(half, device=pos.device, dtype=dtype) / half)
    angles = pos.to(dtype)[..., None] * freq
    emb = torch.cat((angles.sin(), angles.cos()), dim=-1)
    if dim % 2:
        emb = torch.nn.functional.pad(emb, (0, 1))
    return emb


class PositionInfusion(nn.Module):
    """Shortformer's position-infused attention: sinusoids added to the inputs of the query and
    key projections of every layer, never to the values."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        return x + sinusoidal(pos, self.dim, dtype=upcast(x).dtype).to(x.dtype)
