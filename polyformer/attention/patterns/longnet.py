"""LongNet's dilated attention (arXiv:2307.02486): for each (w, r), the sequence in segments of w,
every r-th token of a segment (head offset: head index mod r), attention among them; the
configurations' outputs mixed by their softmax denominators. Positions are counted from 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...interfaces import Caps
from .layout import Geometry, Pairs, Part, causal_ok, keys_at


@dataclass(frozen=True)
class DilatedOptions:
    segments: tuple[tuple[int, int], ...]       # (w, r) pairs


class Dilated:
    options = DilatedOptions
    caps = Caps(exact=True, decode="keys")
    mixture = True          # its parts overlap: each configuration counts (see Layout)

    def __init__(self, segments: tuple[tuple[int, int], ...], causal: bool):
        self.segments, self.causal = segments, causal

    @classmethod
    def build(cls, opts: DilatedOptions, *, heads: int, causal: bool, layer: int = 0,
              choices: tuple = ()) -> "Dilated":
        return cls(opts.segments, causal)

    @staticmethod
    def check(opts: DilatedOptions, heads: int, causal: bool) -> list[str]:
        s = opts.segments
        if not s or not all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, int) and x >= 1 for x in p)
                            for p in s):
            return [f"attn_dilated needs ((w1, r1), (w2, r2), ...) with integers >= 1, got {s!r}"]
        if any(w % r for w, r in s):
            return [f"attn_dilated: each segment length must be a multiple of its rate, got {s!r}"]
        if all(r > 1 for _, r in s):
            return [f"attn_dilated needs one (w, 1) configuration, so every query attends, got {s!r}"]
        return []

    def member(self, pos: Tensor, w: int, r: int, head: Tensor) -> Tensor:
        return (pos % w) % r == head % r

    def config_sees(self, pr: Pairs, w: int, r: int) -> Tensor:
        return ((pr.qp // w == pr.kp // w) & self.member(pr.qp, w, r, pr.head)
                & self.member(pr.kp, w, r, pr.head) & causal_ok(pr, self.causal))

    def counts(self, pr: Pairs, geo: Geometry) -> Tensor:
        """How many configurations show each key (the reference weights keys by it)."""
        return sum(self.config_sees(pr, w, r).to(torch.int32) for w, r in self.segments)

    def sees(self, pr: Pairs, geo: Geometry) -> Tensor:
        return self.counts(pr, geo) > 0

    def parts(self, geo: Geometry) -> list[Part]:
        top = int(geo.k_pos.max())
        low = max(int(geo.q_pos.min()), 0)
        parts = []
        for w, r in self.segments:
            first, last = low // w, top // w
            start = torch.arange(first, last + 1, device=geo.device) * w                       # (G,)
            size = min(w, top + 1) // r + (1 if min(w, top + 1) % r else 0)
            for o in range(min(r, geo.heads)):
                heads = tuple(range(o, geo.heads, r))
                positions = start[:, None] + o + r * torch.arange(size, device=geo.device)     # (G, size)
                positions = positions.masked_fill(positions >= start[:, None] + w, -1)
                keys = keys_at(geo, positions)
                queries = (keys - geo.shift).masked_fill((keys < geo.shift), -1)

                def keep(pr: Pairs, w: int = w, r: int = r) -> Tensor:
                    return self.config_sees(pr, w, r)

                parts.append(Part(queries[:, None], keys[:, None], keep, heads if r > 1 else None))
        return parts
