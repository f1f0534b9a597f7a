"""The records passed between stages, and the Protocols each stage keeps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from .memory.kv_cache import DecodeState


@dataclass
class KV:
    """Keys and values as they reach the kernel.

    The first `free` keys (persistent memory key / values) carry no position: every query may see
    them and no score bias applies to them. `pos` and `mask` describe the remaining keys.
    """

    k: Tensor                   # (b, hk, j, d)
    v: Tensor                   # (b, hk, j, dv)
    pos: Tensor | None          # (b|1, j - free) positions; None for keys without order (context)
    mask: Tensor | None         # (b, j - free) bool, True = keep
    free: int = 0


@dataclass
class Source:
    """What keys and values are computed from: the layer input (with XL memories) or a context."""

    x: Tensor                   # (b, j, dim)
    pos: Tensor | None          # (b|1, j)
    mask: Tensor | None         # (b, j) bool


@dataclass
class AttnOut:
    out: Tensor                 # (b, h, i, dv) before the output stage; (b, i, dim) after it
    scores: Tensor | None = None    # pre-normalisation scores (b, h, i, j), for residual attention
    weights: Tensor | None = None   # normalised weights (b, h, i, j), when asked for


@dataclass(frozen=True)
class Caps:
    """What a kernel or pattern can do, declared (registry entries carry one; tests and the
    compatibility matrix read it, nothing infers it)."""

    exact: bool                         # equals the dense reference on the same pattern
    bias: bool = True                   # can take an additive score bias
    fused: bool = False                 # a fused path (SDPA, our CPU kernel, the block-sparse kernel)
    causal: bool = True                 # can run in a causal stack
    bidirectional: bool = True          # can run in a bidirectional stack
    padding: bool = True                # takes a key padding mask
    decode: str = "keys"                # what a decode state keeps: "keys" (every key), "window"
                                        # (the last keys a window can still show, plus sinks)
    tolerance: float | None = None      # approximate ones: the error bound their tests hold


@dataclass
class Context:
    """Per-forward facts every block may read. Positions travel explicitly with the queries."""

    pos: Tensor                             # (b|1, n) positions of the current tokens
    mask: Tensor | None = None              # (b, n) bool, True = keep
    causal: bool = False
    context: Tensor | None = None           # (b, m, dim_context) for cross-attention
    context_mask: Tensor | None = None      # (b, m) bool
    mems: list[Tensor] | None = None        # per self-attention layer (b, m_l, dim), XL memories
    mem_masks: list[Tensor | None] | None = None
    need_weights: bool = False
    global_mask: Tensor | None = None       # (b, n) bool: tokens an attention pattern makes global
    prefix_span: tuple[Tensor, Tensor] | None = None   # prefix-LM: keys at positions in [start, end), (b, 1) each, seen by all
    shift_mask: Tensor | None = None        # (b, n) positions token shift reads: text, not padding / memory tokens
    state: "DecodeState | None" = None      # decoding: keys / values come from and go to the cache
    memo: dict = field(default_factory=dict)


class PositionStage(Protocol):
    def __call__(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]: ...


class ScoreBias(Protocol):
    def __call__(self, q_pos: Tensor, k_pos: Tensor) -> Tensor: ...   # (b|1, h, i, j)


class Normalizer(Protocol):
    def __call__(self, scores: Tensor, mask: Tensor | None) -> Tensor: ...


class Kernel(Protocol):
    caps: Caps

    def __call__(self, q: Tensor, kv: KV, *, mask: Tensor | None, bias: Tensor | None,
                 causal: bool, prev_scores: Tensor | None, need_weights: bool) -> AttnOut: ...
