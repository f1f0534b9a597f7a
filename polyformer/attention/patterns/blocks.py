"""Block patterns: Image Transformer local 1D blocks (arXiv:1802.05751): a query block of q sees
its own block (causal inside in a Decoder) and the m positions before it (and after it, in an
Encoder); blockwise self-attention (BlockBERT, arXiv:1911.02972): the sequence in m blocks, head
group s lets block i attend to block (i + s) mod m; summary columns (Sparse Transformer "fixed" A2,
arXiv:1904.10509): keys with j mod l >= l - c."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ... import checks
from ...interfaces import Caps
from .layout import Geometry, Pairs, Part, blocks, causal_ok, keys_at, position_blocks, rule, select

GROUP = 64


@dataclass(frozen=True)
class BlockLocalOptions:
    query_block: int
    memory: int = 0


class BlockLocal:
    options = BlockLocalOptions
    caps = Caps(exact=True, decode="keys")

    def __init__(self, query_block: int, memory: int, causal: bool):
        self.q, self.m, self.causal = query_block, memory, causal

    @classmethod
    def build(cls, opts: BlockLocalOptions, *, heads: int, causal: bool, layer: int = 0,
              choices: tuple = ()) -> "BlockLocal":
        return cls(opts.query_block, opts.memory, causal)

    @staticmethod
    def check(opts: BlockLocalOptions, heads: int, causal: bool) -> list[str]:
        if not isinstance(opts.query_block, int) or opts.query_block < 1 or not isinstance(opts.memory, int) \
                or opts.memory < 0:
            return [f"attn_block_local = (query_block, memory) needs query_block >= 1 and memory >= 0, "
                    f"got {(opts.query_block, opts.memory)!r}"]
        return []

    def sees(self, pr: Pairs, geo: Geometry) -> Tensor:
        start = (pr.qp // self.q) * self.q
        end = start + self.q + (0 if self.causal else self.m)
        return (pr.kp >= start - self.m) & (pr.kp < end) & causal_ok(pr, self.causal)

    def parts(self, geo: Geometry) -> list[Part]:
        queries, number = position_blocks(geo, self.q)                     # (z, G, q)
        width = self.m + self.q + (0 if self.causal else self.m)
        positions = number[:, None] * self.q - self.m + torch.arange(width, device=geo.device)
        return [Part(queries[:, None], keys_at(geo, positions)[:, None], rule(self.sees, geo))]


@dataclass(frozen=True)
class SummaryOptions:
    stride: int
    summary: int = 1


class Summary:
    """Every query sees the keys at j mod l >= l - c (causal in a Decoder)."""

    options = SummaryOptions
    caps = Caps(exact=True, decode="keys")

    def __init__(self, stride: int, summary: int, causal: bool):
        self.l, self.c, self.causal = stride, summary, causal

    def sees(self, pr: Pairs, geo: Geometry) -> Tensor:
        return (pr.kp % self.l >= self.l - self.c) & causal_ok(pr, self.causal)

    def parts(self, geo: Geometry) -> list[Part]:
        keys = select(geo.k_pos.expand(geo.off.shape[0], -1) % self.l >= self.l - self.c)     # (z, M)
        queries = blocks(geo.nq, GROUP, geo.device)
        return [Part(queries[None, None], keys[:, None, None].expand(-1, 1, queries.shape[0], -1),
                     rule(self.sees, geo))]


@dataclass(frozen=True)
class BlockwiseOptions:
    blocks: int


class Blockwise:
    options = BlockwiseOptions
    caps = Caps(exact=True, causal=False, decode="keys")

    def __init__(self, m: int, heads: int):
        self.m, self.heads = m, heads

    @classmethod
    def build(cls, opts: BlockwiseOptions, *, heads: int, causal: bool, layer: int = 0,
              choices: tuple = ()) -> "Blockwise":
        return cls(opts.blocks, heads)

    @staticmethod
    def check(opts: BlockwiseOptions, heads: int, causal: bool) -> list[str]:
        if wrong := checks.whole(opts.blocks, "attn_blockwise"):
            return wrong
        if heads % opts.blocks:
            return [f"attn_blockwise = {opts.blocks} splits the heads over {opts.blocks} block shifts: heads "
                    f"({heads}) must be a multiple of it"]
        return []

    def size(self, geo: Geometry) -> int:
        """The block length: ceil(n / m) of this forward's keys."""
        return -(-geo.nk // self.m)

    def sees(self, pr: Pairs, geo: Geometry) -> Tensor:
        s, size = pr.head // (self.heads // self.m), self.size(geo)
        return pr.kp // size == (pr.qp // size + s) % self.m

    def parts(self, geo: Geometry) -> list[Part]:
        size = self.size(geo)
        queries, number = position_blocks(geo, size)                       # (z, G, size)
        per = self.heads // self.m
        parts = []
        for s in range(self.m):
            target = (number + s) % self.m
            positions = target[:, None] * size + torch.arange(size, device=geo.device)
            parts.append(Part(queries[:, None], keys_at(geo, positions)[:, None], rule(self.sees, geo),
                              tuple(range(s * per, (s + 1) * per)) if self.m > 1 else None))
        return parts


@dataclass(frozen=True)
class Local2dOptions:
    image: tuple[int, int]
    query: tuple[int, int]
    memory: tuple[int, int] = (0, 0)


class Local2d:
    """Image Transformer local 2D: raster-ordered tokens of an H x W image; a qh x qw query
    rectangle sees mh rows above it (and below, in an Encoder) and mw columns each side."""

    options = Local2dOptions
    caps = Caps(exact=True, decode="keys")

    def __init__(self, opts: Local2dOptions, causal: bool):
        (self.h, self.w), (self.qh, self.qw), (self.mh, self.mw) = opts.image, opts.query, opts.memory
        self.causal = causal

    @classmethod
    def build(cls, opts: Local2dOptions, *, heads: int, causal: bool, layer: int = 0,
              choices: tuple = ()) -> "Local2d":
        return cls(opts, causal)

    @staticmethod
    def check(opts: Local2dOptions, heads: int, causal: bool) -> list[str]:
        pairs = (opts.image, opts.query, opts.memory)
        if not all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, int) for x in p) for p in pairs):
            return [f"attn_local_2d needs image=(H, W), query=(qh, qw), memory=(mh, mw) as integer pairs, got {opts!r}"]
        (h, w), (qh, qw), (mh, mw) = pairs
        if min(h, w, qh, qw) < 1 or min(mh, mw) < 0 or h % qh or w % qw:
            return [f"attn_local_2d: the query rectangle {(qh, qw)} must tile the image {(h, w)} and the memory "
                    f"{(mh, mw)} be >= 0"]
        return []

    def rows_cols(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        return pos // self.w, pos % self.w

    def sees(self, pr: Pairs, geo: Geometry) -> Tensor:
        qr, qc = self.rows_cols(pr.qp)
        kr, kc = self.rows_cols(pr.kp)
        r0, c0 = (qr // self.qh) * self.qh, (qc // self.qw) * self.qw
        rows = (kr >= r0 - self.mh) & (kr < r0 + self.qh + (0 if self.causal else self.mh))
        cols = (kc >= c0 - self.mw) & (kc < c0 + self.qw + self.mw)
        return rows & cols & (pr.kp < self.h * self.w) & causal_ok(pr, self.causal)

    def parts(self, geo: Geometry) -> list[Part]:
        top = int(geo.k_pos.max())
        if top >= self.h * self.w:
            raise ValueError(f"attn_local_2d covers an image of {self.h} x {self.w} = {self.h * self.w} positions; "
                             f"got position {top}")
        dev = geo.device
        r0 = torch.arange(0, self.h, self.qh, device=dev).repeat_interleave(self.w // self.qw)
        c0 = torch.arange(0, self.w, self.qw, device=dev).repeat(self.h // self.qh)         # (G,)
        a, b = torch.arange(self.qh, device=dev), torch.arange(self.qw, device=dev)
        q_pos = ((r0[:, None, None] + a[:, None]) * self.w + c0[:, None, None] + b).flatten(1)   # (G, qh qw)
        rows = torch.arange(-self.mh, self.qh + (0 if self.causal else self.mh), device=dev)
        cols = torch.arange(-self.mw, self.qw + self.mw, device=dev)
        kr, kc = r0[:, None, None] + rows[:, None], c0[:, None, None] + cols                   # (G, R, C)
        inside = (kr >= 0) & (kr < self.h) & (kc >= 0) & (kc < self.w)
        k_pos = (kr * self.w + kc).masked_fill(~inside, -1).flatten(1)
        queries = keys_at(geo, q_pos) - geo.shift
        queries = queries.masked_fill((queries < 0) | (queries >= geo.nq), -1)
        # only the rectangles holding one of this forward's queries, and only the query / key slots one of them
        # fills: a sequence of a few image rows, or a decode step, uses few rectangles and few of their memory's
        # rows, and empty slots cost as much as full ones
        here = (queries >= 0).any(-1).any(0).nonzero().squeeze(1)
        queries, keys = queries[:, here], keys_at(geo, k_pos[here])        # (z, G', Q), (z, G', K)
        q_used, k_used = ((t >= 0).any(1).any(0).nonzero().squeeze(1) for t in (queries, keys))
        return [Part(queries[:, None][..., q_used], keys[:, None][..., k_used], rule(self.sees, geo))]
