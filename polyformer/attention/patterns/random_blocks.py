"""BigBird's random blocks (arXiv:2007.14062): each query block also sees r random key blocks,
never a future block in a Decoder, none the window or the global tokens already show (fewer than r
where fewer such blocks exist, as early blocks of a Decoder). Blocks are of positions (p // b).
Query block q takes the allowed key blocks k ranked first by a hash of (seed, layer, q, k) and, in
an Encoder, the number of blocks: the same input gives the same output, and a Decoder's choice for
a block never changes as the sequence grows (cached == uncached)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import checks
from ...interfaces import Caps
from .layout import Geometry, Pairs, Part, keys_at, position_blocks, rule


@dataclass(frozen=True)
class RandomOptions:
    blocks: int
    block_size: int = 64
    seed: int = 0


class RandomBlocks:
    options = RandomOptions
    caps = Caps(exact=True, decode="keys")

    def __init__(self, opts: RandomOptions, causal: bool, layer: int, near: int, first: int):
        self.r, self.b, self.seed = opts.blocks, opts.block_size, opts.seed
        self.causal, self.layer = causal, layer
        self.near, self.first = near, first     # blocks the window (each side) and the globals cover
        self._table: tuple[tuple[int, int], Tensor] | None = None

    @classmethod
    def build(cls, opts: RandomOptions, *, heads: int, causal: bool, layer: int = 0,
              choices: tuple = ()) -> "RandomBlocks":
        named = {c.name: c.options for c in choices}
        near = first = 0
        if "window" in named and named["window"].size is not None:
            w = named["window"]
            reach = (w.size - 1 if causal else w.size // 2) * max(w.dilation if isinstance(w.dilation, tuple)
                                                                  else (w.dilation,))
            near = -(-reach // opts.block_size)
        if "global" in named:
            first = -(-named["global"].tokens // opts.block_size)
        return cls(opts, causal, layer, near, first)

    @staticmethod
    def check(opts: RandomOptions, heads: int, causal: bool) -> list[str]:
        return checks.whole(opts.blocks, "attn_random_blocks") or checks.whole(opts.block_size, "attn_block_size")

    def table(self, geo: Geometry, last: int) -> Tensor:
        """(last + 1, r) key blocks of query blocks 0..last (-1 where fewer than r are allowed), on
        the geometry's device; kept while the shape it depends on stays."""
        n_blocks = -(-(geo.top + 1) // self.b)
        if not self.causal and self.r > n_blocks:
            raise ValueError(f"attn_random_blocks = {self.r}: a sequence of {n_blocks} blocks of "
                             f"attn_block_size = {self.b} has fewer blocks than that")
        width = last + 1 if self.causal else n_blocks        # candidate key blocks
        key = (last, width)
        if self._table is None or self._table[0] != key or self._table[1].device != geo.device:
            q = torch.arange(last + 1, device=geo.device)[:, None]
            k = torch.arange(width, device=geo.device)[None]
            allowed = (k >= self.first) & ((k - q).abs() > self.near) & ((k < q) if self.causal else True)
            score = draw(self.seed, self.layer, q, k, 0 if self.causal else n_blocks).masked_fill(~allowed, -1)
            top = score.topk(min(self.r, width), dim=-1)
            chosen = top.indices.masked_fill(top.values < 0, -1)
            chosen = F.pad(chosen, (0, self.r - chosen.shape[1]), value=-1)
            self._table = (key, chosen.sort(dim=-1, descending=True).values)
        return self._table[1]

    def sees(self, pr: Pairs, geo: Geometry) -> Tensor:
        qb, kb = pr.qp // self.b, pr.kp // self.b
        chosen = self.table(geo, geo.top // self.b)[qb.clamp(min=0)]          # (..., i, 1, r)
        return (chosen == kb[..., None]).any(-1)

    def parts(self, geo: Geometry) -> list[Part]:
        queries, number = position_blocks(geo, self.b)                      # (z, G, b)
        chosen = self.table(geo, int(number[-1]))[number]                    # (G, r)
        positions = chosen[..., None] * self.b + torch.arange(self.b, device=geo.device)
        positions = positions.masked_fill(chosen[..., None] < 0, -1).flatten(1)
        return [Part(queries[:, None], keys_at(geo, positions)[:, None], rule(self.sees, geo))]


M31 = 2**31 - 1


def draw(*keys: int | Tensor) -> Tensor:
    """A uniform integer in [0, 2^31 - 1) for each combination of `keys` (ints and broadcasting
    integer tensors): a multiplicative hash, each product below 2^62 so int64 never overflows."""
    h = torch.zeros((), dtype=torch.long)
    for key in keys:
        h = (h * 48271 + torch.as_tensor(key, dtype=torch.long) % M31 + 1) % M31
        h = (h ^ (h >> 15)) * 16807 % M31
    return h
