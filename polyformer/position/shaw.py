"""Relative position representations (Shaw, Uszkoreit and Vaswani 2018, arXiv:1803.02155).

Learned embeddings a_c of the clipped distance c = clip(j - i, -k, k) (one table for keys, one for
values, shared by the heads, per layer), added to the keys inside the scores and to the values inside
the weighted sum:

    e_ij = q_i · (k_j + a^K_ij) / √d,        z_i = Σ_j α_ij (v_j + a^V_ij).

q_i · a^K_ij is gathered from q_i · a^K_c for the 2k + 1 distances (a bias the fused path takes); the
value term Σ_c (Σ_{j: c_ij = c} α_ij) a^V_c needs the weights, so `rel_pos_shaw_values=True` (the
paper's default) runs the dense kernel's reference path; `rel_pos_shaw_values=False` keeps the fused one.
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


@dataclass(frozen=True)
class ShawOptions:
    max_distance: int               # k: distances beyond ±k share the embedding of ±k
    values: bool = True             # the value term a^V (the paper's); False: keys only


def clipped(q_pos: Tensor, k_pos: Tensor, k: int) -> Tensor:
    """(b|1, i), (b|1, j) -> the index clip(j - i, -k, k) + k of each pair, (b|1, i, j) in [0, 2k]."""
    return (k_pos[..., None, :] - q_pos[..., :, None]).clamp(-k, k) + k


class ShawRelative(RelativeStage):
    """Shaw et al.'s relative keys (and values) on q (b, h, i, d), keys (b, hk, j, d)."""

    def __init__(self, options: ShawOptions, *, dim: int, heads: int, dim_head: int,
                 shared: nn.Module | None = None):
        super().__init__()
        self.k = options.max_distance
        self.key_emb = nn.Parameter(torch.randn(2 * self.k + 1, dim_head) * dim_head ** -0.5)
        self.value_emb = nn.Parameter(torch.randn(2 * self.k + 1, dim_head) * dim_head ** -0.5) if options.values else None
        self.reads_weights = options.values

    @staticmethod
    def check(options: ShawOptions, cfg: LayersConfig) -> list[str]:
        found = checks.whole(options.max_distance, "rel_pos_shaw")
        found += checks.flag(options.values, "rel_pos_shaw_values")
        return found

    def terms(self, q: Tensor, kv: KV, q_pos: Tensor, scale: float) -> Tensor:
        index = clipped(q_pos, kv.pos, self.k)                                   # (b|1, i, j - free)
        per_distance = upcast(q) @ upcast(self.key_emb).t()                     # (b, h, i, 2k + 1)
        terms = torch.take_along_dim(per_distance, index[:, None], dim=-1)     # (b, h, i, j - free)
        return pad_free(terms * scale, kv.free)

    def values(self, weights: Tensor, kv: KV, q_pos: Tensor) -> Tensor:
        index = clipped(q_pos, kv.pos, self.k)
        w = upcast(weights[..., kv.free:])                                      # (b, h, i, j - free)
        mass = w.new_zeros(*w.shape[:-1], 2 * self.k + 1)
        mass.scatter_add_(-1, index[:, None].expand_as(w), w)                  # weight per clipped distance
        return mass @ upcast(self.value_emb)                                    # (b, h, i, d)
