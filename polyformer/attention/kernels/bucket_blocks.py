"""How `bucketed.py` lays its queries out: in blocks of at most `chunk` queries (sorted by bucket, then
position), each block reading one run of keys in the same order, the run that covers its queries' own.

Two layouts, the one that computes fewer scores is used: every `chunk` consecutive queries (small buckets
share a block; runs up to ~3 * chunk), or the queries of one chunk of one bucket (runs of at most 2 *
chunk). Blocks whose runs differ much in length are computed in up to three groups, each with the run
length of its longest block, so that a few long runs do not set the cost of all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

STEP = 8            # run lengths are rounded up to a multiple of this (and are at least this)
MAX_GROUPS = 3
GAIN = 0.95         # a further group must cut the scores computed by at least this factor


def _within(sorted_ids: Tensor) -> Tensor:
    """For ids sorted along dim 1: each element's index within its run of equal ids."""
    return torch.arange(sorted_ids.shape[1], device=sorted_ids.device) - torch.searchsorted(sorted_ids, sorted_ids)


def _split(values: list[int], counts: list[int]) -> tuple[list[int], int]:
    """Upper run lengths of at most MAX_GROUPS groups of blocks (distinct lengths `values`, ascending, with
    their `counts`), and the scores' cost: blocks x run summed over groups."""
    total = [0]
    for n in counts:
        total.append(total[-1] + n)

    def cost(cuts: tuple[int, ...]) -> int:     # cuts: index of each group's last value
        out, lo = 0, 0
        for cut in cuts:
            out, lo = out + (total[cut + 1] - total[lo]) * values[cut], cut + 1
        return out

    last = len(values) - 1
    best = ((last,), cost((last,)))
    for groups in range(2, MAX_GROUPS + 1):
        options = [cuts + (last,) for cuts in _increasing(last, groups - 1)]
        if not options:
            break
        cuts = min(options, key=cost)
        if cost(cuts) > GAIN * best[1]:
            break
        best = (cuts, cost(cuts))
    return [values[c] for c in best[0]], best[1]


def _increasing(below: int, k: int) -> list[tuple[int, ...]]:
    """Every increasing k-tuple of integers in [0, below)."""
    if k == 0:
        return [()]
    return [head + (x,) for head in _increasing(below, k - 1) for x in range((head[-1] + 1) if head else 0, below)]


@dataclass
class Blocks:
    count: int                  # blocks per row
    start: Tensor               # (rows, count): the first sorted key of each block's run
    query: Tensor               # (rows, count * chunk): the query of each slot (i: an empty slot)
    back: Tensor                # (rows, i): each query's slot
    runs: list[int]             # the groups' run lengths, ascending
    cost: int                   # scores computed per query slot
    length: Tensor = field(repr=False)   # (rows * count,): each block's run, rounded; 0: a block with no query

    def groups(self) -> list[tuple[Tensor, int]]:
        """(flat block ids, run length) per group: every block with queries, once."""
        out, low = [], 0
        for run in self.runs:
            out.append((torch.nonzero((self.length > low) & (self.length <= run)).flatten(), run))
            low = run
        return out


def _form(opens: Tensor, place: Tensor, q_order: Tensor, lo: Tensor, hi: Tensor, chunk: int, j: int) -> Blocks:
    rows, i = q_order.shape
    block = opens.long().cumsum(1) - 1
    count = int(block[:, -1].max()) + 1
    start = torch.full((rows, count), j, device=lo.device).scatter_reduce(1, block, lo, "amin")
    end = torch.zeros_like(start).scatter_reduce(1, block, hi, "amax")
    used = torch.zeros_like(start, dtype=torch.bool).scatter_(1, block, True)
    length = torch.where(used, ((end - start).clamp(min=1) + STEP - 1) // STEP * STEP, 0).view(-1)
    values, counts = torch.unique(length[length > 0], return_counts=True)
    runs, cost = _split(values.tolist(), counts.tolist())
    slot = block * chunk + place
    query = torch.full((rows, count * chunk), i, device=lo.device).scatter_(1, slot, q_order)
    back = torch.empty_like(slot).scatter_(1, q_order, slot)
    return Blocks(count, start, query, back, runs, cost, length)


def layout(q_order: Tensor, lo: Tensor, hi: Tensor, chunk_ids: Tensor, chunk: int, j: int) -> Blocks:
    """Blocks for the queries in order q_order (rows, i), reading the sorted keys [lo, hi) (rows, i) each;
    chunk_ids (rows, i): which chunk of which bucket each query reads (equal ids: the same run)."""
    rows, i = q_order.shape
    lo_s, hi_s = lo.gather(1, q_order), hi.gather(1, q_order)
    plain = torch.arange(i, device=lo.device).expand(rows, i) % chunk
    within = _within(chunk_ids.gather(1, q_order)) % chunk
    packed = _form(plain == 0, plain, q_order, lo_s, hi_s, chunk, j)
    by_chunk = _form(within == 0, within, q_order, lo_s, hi_s, chunk, j)
    return packed if packed.cost <= by_chunk.cost else by_chunk
