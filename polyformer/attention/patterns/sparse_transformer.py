"""The Sparse Transformer's factorised patterns (Child et al. 2019, arXiv:1904.10509), stride l:
strided A1 = {j : 0 <= i - j < l}, A2 = {j : (i - j) mod l = 0}; fixed A1 = {j : j // l = i // l},
A2 = {j : j mod l >= l - c}, causal in a Decoder (bidirectional: A1 strided |i - j| < l, A2 without
the causal cut). Split over heads (first half A1, second A2), merged in every head, or alternating
by layer (even layers A1)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from ... import checks
from ...interfaces import Caps
from .blocks import BlockLocal, Summary
from .layout import Geometry, Pairs, Part
from .window import Window, WindowOptions

MODES = ("heads", "union", "alternate")


@dataclass(frozen=True)
class SparseOptions:
    kind: str                           # "strided" or "fixed"
    stride: int
    summary: int = 1
    mode: str = "heads"


class SparseTransformer:
    options = SparseOptions
    caps = Caps(exact=True, decode="keys")

    def __init__(self, opts: SparseOptions, heads: int, causal: bool, layer: int):
        l = opts.stride
        if opts.kind == "strided":
            a1 = Window(WindowOptions(l if causal else 2 * (l - 1)), heads, causal)
            a2 = Window(WindowOptions(None, l), heads, causal)
        else:
            a1 = BlockLocal(l, 0, causal)
            a2 = Summary(l, opts.summary, causal)
        half = heads // 2
        if opts.mode == "heads":
            self.pieces = [(a1, tuple(range(half))), (a2, tuple(range(half, heads)))]
        elif opts.mode == "union":
            self.pieces = [(a1, None), (a2, None)]
        else:
            self.pieces = [(a1 if layer % 2 == 0 else a2, None)]
        self.heads = heads

    @classmethod
    def build(cls, opts: SparseOptions, *, heads: int, causal: bool, layer: int = 0,
              choices: tuple = ()) -> "SparseTransformer":
        return cls(opts, heads, causal, layer)

    @staticmethod
    def check(opts: SparseOptions, heads: int, causal: bool) -> list[str]:
        if opts.kind not in ("strided", "fixed"):
            return [f"attn_sparse must be 'strided' or 'fixed', got {opts.kind!r}"]
        if wrong := checks.whole(opts.stride, "attn_sparse_stride", 2 if opts.kind == "strided" else 1):
            return wrong
        if opts.kind == "fixed" and not (isinstance(opts.summary, int) and 1 <= opts.summary <= opts.stride):
            return [f"attn_sparse_summary must be in [1, attn_sparse_stride = {opts.stride}], got {opts.summary!r}"]
        if opts.kind == "strided" and opts.summary != 1:
            return ["attn_sparse_summary is the 'fixed' pattern's c; the 'strided' pattern has none"]
        if opts.mode not in MODES:
            return [f"attn_sparse_mode must be one of {list(MODES)}, got {opts.mode!r}"]
        if opts.mode == "heads" and heads < 2:
            return [f"attn_sparse_mode = 'heads' splits the two patterns over the heads: it needs heads >= 2, got {heads}"]
        return []

    def sees(self, pr: Pairs, geo: Geometry) -> Tensor:
        out = None
        for piece, heads in self.pieces:
            on = piece.sees(pr, geo)
            if heads is not None:
                on = on & (pr.head >= heads[0]) & (pr.head <= heads[-1])
            out = on if out is None else out | on
        return out

    def parts(self, geo: Geometry) -> list[Part]:
        parts = []
        first = self.pieces[0][0]
        for n, (piece, heads) in enumerate(self.pieces):
            for part in piece.parts(geo):
                if n and heads is None:         # union: A2 leaves A1's keys to A1
                    part = replace(part, keep=lambda pr, k=part.keep: k(pr) & ~first.sees(pr, geo))
                if heads is not None:
                    part = replace(part, heads=heads)
                parts.append(part)
        return parts
