"""Rotary position embedding, RoPE (arXiv:2104.09864), with xPos's decay (arXiv:2212.10554) and rotation of
only some heads (x-transformers' rotate_num_heads)."""

from __future__ import annotations

import math
import torch
from torch import Tensor, nn

from .. import checks
from ..config import AttentionConfig, Choice, LayersConfig
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

    xpos: xPos's scale base gamma: q at position n is also multiplied by zeta_i^(n / gamma) in pair i, k by
    zeta_i^(-n / gamma), so q.k decays as zeta^((i - j) / gamma) with the offset (causal only). No centring: a
    cached key keeps its scale, and q.k is the same for any centre. heads: (h, n) rotate only the last n of
    h heads (x-transformers' rotate_num_heads); a tensor of fewer heads (GQA keys) rotates its last n * hk / h.
    """

    @classmethod
    def from_config(cls, dim_head: int, cfg: AttentionConfig) -> "Rotary":
        """The rotary of an attention block whose queries and keys have `dim_head` features."""
        xpos = (cfg.rotary_xpos_scale_base or 512.0) if cfg.rotary_xpos else None
        heads = (cfg.heads, cfg.rotary_heads) if cfg.rotary_heads not in (None, cfg.heads) else None
        return cls(dim_head, cfg.rotary_dim, cfg.rotary_base, cfg.rotary_interleaved, cfg.rotary_interpolation,
                   cfg.rotary_llama3, cfg.rotary_scaling, xpos=xpos, heads=heads)

    def __init__(self, dim_head: int, rotary_dim: int | None = None, base: float = 10000.0,
                 interleaved: bool = False, interpolation: float = 1.0,
                 llama3: tuple[float, float, float, float] | None = None, scaling: Choice | None = None, *,
                 xpos: float | None = None, heads: tuple[int, int] | None = None):
        super().__init__()
        r = rotary_dim or dim_head - dim_head % 2
        self.interleaved = interleaved
        self.heads = heads
        self.xpos = xpos
        if xpos is not None:    # zeta_i = (2i / r + 0.4) / 1.4 for pair i
            zeta = (torch.arange(0, r, 2, dtype=torch.float32) + 0.4 * r) / (1.4 * r)
            self.register_buffer("log_zeta", zeta.log() / xpos, persistent=False)
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
        """x (b, h, n, d) at positions pos (b|1, n) rotated as `forward` rotates k there (alone: a
        length-following scaling sees only these positions). Without xPos, q is rotated alike."""
        length = pos.max() + 1 if self.follows_length else None
        return self.apply(x, self.decayed(rotary_angles(pos, self.frequencies(length)), pos, -1.0))

    def decayed(self, angles: tuple[Tensor, Tensor], pos: Tensor, sign: float) -> tuple[Tensor, Tensor]:
        """(cos, sin) times xPos's scale zeta^(sign * pos / gamma) (queries +1, keys -1); unchanged without xPos."""
        if self.xpos is None:
            return angles
        scale = torch.exp(sign * pos.float()[:, None, :, None] * self.log_zeta)      # (b|1, 1, n, r/2)
        return angles[0] * scale, angles[1] * scale

    def apply(self, x: Tensor, angles: tuple[Tensor, Tensor]) -> Tensor:
        """x (b, h, n, d) rotated by angles; with `heads`, only its last heads."""
        if self.heads is None:
            return apply_rotary(x, angles, self.interleaved, self.scale)
        n = self.heads[1] * x.shape[1] // self.heads[0]
        if n == 0:
            return x
        return torch.cat((x[:, :-n], apply_rotary(x[:, -n:], angles, self.interleaved, self.scale)), dim=1)

    def forward(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        length = torch.maximum(q_pos.max(), k_pos.max()) + 1 if self.follows_length else None
        inv_freq = self.frequencies(length)
        q_angles = rotary_angles(q_pos, inv_freq)
        k_angles = q_angles if k_pos is q_pos else rotary_angles(k_pos, inv_freq)
        return self.apply(q, self.decayed(q_angles, q_pos, 1.0)), self.apply(k, self.decayed(k_angles, k_pos, -1.0))


def problems(cfg: LayersConfig) -> list[str]:
    """What rotary_xpos / rotate_num_heads cannot do in this stack, naming the keywords."""
    found: list[str] = []
    for a in cfg.self_attention:
        base = a.rotary_xpos_scale_base
        if base is not None and not a.rotary_xpos:
            found.append("rotary_xpos_scale_base needs rotary_xpos=True")
        if base is not None and not (checks.number(base) and base > 0):
            found.append(f"rotary_xpos_scale_base must be a positive number, got {base!r}")
        if a.rotary_xpos and not cfg.causal:
            found.append("rotary_xpos decays scores with the distance to earlier keys: it needs causal attention "
                         "(a Decoder); later keys' scores would grow without bound")
        if a.rotary_xpos and cfg.early_exit is not None:
            found.append("rotary_xpos scales queries and keys apart; exit_layers re-rotates keys as queries")
        if a.rotary_heads is not None:
            found += _head_problems(a, cfg)
        if (a.rotary_xpos or a.rotary_heads is not None) and cfg.mixer is not None:
            found.append("rotary_xpos / rotate_num_heads act on attention heads; a mixer (attn_fnet, gau) has its own")
    return found


def _head_problems(a: AttentionConfig, cfg: LayersConfig) -> list[str]:
    n, h = a.rotary_heads, a.heads
    found = checks.whole(n, "rotate_num_heads")
    if found:
        return found
    if n > h:
        found.append(f"rotate_num_heads ({n}) must be at most heads ({h})")
    if a.position != "rotary":
        found.append("rotate_num_heads needs rotary_pos_emb=True")
    hk = a.kv_heads or h
    if (n * hk) % h:
        found.append(f"rotate_num_heads ({n}) must cover whole groups of query heads sharing a kv head "
                     f"(heads {h} / attn_kv_heads {hk} = {h // hk} per group)")
    if a.collab_heads:
        found.append("rotate_num_heads rotates some heads; attn_collab_heads shares one key across heads")
    if a.rotary_scaling is not None and a.rotary_scaling.name in ("yarn", "longrope"):
        found.append("rotate_num_heads and rotary_yarn / rotary_longrope: their attention factor would reach only "
                     "the rotated heads; choose one")
    return found
