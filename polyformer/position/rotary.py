"""Rotary position embedding, RoPE (arXiv:2104.09864)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rotary_angles(pos: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """(b|1, n) positions -> cos and sin of the angles, each (b|1, 1, n, r/2), in float32."""
    angles = (pos.float()[..., None] * inv_freq)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, angles: tuple[Tensor, Tensor], interleaved: bool = False) -> Tensor:
    """Rotate the first 2 * r/2 features of x (b, h, n, d) in pairs by angles given as (cos, sin), in float32.

    interleaved=False pairs feature i with i + r/2 (GPT-NeoX, Llama); True pairs (2i, 2i+1) (RoFormer).
    """
    r = angles[0].shape[-1] * 2
    rot, rest = x[..., :r].float(), x[..., r:]
    cos, sin = angles
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = out.to(x.dtype)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


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
        q_angles = rotary_angles(q_pos, self.inv_freq)
        k_angles = q_angles if k_pos is q_pos else rotary_angles(k_pos, self.inv_freq)
        return (apply_rotary(q, q_angles, self.interleaved), apply_rotary(k, k_angles, self.interleaved))
