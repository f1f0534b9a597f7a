"""`cache=` as x-transformers' wrappers take it: `out, record = model(x, return_intermediates=True)`, then
`model(x_longer, cache=record, return_intermediates=True)` with x_longer continuing x runs only the new
positions and gives their outputs. Behind it is our decode state: the first time a record is used as a
cache, its inputs are run into a new state (once); each later record continues the same state in place,
so a record is good until another record of the same run has been continued (using an older one runs its
inputs again).

input_not_include_cache=True (the wrapper's default, or the forward's): x holds only the new inputs, and the
per-position arguments (mask, pos, ...) cover only them; the record keeps the inputs it has seen (`inputs`),
which go before them, so this is the same run as giving the whole input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..memory.kv_cache import DecodeState
from .outputs import WrapperRecord


@dataclass
class CacheRun:
    """A decode state and the record it is at; `shift`: positions taken by front embeddings."""

    state: DecodeState
    at: Any = None
    shift: int = 0


def part(t: Tensor | None, name: str, total: int, lo: int, hi: int | None) -> Tensor | None:
    """t (b|1, total, ...), one value per input position, at positions [lo, hi)."""
    if t is None:
        return None
    if t.ndim < 2 or t.shape[1] != total:
        raise ValueError(f"with cache=, {name} covers the whole input ({total} positions), got {tuple(t.shape)}")
    return t[:, lo:hi]


def _caller(forward: Callable[..., Any], x: Tensor, pos: Tensor | None, per_position: dict[str, Any],
            whole: dict[str, Any], front: dict[str, Any]) -> Callable[..., Any]:
    """`call(lo, hi, state, with_front, shift)` runs the wrapper's forward on inputs [lo, hi) (hi None: to the
    end) on a decode state: x, pos (moved up by shift) and the `per_position` arguments (tensors, or dicts of
    tensors, one value per input position) cut to [lo, hi); `whole` passed as given; `front` (the front
    embeddings' arguments) only with_front, else None."""
    n = x.shape[1]

    def cut(value: Any, name: str, lo: int, hi: int | None) -> Any:
        if isinstance(value, dict):
            return {k: part(v, k, n, lo, hi) for k, v in value.items()} or None
        return part(value, name, n, lo, hi)

    def call(lo: int, hi: int | None, state: DecodeState, with_front: bool, shift: int) -> Any:
        at = part(pos, "pos", n, lo, hi)
        return forward(x[:, lo:hi], state=state, return_intermediates=True,
                       pos=at + shift if at is not None else None,
                       **{k: cut(v, k, lo, hi) for k, v in per_position.items()}, **whole,
                       **{k: v if with_front else None for k, v in front.items()})

    return call


def cached(wrapper: Any, x: Tensor, pos: Tensor | None, per_position: dict[str, Any], whole: dict[str, Any],
           front: dict[str, Any], cache: object, state: DecodeState | None, classes: int = 0
           ) -> tuple[Tensor, WrapperRecord]:
    """A wrapper's forward with cache=: run the inputs of x (b, total, ...) after the cache's; (their outputs,
    the new record). Arguments as `_caller` takes them (`front`: prepend_embeds, prepend_mask), `classes` the
    class tokens the forward puts before the text."""
    if state is not None:
        raise ValueError("pass cache or state, not both")
    call = _caller(wrapper.forward, x, pos, per_position, whole, front)
    prepended = front["prepend_embeds"]
    front = classes + (prepended.shape[1] if prepended is not None else 0)
    if not isinstance(cache, WrapperRecord) or cache.cache_length is None:
        raise TypeError("cache must be the record a forward returned with return_intermediates=True, got "
                        f"{type(cache).__name__}")
    b, total, done = x.shape[0], x.shape[1], cache.cache_length
    if total <= done:
        raise ValueError(f"with cache=, x continues the cached input: it must be longer than the {done} cached "
                         f"positions, got {total}")
    run = cache.decode
    if not isinstance(run, CacheRun) or run.at is not cache or run.state.batch != b \
            or run.state.length + total - done > run.state.max_len:
        room = 2 * (total + front) + 16           # doubled when outgrown: the inputs are run again, rarely
        run = CacheRun(wrapper.new_state(b, room, device=x.device), shift=front)
        call(0, done, run.state, True, 0)
    out, record = call(done, None, run.state, False, run.shift)
    record = WrapperRecord.of(record)
    record.cache_length, record.decode, record.inputs = total, run, (x, pos, per_position)
    run.at = record
    return out, record


# what a per-position argument is where it was not given
FILL = {"mask": True, "global_mask": False, "sum_embeds": 0.0, "embed_ids": 0}


def check_flag(owner: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: input_not_include_cache must be True or False, got {value!r}")
    return value


def excludes(cache: object, given: bool | None, default: bool) -> bool:
    """Whether x leaves out the cached inputs: the forward's input_not_include_cache, else the wrapper's."""
    if given is not None and not isinstance(given, bool):
        raise TypeError(f"input_not_include_cache must be True, False or None, got {given!r}")
    if given and cache is None:
        raise ValueError("input_not_include_cache=True says x continues a cache; pass cache=")
    return cache is not None and (default if given is None else given)


def _joined(old: Any, new: Any, name: str, b: int, done: int, n: int, device: torch.device) -> Any:
    if isinstance(old, dict) or isinstance(new, dict):
        old, new = old or {}, new or {}
        return {k: _joined(old.get(k), new.get(k), k, b, done, n, device) for k in {**old, **new}} or None
    if old is None and new is None:
        return None
    like = new if new is not None else old
    fill = lambda m: torch.full((b, m, *like.shape[2:]), FILL[name], dtype=like.dtype, device=device)  # noqa: E731
    return torch.cat((old if old is not None else fill(done), new if new is not None else fill(n)), dim=1)


def joined(cache: object, x: Tensor, pos: Tensor | None, given: dict[str, Any]
           ) -> tuple[Tensor, Tensor | None, dict[str, Any]]:
    """The record's inputs, then x (b, n, ...) and its per-position arguments: (x, pos, arguments) over both.
    A position not given is the default: kept (mask), none added (sum_embeds), id 0 (embed_ids), and for pos
    the positions after the record's last one."""
    if not isinstance(cache, WrapperRecord) or cache.inputs is None:
        raise TypeError("with input_not_include_cache, cache must be a record a forward returned with "
                        f"return_intermediates=True (without state=), got {type(cache).__name__}")
    old_x, old_pos, old = cache.inputs
    if tuple(x.shape[:1]) + tuple(x.shape[2:]) != tuple(old_x.shape[:1]) + tuple(old_x.shape[2:]):
        raise ValueError(f"with input_not_include_cache, x must continue the cached inputs {tuple(old_x.shape)}, "
                         f"got {tuple(x.shape)}")
    b, done, n, device = x.shape[0], old_x.shape[1], x.shape[1], x.device
    if old_pos is not None or pos is not None:
        steps = torch.arange(n, device=device)[None]
        old_pos = old_pos if old_pos is not None else torch.arange(done, device=device)[None]
        if pos is not None and (pos.ndim != 2 or pos.shape[0] not in (1, b) or pos.shape[1] != n):
            raise ValueError(f"with input_not_include_cache, pos covers the new inputs: (batch or 1, {n}), got "
                             f"{tuple(pos.shape)}")
        pos = pos if pos is not None else old_pos[:, -1:] + 1 + steps
        rows = max(old_pos.shape[0], pos.shape[0])
        pos = torch.cat((old_pos.expand(rows, -1), pos.expand(rows, -1)), dim=1)
    merged = {k: _joined(old.get(k), v, k, b, done, n, device) for k, v in given.items()}
    return torch.cat((old_x, x), dim=1), pos, merged
