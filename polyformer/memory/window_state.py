"""The window kind of decode state (issue 17): a windowed stack (every self-attention block sees at most
the last `span` positions, plus the first `sinks`) keeps per layer a ring of span + history key slots
and one slot per sink, so its size is fixed however long generation runs.

The t-th position fed (memory tokens included) lives at ring slot t mod ring; the keys at positions
0 .. sinks - 1 are also copied to their own slots (the ring copy then hidden), so they outlive the
ring. Positions and padding are stored per slot, and the pattern reads positions alone, so the ring's
order does not matter: a query never sees a slot left from an older position (it lies past the
window) nor an unwritten one (hidden). A step of n <= history + 1 tokens is written in place before
it attends (it overwrites only keys none of its queries sees); a longer one attends over the slots
followed by its own keys, then writes its last `ring` keys. The `history` extra slots keep the keys
that rolling back that many positions (rejected speculative tokens) must restore.
"""

from __future__ import annotations

import copy
import sys
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..interfaces import KV
from .kv_cache import DecodeState

if TYPE_CHECKING:
    from ..stack import AttentionLayers


class WindowState(DecodeState):
    """k, v: (layers, b, hk, sinks + ring, d); pos, mask: (b, sinks + ring) positions of the slots and
    whether each may be attended (written, not padding, not a sink's ring copy); kept: (b, ring)
    whether each ring slot's position is text (padding aside), which token shifts read."""

    def __init__(self, layers: int, batch: int, sinks: int, span: int, history: int, k_heads: int, dim_k: int,
                 v_heads: int, dim_v: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if history < 0 or span < 1 or sinks < 0:
            raise ValueError(f"a window state needs span >= 1, sinks >= 0, history >= 0; got {span}, {sinks}, "
                             f"{history}")
        super().__init__(layers, batch, sinks + span + history, k_heads, dim_k, v_heads, dim_v, dtype, device)
        self.sinks, self.span, self.history, self.ring = sinks, span, history, span + history
        self.mask.fill_(False)                  # nothing written yet
        self.padded = True
        self.kept = torch.zeros(batch, self.ring, dtype=torch.bool, device=self.mask.device)
        self._new: tuple[Tensor, Tensor] = (self.pos[:, :0], self.mask[:, :0])
        self._in_place = True
        self._sink: tuple[Tensor, Tensor, Tensor] | None = None     # this step's sink keys: rows, columns, slots
        self.sinks_done = sinks == 0           # every row is past its sinks: no step has any

    @property
    def max_len(self) -> int:
        """A ring never fills: any number of positions fits."""
        return sys.maxsize

    @property
    def slots(self) -> int:
        return self.k.shape[3]

    def _ring_slots(self, start: int, n: int) -> slice | Tensor:
        """Ring indices (0 .. ring - 1) of positions start .. start + n - 1 (n <= ring)."""
        first = start % self.ring
        if first + n <= self.ring:
            return slice(first, first + n)
        return (first + torch.arange(n, device=self.pos.device)) % self.ring

    def _storage(self, ring: slice | Tensor) -> slice | Tensor:
        return slice(ring.start + self.sinks, ring.stop + self.sinks) if isinstance(ring, slice) else ring + self.sinks

    def begin(self, pos: Tensor, mask: Tensor | None, prefix: int = 0) -> None:
        n = pos.shape[-1]
        if prefix:
            if self.length:
                raise ValueError("memory tokens can only start a decode state")
            self.prefix = prefix
        pos = pos.expand(self.batch, -1)
        mask = torch.ones_like(pos, dtype=torch.bool) if mask is None else mask.expand(self.batch, -1)
        self._new, self.pending, self._in_place = (pos, mask), n, n <= self.history + 1
        self._sink = None
        if not self.sinks_done:
            rows, cols = ((pos < self.sinks) & mask).nonzero(as_tuple=True)
            if len(rows):
                self._sink = (rows, cols, pos[rows, cols])
        if self._in_place:
            self._write_positions()

    def _tail(self) -> tuple[int, slice | Tensor]:
        """How many of this step's positions the ring keeps (its last m) and their storage slots."""
        m = min(self.pending, self.ring)
        return m, self._storage(self._ring_slots(self.length + self.pending - m, m))

    def _write_positions(self) -> None:
        pos, mask = self._new
        m, at = self._tail()
        self.pos[:, at], self.mask[:, at] = pos[:, -m:], mask[:, -m:]
        if self._sink is not None:
            rows, cols, slot = self._sink
            self.pos[rows, slot], self.mask[rows, slot] = slot, True
            copied = cols >= self.pending - m                      # its ring copy, when written, is hidden
            self.mask[rows[copied], self.sinks + (self.length + cols[copied]) % self.ring] = False

    def attend(self, layer: int, kv: KV) -> KV:
        k, v = self.write(layer, kv.k, kv.v)
        if self._in_place:
            return KV(k=k, v=v, pos=self.pos, mask=self.mask)
        pos, mask = self._new
        return KV(k=k, v=v, pos=torch.cat((self.pos, pos), 1), mask=torch.cat((self.mask, mask), 1))

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's keys k (b, hk, n, d) and values v of `layer`; return every slot's keys and
        values (the slots, then this step's own when it is too long to write in place first)."""
        if layer not in self.rows:
            raise ValueError(f"self-attention block {layer} is not in this decode state: it was made for another model")
        keys, values = self.k[self.rows[layer]], self.v[self.rows[layer]]
        out = (keys, values) if self._in_place else (torch.cat((keys, k), 2), torch.cat((values, v), 2))
        m, at = self._tail()
        keys[:, :, at], values[:, :, at] = k[:, :, -m:], v[:, :, -m:]
        if self._sink is not None:
            (rows, cols, slot), row = self._sink, self.rows[layer]     # through the storage (autograd wants it)
            self.k[row, rows, :, slot], self.v[row, rows, :, slot] = k[rows, :, cols], v[rows, :, cols]
        return out

    def shift_window(self, block: int, h: Tensor, reach: int) -> tuple[Tensor, Tensor]:
        """Token shift's inputs h (b, n, dim) preceded by up to `reach` earlier ones (kept in a ring of their
        own), with the mask of that window (padding and memory tokens are not text)."""
        if reach > self.ring:
            raise ValueError(f"token shift reaches {reach} positions back; this window state keeps {self.ring}")
        if block not in self.shift:
            self.shift[block] = h.new_zeros(self.batch, self.ring, h.shape[-1])
        start = self.length
        first = max(0, start - reach)
        earlier = self._ring_slots(first, start - first)
        window = torch.cat((self.shift[block][:, earlier], h), 1)
        text = torch.cat((self.kept[:, earlier], self._new[1]), 1)
        if self.prefix > first:
            text[:, : self.prefix - first] = False
        m = min(h.shape[1], self.ring)
        self.shift[block][:, self._ring_slots(start + h.shape[1] - m, m)] = h[:, -m:]
        return window, text

    def commit(self) -> None:
        if not self._in_place:
            self._write_positions()
        m, at = self._tail()
        self.kept[:, self._ring_slots(self.length + self.pending - m, m)] = self._new[1][:, -m:]
        if not self.sinks_done:
            pos, mask = self._new
            self.sinks_done = bool(((pos[:, -1] >= self.sinks - 1) & mask[:, -1]).all())
        self.length += self.pending
        self.pending, self._sink, self._in_place = 0, None, True

    def last_positions(self) -> Tensor:
        """(b, 1) the position of each row's latest slot."""
        at = self.sinks + (self.length - 1) % self.ring
        return self.pos[:, at: at + 1]

    def rollback(self, n: int) -> None:
        """Forget the last n positions: up to `history` of them (any, while no slot was overwritten)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} positions of {self.length}")
        if n > self.history and self.length > self.ring:
            raise ValueError(f"a window decode state keeps {self.history} positions beyond its window and can roll "
                             f"back that many, not {n} (make the state with new_state(..., history=k))")
        if n == 0:
            return
        gone = self._ring_slots(self.length - min(n, self.ring), min(n, self.ring))
        self.mask[:, self._storage(gone)], self.kept[:, gone] = False, False
        self.length -= n
        if self.sinks:                  # a sink slot stays while its position is still fed
            if self.length:
                last = (self.length - 1) % self.ring
                seen = torch.arange(self.sinks, device=self.pos.device) <= self.pos[:, self.sinks + last, None]
                self.mask[:, : self.sinks] &= seen & self.kept[:, last, None]
            else:
                self.mask[:, : self.sinks] = False
            self.sinks_done = False

    def slide(self, n: int, keep: int = 0) -> None:
        raise ValueError("a window decode state is a ring: it keeps the window by itself and never slides")

    def clone(self) -> "WindowState":
        new = copy.copy(self)
        new.k, new.v, new.pos, new.mask, new.kept = (t.clone() for t in (self.k, self.v, self.pos, self.mask,
                                                                          self.kept))
        new.cross, new.shift = dict(self.cross), {i: h.clone() for i, h in self.shift.items()}
        return new

    def reorder(self, indices: Tensor) -> None:
        super().reorder(indices)
        self.kept = self.kept.index_select(0, indices)

    def nbytes(self) -> int:
        return super().nbytes() + self.kept.numel()


def window_state(stack: "AttentionLayers", batch: int, heads: tuple[int, int, int, int], dtype: torch.dtype,
                 device: torch.device | str, history: int) -> WindowState:
    """The decode state of a windowed stack (`stack.window` = (sinks, span)), whatever room is asked."""
    sinks, span = stack.window
    return WindowState(stack.num_self_attn, batch, sinks, span, history, *heads, dtype=dtype, device=device)
