"""How a keyword reaches the config: a `Route` writes its (converted) argument to a dotted path of
`LayersConfig`, `flag` writes fixed fields when the keyword is True; the converters of keyword values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Route:
    """Write `value(arg)` to `path`; a `when_true` route writes fixed fields only if arg is truthy."""

    path: str | None = None
    convert: Callable[[Any], Any] | None = None
    when_true: dict[str, Any] | None = None

    def writes(self, arg: Any) -> dict[str, Any]:
        if self.when_true is not None:
            if not isinstance(arg, bool):
                raise TypeError(f"expected True or False, got {arg!r}")
            return dict(self.when_true) if arg else {}
        value = self.convert(arg) if self.convert is not None else arg
        return {self.path: value}


def flag(**fields: Any) -> Route:
    return Route(when_true={k.replace("__", "."): v for k, v in fields.items()})


def _pre_norm(arg: Any) -> str:
    if not isinstance(arg, bool):
        raise TypeError(f"expected True or False, got {arg!r}")
    return "pre" if arg else "post"


def _shift(arg: Any) -> int | tuple[int, ...]:
    if isinstance(arg, (list, tuple)):
        return tuple(int(a) for a in arg)
    return int(arg)


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _llama3(arg: Any) -> tuple[float, float, float, float] | None:
    """{factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} (Hugging Face's
    names for Llama 3's rope scaling) -> a tuple in that order; None: off."""
    if arg is None:
        return None
    if not isinstance(arg, dict) or set(arg) != set(LLAMA3_KEYS):
        raise TypeError(f"expected a dict with exactly the keys {list(LLAMA3_KEYS)}, got {arg!r}")
    return tuple(float(arg[k]) for k in LLAMA3_KEYS)


def _ints(arg: Any) -> int | tuple[int, ...]:
    """An integer, or a sequence of them (one per head)."""
    if isinstance(arg, (list, tuple)):
        return tuple(arg)
    return arg


def _pairs(arg: Any) -> Any:
    """((w1, r1), (w2, r2), ...) from any nesting of lists / tuples."""
    if isinstance(arg, (list, tuple)):
        return tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in arg)
    return arg


def _block_local(arg: Any) -> dict[str, Any]:
    if not isinstance(arg, (list, tuple)) or len(arg) != 2:
        raise TypeError(f"expected (query_block, memory), got {arg!r}")
    return {"query_block": arg[0], "memory": arg[1]}


def _local_2d(arg: Any) -> dict[str, Any]:
    keys = {"image", "query", "memory"}
    if not isinstance(arg, dict) or not {"image", "query"} <= set(arg) <= keys:
        raise TypeError(f"expected dict(image=(H, W), query=(qh, qw), memory=(mh, mw)), got {arg!r}")
    return {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in arg.items()}


def _bigbird_blocks(arg: Any) -> dict[str, Any]:
    if not isinstance(arg, dict) or "block_size" not in arg or not set(arg) <= {"block_size", "random_blocks"}:
        raise TypeError(f"expected dict(block_size=b, random_blocks=r), got {arg!r}")
    return dict(arg)


def sequence(expected: str) -> Callable[[Any], tuple[Any, ...] | None]:
    """A converter: any list / tuple -> a tuple, None -> None (off); anything else fails saying `expected`."""

    def convert(arg: Any) -> tuple[Any, ...] | None:
        if arg is None:
            return None
        if not isinstance(arg, (list, tuple)):
            raise TypeError(f"expected {expected}, got {arg!r}")
        return tuple(arg)

    return convert


def _layout(arg: Any) -> tuple[str, ...] | None:
    return None if arg is None else tuple(arg)
