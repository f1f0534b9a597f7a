"""BigBird's random blocks (arXiv:2007.14062): each query block also sees r random key blocks,
never a future block in a Decoder, none the window or the global tokens already show (fewer
than r where fewer such blocks exist, as early blocks of a Decoder). Blocks are
of positions (p // b). The choice for query block q comes from a generator seeded by the seed, the
layer and q (and, in an Encoder, the number of blocks): the same input gives the same output, and
a Decoder's choice for a block never changes as the sequence grows (cached == uncached)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...interfaces import Caps
from .layout import Geometry, Pairs, Part, keys_at, position_blocks


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
        self._tables: dict[tuple[int, int], Tensor] = {}
        self.n_blocks = 1                       # blocks of the sequence: set per forward by `bind`

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
        if not isinstance(opts.blocks, int) or opts.blocks < 1:
            return [f"attn_random_blocks must be an integer >= 1, got {opts.blocks!r}"]
        if not isinstance(opts.block_size, int) or opts.block_size < 1:
            return [f"attn_block_size must be an integer >= 1, got {opts.block_size!r}"]
        return []

    def bind(self, flags: Tensor | None, shift: int, nk: int, top: int | None = None) -> None:
        self.n_blocks = -(-((top if top is not None else nk - 1) + 1) // self.b)
        if not self.causal and self.r > self.n_blocks:
            raise ValueError(f"attn_random_blocks = {self.r}: a sequence of {self.n_blocks} blocks of "
                             f"attn_block_size = {self.b} has fewer blocks than that")

    def table(self, last: int) -> Tensor:
        """(last + 1, r) key blocks of query blocks 0..last, -1 where fewer than r are allowed."""
        key = (last, self.n_blocks if not self.causal else -1)
        if key not in self._tables:
            rows = []
            for q in range(last + 1):
                g = torch.Generator().manual_seed(hash((self.seed, self.layer, q, key[1])) % 2**62)
                total = q if self.causal else self.n_blocks
                score = torch.rand(max(total, 1), generator=g)[:total]
                k = torch.arange(total)
                allowed = (k >= self.first) & ((k - q).abs() > self.near)
                score = score.masked_fill(~allowed, -1.0)
                top = score.topk(min(self.r, total)).indices if total else torch.zeros(0, dtype=torch.long)
                top = top[score[top] >= 0] if total else top
                rows.append(torch.cat((top.sort().values, torch.full((self.r - len(top),), -1))))
            self._tables = {key: torch.stack(rows)}
        return self._tables[key]

    def sees(self, pr: Pairs) -> Tensor:
        qb, kb = pr.qp // self.b, pr.kp // self.b
        chosen = self.table(int(qb.max())).to(qb.device)[qb.clamp(min=0)]      # (..., i, 1, r)
        return (chosen == kb[..., None]).any(-1)

    def parts(self, geo: Geometry) -> list[Part]:
        queries, number = position_blocks(geo, self.b)                      # (z, G, b)
        chosen = self.table(int(number[-1])).to(geo.device)[number]          # (G, r)
        positions = chosen[..., None] * self.b + torch.arange(self.b, device=geo.device)
        positions = positions.masked_fill(chosen[..., None] < 0, -1).flatten(1)
        return [Part(queries[:, None], keys_at(geo, positions)[:, None], self.sees)]
