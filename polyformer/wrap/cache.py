"""`cache=` as x-transformers' wrappers take it: `out, record = model(x, return_intermediates=True)`, then
`model(x_longer, cache=record, return_intermediates=True)` with x_longer continuing x runs only the new
positions and gives their outputs. Behind it is our decode state: the first time a record is used as a
cache, its inputs are run into a new state (once); each later record continues the same state in place,
so a record is good until another record of the same run has been continued (using an older one runs its
inputs again)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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


def caller(forward: Callable[..., Any], x: Tensor, pos: Tensor | None, per_position: dict[str, Any],
           whole: dict[str, Any], front: dict[str, Any]) -> Callable[..., Any]:
    """The `call` that `cached` takes, for a wrapper's `forward`: x, pos and the `per_position` arguments
    (tensors, or dicts of tensors, one value per input position) cut to [lo, hi); `whole` passed as given;
    `front` (the front embeddings' arguments) only with_front, else None."""
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


def cached(wrapper: Any, x: Tensor, cache: object, front: int, call: Callable[..., Any]) -> tuple[Tensor, WrapperRecord]:
    """Run the inputs of x (b, total, ...) after the cache's: (their outputs, the new record).

    `call(lo, hi, state, with_front, shift)` runs the wrapper's forward on inputs [lo, hi) (hi None: to the
    end) on a decode state, with the front embeddings or not, its given positions moved up by shift;
    `front` is the number of front embeddings (class tokens, prepend_embeds) the forward puts before the text."""
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
    record.cache_length, record.decode = total, run
    run.at = record
    return out, record
