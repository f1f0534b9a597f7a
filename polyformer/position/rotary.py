"""Rotary position embedding, RoPE (arXiv:2104.09864)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rotary_angles(pos: Tensor, inv_freq: Tensor) -> Tensor:
    """(b|1, n) positions -> (b|1, 1, n, r/2) angles, in float32."""
    return (pos.float()[..., None] * inv_freq)[:, None]


def apply_rotary(x: Tensor, angles: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate the first 2 * angles.shape[-1] features of x (b, h, n, d) in pairs, in float32.

    interleaved=False pairs feature i with i + r/2 (GPT-NeoX, Llama); True pairs (2i, 2i+1) (RoFormer).
    """
    r = angles.shape[-1] * 2
    rot, rest = x[..., :r].float(), x[..., r:]
    cos, sin = angles.cos(), angles.sin()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1)


class Rotary(nn.Module):
    """Rotates queries and keys by angles pos * base^(-2i/r), so q.k depends only on the offset."""

    def __init__(self, dim_head: int, rotary_dim: int | None = None, base: float = 10000.0,
                 interleaved: bool = False):
        super().__init__()
        r = rotary_dim or dim_head - dim_head % 2
        self.interleaved = interleaved
        inv_freq = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        q = apply_rotary(q, rotary_angles(q_pos, self.inv_freq), self.interleaved)
        k = apply_rotary(k, rotary_angles(k_pos, self.inv_freq), self.interleaved)
        return q, k
