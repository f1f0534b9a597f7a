"""Transformer-XL's relative positional encoding (Dai et al. 2019, arXiv:1901.02860, section 3.3):

    A_ij = q_i·k_j + q_i·W_R R_{i-j} + u·k_j + v·W_R R_{i-j}

with R_d = [sin(d ω), cos(d ω)] (concatenated; ω_f = 10000^(-2f / dim), sinusoids of the model's
width), a learned W_R per layer and learned u, v per layer or shared by the layers
(`rel_pos_xl_shared_uv`). d = i - j is read from the queries' and keys' positions, in both
directions (an Encoder sees later keys: d < 0, as XLNet's bidirectional attention).

The positional terms are evaluated without a table of distances: with s_p = sin(p ω), c_p = cos(p ω),
sin((p - p') ω) and cos((p - p') ω) expand into products of the two positions' sinusoids, so
(q_i + v)·W_R R_{i-j} = [b s_i - a c_i, a s_i + b c_i] · [s_j, c_j], where [a, b] = (q_i + v) W_R.
That holds for any positions (padding, per-row positions, memories, a decode state) and is one
(i, dim) x (dim, j) product per head: its cost is heads times that of q·k. Positions are taken
relative to each row's first query, so the angles stay as small as the distances themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import checks
from ..config import LayersConfig
from ..interfaces import KV
from ..precision import upcast
from .relative import RelativeStage, pad_free
from .sinusoidal import sinusoidal


@dataclass(frozen=True)
class XLOptions:
    shared_uv: bool = False         # u and v held once by the stack for every layer


class XLBiases(nn.Module):
    """The global content bias u and position bias v, (heads, dim_head) each."""

    def __init__(self, heads: int, dim_head: int):
        super().__init__()
        self.u = nn.Parameter(torch.randn(heads, dim_head) * 0.02)
        self.v = nn.Parameter(torch.randn(heads, dim_head) * 0.02)


class XLRelative(RelativeStage):
    """The three relative terms of Transformer-XL's score on q (b, h, i, d), keys (b, hk, j, d)."""

    def __init__(self, options: XLOptions, *, dim: int, heads: int, dim_head: int,
                 shared: nn.Module | None = None):
        super().__init__()
        self.dim, self.heads = dim, heads
        self.to_r = nn.Linear(dim, heads * dim_head, bias=False)            # W_R
        self.own = XLBiases(heads, dim_head) if shared is None else None
        self._shared = (shared,) if shared is not None else ()              # held by the stack, registered there

    @staticmethod
    def shared(options: XLOptions, heads: int, dim_head: int) -> nn.Module | None:
        return XLBiases(heads, dim_head) if options.shared_uv else None

    @staticmethod
    def check(options: XLOptions, cfg: LayersConfig) -> list[str]:
        return checks.flag(options.shared_uv, "rel_pos_xl_shared_uv")

    @property
    def biases(self) -> XLBiases:
        return self.own if self.own is not None else self._shared[0]

    def terms(self, q: Tensor, kv: KV, q_pos: Tensor, scale: float) -> Tensor:
        from ..attention.kernels.dense import match_heads

        b, h, i, d = q.shape
        uv = self.biases
        q32 = upcast(q)
        k = upcast(match_heads(kv.k, h))
        content = torch.einsum("hd,bhjd->bhj", uv.u.to(q32.dtype), k)[:, :, None]   # u·k_j, free keys too
        w = upcast(self.to_r.weight).view(h, d, self.dim)
        coeff = torch.einsum("bhid,hdc->bhic", q32 + uv.v.to(q32.dtype)[:, None], w)   # (q + v) W_R: (b, h, i, dim)
        half = self.dim // 2
        a, c = coeff[..., :half], coeff[..., half:2 * half]                    # the sin and cos coefficients
        origin = q_pos[..., :1]
        sq = sinusoidal(q_pos - origin, 2 * half, dtype=q32.dtype)[:, None]   # (b|1, 1, i, dim)
        sk = sinusoidal(kv.pos - origin, 2 * half, dtype=q32.dtype)[:, None]  # (b|1, 1, j, dim)
        s_i, c_i = sq[..., :half], sq[..., half:]
        queries = torch.cat((c * s_i - a * c_i, a * s_i + c * c_i), dim=-1)   # (b, h, i, dim), against [s_j, c_j]
        position = queries @ sk.transpose(-1, -2)                               # (b, h, i, j - free)
        return (content + pad_free(position, kv.free)) * scale
