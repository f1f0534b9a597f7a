"""The decode state of an hourglass stack (hourglass.py): one `DecodeState` per resolution, each holding
the keys of the layers that run at it, chained from the full resolution to the shortest.

A level that shortens by k keeps, besides its layers' keys, every position's input to the shortening
(`feats`, padding zeroed) and the output of the next level for every shortened token (`shorts`): a step
pools the groups its tokens complete, runs them through the next level, and upsamples for its tokens the
last complete group of each. The next level's storage index is the group index, so a row whose group is
not complete yet (rows of a left-padded batch lag by at most one group) holds a masked placeholder there,
which the next step rolls back and writes again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kv_cache import DecodeState


def alignment(keep: Tensor | None, prefix: int, total: int, factor: int) -> tuple[Tensor | int, Tensor | int]:
    """Where each row's groups of `factor` start: (first, offset), each (b,) or an int for every row. `first`
    is the storage index of the first kept token after the `prefix` memory tokens (total when none is
    kept); a token at storage index t >= prefix sits at aligned index t + offset, offset = -first mod
    factor, so that the first text token's aligned index is a multiple of factor; the memory tokens sit
    right before it. keep: (b, total) bool, True = kept, or None (all)."""
    if keep is None:
        return prefix, -prefix % factor
    text = keep[:, prefix:]
    if text.shape[1] == 0:
        return torch.full_like(keep[:, 0], total, dtype=torch.long), -total % factor
    first = torch.where(text.any(-1), text.long().argmax(-1) + prefix, total)
    return first, -first % factor


def most(value: Tensor | int) -> int:
    """The largest entry of a per-row count (an int: the same for every row)."""
    return value if isinstance(value, int) else int(value.max())


def least(value: Tensor | int) -> int:
    """The smallest entry of a per-row count (an int: the same for every row)."""
    return value if isinstance(value, int) else int(value.min())


def at(start: int, total: int, first: Tensor | int, offset: Tensor | int, prefix: int,
       device: torch.device) -> Tensor:
    """The aligned indices (b|1, n) of storage positions start ... total - 1 (memory tokens right before the
    first text token)."""
    t = torch.arange(start, total, device=device)[None]
    first, offset = (v[:, None] if isinstance(v, Tensor) else v for v in (first, offset))
    where = t + offset
    return torch.where(t < prefix, t + first + offset - prefix, where) if prefix else where


def storage(aligned: Tensor, first: Tensor | int, offset: Tensor | int, prefix: int, total: int
            ) -> tuple[Tensor, Tensor]:
    """Aligned indices (1, g, k) -> the storage indices (b|1, g, k) holding them (clamped) and whether one
    does (memory tokens first, then text)."""
    first, offset = (v[:, None, None] if isinstance(v, Tensor) else v for v in (first, offset))
    t = aligned - offset
    valid = (t >= prefix) & (t < total)
    if prefix:
        j = aligned - (first + offset - prefix)
        memory = (j >= 0) & (j < prefix)
        t, valid = torch.where(memory, j, t), memory | valid
    return t.clamp(0, total - 1), valid


class HourglassState(DecodeState):
    """A `DecodeState` for the self-attention layers of one resolution (`kinds`, in the order the level runs
    them), with the next, shortened resolution's state in `child` (None at the shortest).

    feats: (b, max_len, dim) the inputs to the shortening by `factor`, padding zeroed.
    shorts: (b, child.max_len, dim) the next level's output for each shortened token.
    `layers` is the whole stack's count of self-attention blocks (what the stack checks a state against).
    """

    def __init__(self, kinds: tuple[str, ...], batch: int, max_len: int, heads: tuple[int, int, int, int], *,
                 total: int, factor: int | None, dim: int, child: "HourglassState | None", dtype: torch.dtype,
                 device: torch.device | str, history: int):
        super().__init__(len(kinds), batch, max_len, *heads, dtype=dtype, device=device, kinds=kinds,
                         history=history)
        self._extend(total, factor, child)
        self.feats = torch.zeros(batch, max_len, dim, dtype=dtype, device=device) if child is not None else None
        self.shorts = (torch.zeros(batch, child.max_len, dim, dtype=dtype, device=device)
                       if child is not None else None)

    def _extend(self, total: int, factor: int | None, child: "HourglassState | None") -> None:
        self.total_layers, self.factor, self.child = total, factor, child

    @property
    def layers(self) -> int:
        return self.total_layers

    def groups_done(self, length: int) -> int:
        """How many shortened tokens the next level holds after `length` positions: as many as the row
        furthest on has completed."""
        if length == 0:
            return 0
        _, offset = alignment(self.mask[:, :length], self.prefix, length, self.factor)
        return most((length - 1 + offset) // self.factor + 1)

    def rollback(self, n: int) -> None:
        """Forget the last n positions, at every resolution."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} positions of {self.length}")
        if self.child is not None and n:
            keep = self.groups_done(self.length - n)
            if self.child.length > keep:
                self.child.rollback(self.child.length - keep)
        super().rollback(n)

    def slide(self, n: int, keep: int = 0) -> None:
        raise ValueError("an hourglass decode state cannot slide its window: the shortened levels group positions "
                         "from the first; make the state long enough (max_len) for the whole generation")

    def clone(self) -> "HourglassState":
        new = super().clone()
        new._extend(self.total_layers, self.factor, self.child.clone() if self.child is not None else None)
        new.feats = self.feats.clone() if self.feats is not None else None
        new.shorts = self.shorts.clone() if self.shorts is not None else None
        return new

    def reorder(self, indices: Tensor) -> None:
        super().reorder(indices)
        if self.child is not None:
            self.feats = self.feats.index_select(0, indices)
            self.shorts = self.shorts.index_select(0, indices)
            self.child.reorder(indices)

    def nbytes(self) -> int:
        if self.child is None:
            return super().nbytes()
        return (super().nbytes() + self.child.nbytes()
                + sum(t.numel() * t.element_size() for t in (self.feats, self.shorts)))
