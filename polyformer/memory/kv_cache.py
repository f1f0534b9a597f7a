"""The decode state: per-layer key / value storage preallocated for `max_len` positions and written
in place, with the positions and padding of every cached key, so a cached step sees exactly the
keys an uncached forward would."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .. import checks
from ..interfaces import KV
from .recurrent import Recurrent


class DecodeState:
    """Everything a decoder needs to continue a batch of sequences one step at a time.

    k, v: (key layers, b, hk, max_len, d) written at [length, length + n) by each step, one row per
        self-attention block whose kernel keeps keys (`kinds`, in order).
    recurrent: per self-attention block whose kernel keeps a recurrent summary, its `Recurrent` state
        (fixed size; `history` positions of it can be rolled back).
    pos, mask: (b, max_len) positions and padding of the cached keys, shared by all layers; the
        positions of each row only grow, so a new token comes after every cached key.
    cross: per cross-attention block, keys / values of the context, computed once.
    shift: per token-shifting block, its inputs (b, max_len, dim), so a step can see the previous ones;
        under negative keys (-1 - block) an expert layer's running counts per position (moe/layer.py),
        which roll back, reorder and clone with them.
    """

    def __init__(self, layers: int, batch: int, max_len: int, k_heads: int, dim_k: int, v_heads: int,
                 dim_v: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kinds: tuple[str, ...] | None = None, history: int = 1):
        if max_len < 1 or batch < 1:
            raise ValueError(f"batch and max_len must be >= 1, got {batch} and {max_len}")
        kinds = kinds if kinds is not None else ("keys",) * layers
        if len(kinds) != layers or set(kinds) - {"keys", "recurrent"}:
            raise ValueError(f"kinds must name 'keys' or 'recurrent' for each of the {layers} layers, got {kinds}")
        keyed = kinds.count("keys")
        self.k = torch.zeros(keyed, batch, k_heads, max_len, dim_k, dtype=dtype, device=device)
        self.v = torch.zeros(keyed, batch, v_heads, max_len, dim_v, dtype=dtype, device=device)
        self.kinds = tuple(kinds)
        self.rows = self._rows(self.kinds)
        self.recurrent_layers = {i: Recurrent(history) for i, kind in enumerate(kinds) if kind == "recurrent"}
        self.pos = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.mask = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0          # positions already committed
        self.prefix = 0          # leading positions that are memory tokens, not text
        self.padded = False      # whether any cached position is padding (else no key mask is needed)
        self.pending = 0         # positions written by the step under way
        self.cross: dict[int, KV] = {}
        self.shift: dict[int, Tensor] = {}

    @classmethod
    def over(cls, k: Tensor, v: Tensor, pos: Tensor, mask: Tensor, length: int, prefix: int = 0) -> "DecodeState":
        """A state over existing storage, written in place (not copied): the tensors of another
        state, e.g. the inputs of an exported decode step (`polyformer.export.DecodeStep`). Its
        cached positions may be padding, so the key mask is always applied."""
        return cls._wrap(k, v, pos, mask, length=length, prefix=prefix, padded=True)

    @classmethod
    def _wrap(cls, k: Tensor, v: Tensor, pos: Tensor, mask: Tensor, *, length: int, prefix: int, padded: bool,
              pending: int = 0, cross: dict | None = None, shift: dict | None = None,
              kinds: tuple[str, ...] | None = None, recurrent: dict[int, Recurrent] | None = None) -> "DecodeState":
        """A state over the given tensors, every field set (the one place besides __init__)."""
        new = cls.__new__(cls)
        new.k, new.v, new.pos, new.mask = k, v, pos, mask
        new.length, new.prefix, new.padded, new.pending = length, prefix, padded, pending
        new.cross, new.shift = cross or {}, shift or {}
        new.kinds = kinds if kinds is not None else ("keys",) * k.shape[0]
        new.rows = cls._rows(new.kinds)
        new.recurrent_layers = recurrent or {}
        return new

    @staticmethod
    def _rows(kinds: tuple[str, ...]) -> dict[int, int]:
        """Layer -> its row of the key / value storage, for the layers that keep keys."""
        keyed = [i for i, kind in enumerate(kinds) if kind == "keys"]
        return {layer: row for row, layer in enumerate(keyed)}

    @property
    def keeps_latents(self) -> bool:
        """Whether the key rows hold multi-latent attention's packed inputs (one head, no values) rather than
        keys (attention/latent.py; `AttentionLayers.new_state` chooses)."""
        return self.v.shape[-1] == 0

    @property
    def layers(self) -> int:
        return len(self.kinds)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def begin(self, pos: Tensor, mask: Tensor | None, prefix: int = 0) -> None:
        """Start a step of n = pos.shape[-1] new positions: record their positions and padding;
        `prefix` of them (first step only) are memory tokens."""
        n = pos.shape[-1]
        if self.length + n > self.max_len:
            raise ValueError(f"the decode state holds {self.max_len} positions; {self.length} are used "
                             f"and this step adds {n}")
        end = self.length + n
        self.pos[:, self.length:end] = pos.expand(self.batch, -1)
        self.mask[:, self.length:end] = True if mask is None else mask
        if mask is not None and (checks.values_hidden() or not bool(mask.all())):
            self.padded = True              # traced or batched: assume padding rather than read the mask
        if prefix:
            if self.length:
                raise ValueError("memory tokens can only start a decode state")
            self.prefix = prefix
        self.pending = n
        for memory in self.recurrent_layers.values():
            memory.begin(n)

    def recurrent(self, layer: int) -> Recurrent:
        """The recurrent summary of self-attention block `layer` (its kernel reads and writes it)."""
        if layer not in self.recurrent_layers:
            raise ValueError(f"self-attention block {layer} keeps keys in this decode state, not a recurrent "
                             "summary: the state was made for another model")
        return self.recurrent_layers[layer]

    def attend(self, layer: int, kv: KV) -> KV:
        """Write this step's keys / values of `layer`, return every cached key so far."""
        end = self.length + self.pending
        k, v = self.write(layer, kv.k, kv.v)
        return KV(k=k, v=v, pos=self.pos[:, :end], mask=self.mask[:, :end] if self.padded else None)

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's keys k (b, hk, n, d) and values v of `layer` in place; return all the
        layer's keys and values so far, (b, hk, length + n, d) views of the storage."""
        end = self.length + self.pending
        if layer not in self.rows:
            raise ValueError(f"self-attention block {layer} keeps a recurrent summary in this decode state, not "
                             "keys: the state was made for another model")
        keys, values = self.k[self.rows[layer]], self.v[self.rows[layer]]
        keys[:, :, self.length:end] = k
        values[:, :, self.length:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def shift_window(self, block: int, h: Tensor, reach: int) -> tuple[Tensor, Tensor]:
        """Record block's inputs h (b, n, dim) for this step; return them preceded by up to `reach`
        earlier inputs, with the mask of that window (padding and memory tokens are not text)."""
        if block not in self.shift:
            self.shift[block] = h.new_zeros(self.batch, self.max_len, h.shape[-1])
        start, end = self.length, self.length + self.pending
        self.shift[block][:, start:end] = h
        first = max(0, start - reach)
        text = self.mask[:, first:end]
        if self.prefix > first:
            text = text.clone()
            text[:, : self.prefix - first] = False
        return self.shift[block][:, first:end], text

    def commit(self) -> None:
        self.length += self.pending
        self.pending = 0
        for memory in self.recurrent_layers.values():
            memory.commit()

    def last_positions(self) -> Tensor:
        """(b, 1) the position of each row's latest cached key (the state must hold one)."""
        return self.pos[:, self.length - 1: self.length]

    def rollback(self, n: int) -> None:
        """Forget the last n positions (rejected speculative tokens)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} positions of {self.length}")
        for memory in self.recurrent_layers.values():     # every layer can, or none is touched
            memory.check_rollback(n)
        for memory in self.recurrent_layers.values():
            memory.rollback(n)
        self.length -= n

    def slide(self, n: int, keep: int = 0) -> None:
        """Drop the n oldest positions after the first `keep` (memory tokens stay as attention
        sinks), moving the rest down in place: a sliding window over the cache. A recurrent summary
        keeps what it summarised (it cannot forget a key)."""
        if not 0 <= n <= self.length - keep:
            raise ValueError(f"cannot slide {n} positions out of {self.length - keep}")
        if n == 0:
            return
        src, dst = slice(keep + n, self.length), slice(keep, self.length - n)
        self.k[:, :, :, dst] = self.k[:, :, :, src].clone()
        self.v[:, :, :, dst] = self.v[:, :, :, src].clone()
        self.pos[:, dst] = self.pos[:, src].clone()
        self.mask[:, dst] = self.mask[:, src].clone()
        for history in self.shift.values():
            history[:, dst] = history[:, src].clone()
        self.length -= n

    def clone(self) -> "DecodeState":
        """An independent copy (e.g. one cached prompt, many continuations)."""
        return self._wrap(self.k.clone(), self.v.clone(), self.pos.clone(), self.mask.clone(), length=self.length,
                          prefix=self.prefix, padded=self.padded, pending=self.pending,
                          cross=dict(self.cross),     # context keys are never written after they are made
                          shift={i: h.clone() for i, h in self.shift.items()}, kinds=self.kinds,
                          recurrent={i: m.clone() for i, m in self.recurrent_layers.items()})

    def reorder(self, indices: Tensor) -> None:
        """Keep batch rows `indices` (beam search), in that order."""
        self.k = self.k.index_select(1, indices)
        self.v = self.v.index_select(1, indices)
        self.pos = self.pos.index_select(0, indices)
        self.mask = self.mask.index_select(0, indices)
        self.cross = {i: KV(kv.k.index_select(0, indices), kv.v.index_select(0, indices), kv.pos,
                            None if kv.mask is None else kv.mask.index_select(0, indices), kv.free)
                      for i, kv in self.cross.items()}
        self.shift = {i: h.index_select(0, indices) for i, h in self.shift.items()}
        for memory in self.recurrent_layers.values():
            memory.reorder(indices)

    def nbytes(self) -> int:
        """Bytes the state holds (keys, values, positions, summaries; context keys excluded)."""
        tensors = [self.k, self.v, self.pos, self.mask, *self.shift.values()]
        return (sum(t.numel() * t.element_size() for t in tensors)
                + sum(m.nbytes() for m in self.recurrent_layers.values()))


class StateView:
    """A decode state as one group of blocks sees it, its layers renumbered: the group's self-attention
    layer l is the state's `layer(l)` and its token-shift block b the state's `block0 + b` (the applications
    of a Universal Transformer's unit, an hourglass level); positions, padding and context keys are the
    state's own."""

    def __init__(self, state: "DecodeState", layer: Callable[[int], int], block0: int = 0):
        self._state, self._layer, self._block0 = state, layer, block0

    def attend(self, layer: int, kv: KV) -> KV:
        return self._state.attend(self._layer(layer), kv)

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self._state.write(self._layer(layer), k, v)

    def recurrent(self, layer: int) -> Recurrent:
        return self._state.recurrent(self._layer(layer))

    def shift_window(self, block: int, h: Tensor, reach: int) -> tuple[Tensor, Tensor]:
        return self._state.shift_window(self._block0 + block, h, reach)

    def __getattr__(self, name: str) -> object:
        return getattr(self._state, name)
