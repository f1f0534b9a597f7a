"""BigBird's block-sparse layout (arXiv:2007.14062) as Hugging Face's `BigBirdModel` computes it
(attention_type="block_sparse") in eval mode. Positions fall in blocks of b, p // b; like Hugging
Face, which pads its input to a multiple of b inside its forward, the last, partial block counts as
a whole block (its missing positions are keys nobody sees), so any length is taken. Of nb blocks,
the first and the last query blocks see every key; every other query block q sees the key blocks
{0, q - 1, q, q + 1, nb - 1} once and r "random" blocks. Hugging Face draws the random blocks only
while training (a NumPy table); in eval mode each of the r is block 0, so block 0 is shown 1 + r
times: a mixture, a key shown c times weighs c times (log-multiplicity). An input of at most
(5 + 2 r) b positions gets full attention, as Hugging Face's switch to "original_full" gives it.
Encoder only: the layout lets queries see later keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ... import checks
from ...interfaces import Caps
from .layout import Geometry, Pairs, Part, blocks, keys_at, position_blocks, rule, select


@dataclass(frozen=True)
class BigBirdBlocksOptions:
    block_size: int
    random_blocks: int = 3


class BigBirdBlocks:
    options = BigBirdBlocksOptions
    caps = Caps(exact=True, decode="keys", causal=False)
    mixture = True          # block 0 is shown 1 + r times to the inner query blocks

    def __init__(self, opts: BigBirdBlocksOptions):
        self.b, self.r = opts.block_size, opts.random_blocks

    @classmethod
    def build(cls, opts: BigBirdBlocksOptions, *, heads: int, causal: bool, layer: int = 0,
              choices: tuple = ()) -> "BigBirdBlocks":
        return cls(opts)

    @staticmethod
    def check(opts: BigBirdBlocksOptions, heads: int, causal: bool) -> list[str]:
        return (checks.whole(opts.block_size, "attn_bigbird_blocks: block_size")
                + checks.whole(opts.random_blocks, "attn_bigbird_blocks: random_blocks", 0))

    def full(self, geo: Geometry) -> bool:
        """Whether the input is short enough for full attention: at most (5 + 2 r) b positions."""
        return geo.top + 1 <= (5 + 2 * self.r) * self.b

    def table(self, nb: int, device: torch.device) -> Tensor:
        """(nb, nb) int32: how many times query block q is shown key block k."""
        q = torch.arange(nb, device=device)[:, None]
        k = torch.arange(nb, device=device)[None]
        edge_q, edge_k = (q == 0) | (q == nb - 1), (k == 0) | (k == nb - 1)
        once = edge_q | edge_k | ((k - q).abs() <= 1)
        return once.to(torch.int32) + self.r * ((k == 0) & ~edge_q).to(torch.int32)

    def counts(self, pr: Pairs, geo: Geometry) -> Tensor:
        """(z, 1, 1, i, j) int32: how many times each key is shown to each query."""
        qb, kb = pr.qp.clamp(min=0) // self.b, pr.kp.clamp(min=0) // self.b
        if self.full(geo):
            return torch.ones_like(qb + kb, dtype=torch.int32)
        return self.table(geo.top // self.b + 1, geo.device)[qb, kb]

    def sees(self, pr: Pairs, geo: Geometry) -> Tensor:
        return self.counts(pr, geo) > 0

    def parts(self, geo: Geometry) -> list[Part]:
        """Overlapping parts, a key in as many parts as its count: the query blocks that see every key,
        then, for m = 1 .. 1 + r, the inner query blocks with the key blocks shown at least m times."""
        keep = rule(self.sees, geo)
        every = blocks(geo.nk, geo.nk, geo.device)                          # (1, nk)
        if self.full(geo):
            queries = blocks(geo.nq, self.b, geo.device)                    # (G, b)
            return [Part(queries[None, None], every[None, None].expand(1, 1, queries.shape[0], -1), keep)]
        nb = geo.top // self.b + 1
        queries, number = position_blocks(geo, self.b)                      # (z, G, b), (G,)
        edge = (number == 0) | (number == nb - 1)
        parts = []
        if bool(edge.any()):
            outer = queries[:, edge][:, None]
            parts.append(Part(outer, every[None, None].expand(1, 1, outer.shape[2], -1), keep))
        inner = ~edge
        if not bool(inner.any()):
            return parts
        shown = self.table(nb, geo.device)[number[inner]]                   # (G', nb)
        for m in range(1, int(shown.max()) + 1):
            chosen = select(shown >= m)                                     # (G', M) key blocks
            positions = chosen[..., None] * self.b + torch.arange(self.b, device=geo.device)
            positions = positions.masked_fill(chosen[..., None] < 0, -1).flatten(1)
            parts.append(Part(queries[:, inner][:, None], keys_at(geo, positions)[:, None], keep))
        return parts
