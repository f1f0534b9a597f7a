"""Rotary position embedding, RoPE (arXiv:2104.09864)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..config import Choice
from ..precision import upcast
from .rotary_scaling import SCALINGS


def rotary_angles(pos: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """(b|1, n) positions -> cos and sin of the angles, each (b|1, 1, n, r/2), in float32."""
    angles = (pos.float()[..., None] * inv_freq)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, angles: tuple[Tensor, Tensor], interleaved: bool = False, scale: float = 1.0) -> Tensor:
    """Rotate the first 2 * r/2 features of x (b, h, n, d) in pairs by angles given as (cos, sin), in
    at least float32; with `scale`, every feature is also multiplied by it.

    interleaved=False pairs feature i with i + r/2 (GPT-NeoX, Llama); True pairs (2i, 2i+1) (RoFormer).
    """
    r = angles[0].shape[-1] * 2
    rot, rest = upcast(x[..., :r]), x[..., r:]
    cos, sin = angles
    if scale != 1.0:
        cos, sin, rest = cos * scale, sin * scale, (upcast(rest) * scale).to(x.dtype)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = out.to(x.dtype)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def llama3_frequencies(inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_context: float) -> Tensor:
    """Llama 3's rotary scaling (Meta, "The Llama 3 Herd of Models", 2024): frequencies whose
    wavelength 2 pi / f is shorter than original_context / high_freq_factor are kept, those longer
    than original_context / low_freq_factor are divided by `factor`, and the band in between moves
    smoothly from one to the other."""
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength < original_context / high_freq_factor, inv_freq, scaled)
    return torch.where(wavelength > original_context / low_freq_factor, inv_freq / factor, scaled)


class Rotary(nn.Module):
    """Rotates queries and keys by angles pos * base^(-2i/r), so q.k depends only on the offset.

    interpolation: positions are divided by this factor (position interpolation, arXiv:2306.15595),
    i.e. every frequency is; llama3: (factor, low_freq_factor, high_freq_factor, original context)
    scales the low frequencies only (`llama3_frequencies`); scaling: a `config.Choice` of
    `rotary_scaling.SCALINGS` (YaRN, dynamic NTK, LongRoPE), whose frequencies may follow the current
    length n = max position + 1 and whose attention factor multiplies q and k. q.k still depends only
    on the offset (for a given n).
    """

    def __init__(self, dim_head: int, rotary_dim: int | None = None, base: float = 10000.0,
                 interleaved: bool = False, interpolation: float = 1.0,
                 llama3: tuple[float, float, float, float] | None = None, scaling: Choice | None = None):
        super().__init__()
        r = rotary_dim or dim_head - dim_head % 2
        self.interleaved = interleaved
        inv_freq = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
        if llama3 is not None:
            inv_freq = llama3_frequencies(inv_freq, *llama3)
        inv_freq = inv_freq / interpolation
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaled = SCALINGS[scaling.name](inv_freq, base, scaling.options) if scaling is not None else None
        self.scale = self.scaled.attention_factor if self.scaled is not None else 1.0
        self.follows_length = self.scaled is not None and self.scaled.follows_length

    def frequencies(self, length: Tensor | None) -> Tensor:
        """The inverse frequencies (r/2,) in float32 for a forward whose positions reach length - 1."""
        return self.inv_freq if self.scaled is None else self.scaled(length)

    def rotate(self, x: Tensor, pos: Tensor) -> Tensor:
        """x (b, h, n, d) at positions pos (b|1, n) rotated as `forward` rotates q or k there (alone: a
        length-following scaling sees only these positions)."""
        length = pos.max() + 1 if self.follows_length else None
        return apply_rotary(x, rotary_angles(pos, self.frequencies(length)), self.interleaved, self.scale)

    def forward(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        length = torch.maximum(q_pos.max(), k_pos.max()) + 1 if self.follows_length else None
        inv_freq = self.frequencies(length)
        q_angles = rotary_angles(q_pos, inv_freq)
        k_angles = q_angles if k_pos is q_pos else rotary_angles(k_pos, inv_freq)
        return (apply_rotary(q, q_angles, self.interleaved, self.scale),
                apply_rotary(k, k_angles, self.interleaved, self.scale))
