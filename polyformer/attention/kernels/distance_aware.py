"""DA-Transformer: distance-aware attention (Wu, Wu and Huang 2021, arXiv:2010.06925), a kernel of
form "direct". Each head h learns α_h and β_h; the relative distance R_h = α_h |i - j| rescales the
ReLU'd scores before the softmax:

    f(R) = (1 + e^β) / (1 + e^(β - R)) = (1 + e^β) σ(R - β),
    A = softmax(ReLU(q k^T) ⊙ f(R_h) / √d).

f(0) = 1, f rises monotonically from 0 (R -> -∞) to 1 + e^β (R -> ∞): a head with α < 0 prefers near
keys, one with α > 0 far ones, and α = 0 is ReLU attention without distance weighting. Distances are
read from the queries' and keys' positions; keys without a position (memory key / values) get f = 1.
A decode state keeps every key (decode="keys").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import checks
from ...config import LayersConfig
from ...interfaces import KV, AttnOut, Caps, KernelSpec
from ...precision import upcast
from ..normalize import masked_softmax
from .dense import match_heads


@dataclass(frozen=True)
class DistanceAwareOptions:
    alpha: float = 0.0              # α_h at initialisation (every head): 0 starts as plain ReLU attention
    beta: float = 0.0               # β_h at initialisation: f is bounded by 1 + e^β


def distance_weight(distance: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
    """f(α |i - j|): distance (..., i, j) >= 0, alpha and beta (h,) -> (..., h, i, j)."""
    r = alpha.view(-1, 1, 1) * distance.unsqueeze(-3).to(alpha.dtype)
    b = beta.view(-1, 1, 1)
    return torch.exp(F.softplus(b)) * torch.sigmoid(r - b)


class DistanceAware(nn.Module):
    """DA-Transformer heads on q (b, h, i, d), kv.k / kv.v (b, hk, j, d): out (b, h, i, dv)."""

    caps = Caps(exact=True, bias=False, causal=True, bidirectional=True, padding=True, decode="keys",
                form="direct", positional=True)
    options: type = DistanceAwareOptions

    def __init__(self, spec: KernelSpec):
        super().__init__()
        o: DistanceAwareOptions = spec.options
        self.alpha = nn.Parameter(torch.full((spec.heads,), float(o.alpha)))
        self.beta = nn.Parameter(torch.full((spec.heads,), float(o.beta)))
        self.scale = spec.scale
        self.dropout = nn.Dropout(spec.dropout)

    @staticmethod
    def check(options: DistanceAwareOptions, cfg: LayersConfig) -> list[str]:
        return [f"{name} must be a finite number, got {value!r}"
                for name, value in (("attn_distance_aware_alpha", options.alpha),
                                    ("attn_distance_aware_beta", options.beta)) if not checks.number(value)]

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        h, free = q.shape[1], kv.free
        k, v = match_heads(kv.k, h), match_heads(kv.v, h)
        scores = torch.relu(upcast(q) @ upcast(k).transpose(-1, -2))            # (b, h, i, j)
        offset = q_pos[..., :, None] - kv.pos[..., None, :]                      # (b|1, i, j - free)
        weight = distance_weight(offset.abs(), upcast(self.alpha), upcast(self.beta))
        scores = scores * F.pad(weight, (free, 0), value=1.0) * self.scale
        keep = kv.mask[:, None, :] if kv.mask is not None else None             # (b, 1, j - free)
        if causal:
            keep = offset >= 0 if keep is None else keep & (offset >= 0)
        if keep is not None:
            keep = F.pad(keep, (free, 0), value=True)[:, None]                   # (b|1, 1, i|1, j)
        weights = masked_softmax(scores, keep)                                   # a query seeing no key: 0
        out = self.dropout(weights).to(v.dtype) @ v
        return AttnOut(out.to(q.dtype), weights=weights.to(q.dtype) if need_weights else None)
