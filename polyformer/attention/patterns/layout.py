"""A pattern in gathered form, the block-sparse kernel's input: parts, each a set of query groups
and, per group, the keys its queries may see, with the exact rule inside (`keep`).

Indices: a query index t in [0, nq) is the queries' own; a key index u in [0, nk) counts the
positioned keys (persistent memory key / values excluded); the queries are the last nq keys, so
query t is key t + shift. Positions are explicit: key u has position u + off (one offset per row),
which `Geometry.of` checks on every kept key; patterns are defined on positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass
class Pairs:
    """Query-key pairs a rule is evaluated on, all broadcasting to (z, H, G, i, j)."""

    qp: Tensor              # query positions (z, H|1, G, i, 1)
    kp: Tensor              # key positions (z, H|1, G, 1, j)
    qi: Tensor              # query indices, same shape as qp
    ki: Tensor              # key indices, same shape as kp
    head: Tensor            # (H, 1, 1, 1) query head of each row of H


Rule = Callable[[Pairs], Tensor]


@dataclass
class Part:
    """One part of a pattern: queries[z, H, g] (Q indices, -1 = empty) see keys[z, H, g] (K
    indices, -1 = empty) where `keep` holds. Within a pattern the parts are disjoint (except a
    mixture's, see `Layout.mixture`); a query sits in at most one group of a part."""

    queries: Tensor         # (z, H, G, Q) long
    keys: Tensor            # (z, H, G, K) long
    keep: Rule
    heads: tuple[int, ...] | None = None   # the query heads it serves (H == 1 or len(heads)); None: all
    band: int | None = None     # when set: group g holds queries [g Q, g Q + Q) and sees keys from g Q + band
                                # on, K in a row (a window): the kernel reads them as strided views, no gather


@dataclass
class Geometry:
    """One forward's facts a pattern reads: where queries and keys sit, the forward's global_mask.
    Built once per forward (`Geometry.of`) and passed to every rule and layout builder."""

    nq: int
    nk: int
    q_pos: Tensor           # (z|1, nq)
    k_pos: Tensor           # (z|1, nk)
    off: Tensor | None      # (z|1, 1): key u has position u + off; None when positions are not one run
    causal: bool
    heads: int
    top: int                # the largest key position
    flags: Tensor | None = None     # (b, nk) bool: keys marked global by the forward's global_mask

    @property
    def run(self) -> bool:
        """Whether the keys are one run of positions per row, the queries their last nq: the block-sparse
        kernel's layouts need it; otherwise the dense reference reads positions directly."""
        return self.off is not None

    @property
    def shift(self) -> int:
        return self.nk - self.nq

    @property
    def device(self) -> torch.device:
        return self.k_pos.device

    @staticmethod
    def of(q_pos: Tensor, k_pos: Tensor, k_mask: Tensor | None, causal: bool, heads: int,
           flags: Tensor | None = None) -> "Geometry":
        nq, nk = q_pos.shape[-1], k_pos.shape[-1]
        top = int(k_pos.max())
        off = k_pos[..., -1:] - (nk - 1)
        run = k_pos == torch.arange(nk, device=k_pos.device) + off
        if k_mask is not None:
            run = run | ~k_mask
        if nq > nk or not bool(run.all()) or not bool((q_pos == k_pos[..., nk - nq:]).all()):
            off = None
        return Geometry(nq, nk, q_pos, k_pos, off, causal, heads, top, flags)


def rule(sees: Callable[[Pairs, Geometry], Tensor], geo: Geometry) -> Rule:
    """A piece's rule bound to this forward's geometry: a Part's `keep`."""
    return lambda pr: sees(pr, geo)


def take(t: Tensor, idx: Tensor) -> Tensor:
    """t (z', n) read at idx (z, ...) along its last dim, -1 read as 0: (max(z, z'), ...)."""
    z = max(t.shape[0], idx.shape[0])
    flat = idx.clamp(min=0).reshape(idx.shape[0], -1).expand(z, -1)
    return t.expand(z, -1).gather(1, flat).view(z, *idx.shape[1:])


def valid(idx: Tensor, n: int) -> Tensor:
    """idx with every entry outside [0, n) replaced by -1."""
    return idx.masked_fill((idx < 0) | (idx >= n), -1)


def blocks(n: int, size: int, device: torch.device) -> Tensor:
    """(G, size): 0..n-1 in consecutive groups, -1 past the end."""
    g = -(-n // size)
    return valid(torch.arange(g * size, device=device).view(g, size), n)


def residue_blocks(n: int, step: int, size: int, device: torch.device) -> Tensor:
    """(G, size): the indices of each residue class mod `step`, in groups of `size`, -1 past the end."""
    per = -(-n // step)
    g = -(-per // size)
    t = torch.arange(g * size, device=device).view(1, g, size) * step
    return valid(t + torch.arange(step, device=device).view(step, 1, 1), n).view(step * g, size)


def select(flags: Tensor) -> Tensor:
    """flags (z, n) bool -> (z, M) the indices of the True entries in order, -1 padded; M = the
    largest count (0 when none)."""
    count = int(flags.sum(-1).max()) if flags.numel() else 0
    order = torch.sort((~flags).to(torch.int8), dim=-1, stable=True).indices[:, :count]
    return order.masked_fill(~flags.gather(1, order), -1)


def position_blocks(geo: Geometry, size: int) -> tuple[Tensor, Tensor]:
    """Queries grouped by position block p // size: (z, G, size) query indices (-1 = none) and the
    block number of each group (G,)."""
    first = int(geo.q_pos.min()) // size
    last = int(geo.q_pos.max()) // size
    number = torch.arange(first, last + 1, device=geo.device)
    start = number[:, None] * size + torch.arange(size, device=geo.device)     # positions (G, size)
    return valid(start[None] - geo.off[:, :, None] - geo.shift, geo.nq), number


def keys_at(geo: Geometry, positions: Tensor) -> Tensor:
    """Key indices (z, ...) of positions (G, K) (-1 where no key has that position)."""
    idx = positions[None] - geo.off.view(-1, *([1] * positions.dim()))
    return valid(idx.masked_fill(positions[None] < 0, -1), geo.nk)


def causal_ok(pr: Pairs, causal: bool) -> Tensor | bool:
    return pr.kp <= pr.qp if causal else True
