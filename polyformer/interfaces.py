"""The records passed between stages, and the Protocols each stage keeps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from .losses import AuxLosses

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
    losses: AuxLosses | None = None # auxiliary losses a kernel reports (routing commitment, ...)


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
                                        # (the last keys a window can still show, plus sinks), "recurrent"
                                        # (a fixed-size summary of every key: kernel methods), "none"
                                        # (nothing it can decode with: a bidirectional mixer)
    tolerance: float | None = None      # approximate ones: the error bound their tests hold
    form: str = "scores"                # "scores": builds (b, h, i, j) scores, takes masks, bias and
                                        # residual scores (dense); "direct": computes the output from q, k, v
                                        # and positions without the score matrix (kernel methods, low rank)
    cross: bool = False                 # also serves cross-attention (else cross-attention stays dense)
    memories: bool = True               # reads Transformer-XL memories (keys before the segment)
    patterns: tuple[str, ...] = ()      # direct kernels: pattern pieces they apply themselves (routing's
                                        # local heads take "window"); any other piece is refused
    positional: bool = False            # reads positions itself (DA-Transformer's distance term): a stack with
                                        # it has no absolute positions by default, as with rotary or ALiBi


@dataclass(frozen=True)
class KernelSpec:
    """What an attention kernel is built from: the block's shapes and the kernel's own options."""

    heads: int
    kv_heads: int
    dim_qk: int                         # per head
    dim_v: int                          # per head
    causal: bool
    layer: int                          # index among the stack's self-attention blocks (seeds, decode state)
    scale: float                        # the score scale, dim_qk ** -0.5 unless a scheme changes it
    dropout: float = 0.0
    options: object = None              # the kernel's options dataclass (registry.KERNEL[name].options)
    normalize: object = None            # dense: the normaliser module (softmax, top-k, entmax15)
    talking_heads: bool = False         # dense: pre- and post-softmax head mixing
    fused: bool | None = None           # dense: the fused path (None: when possible)
    keep_scores: bool = False           # dense: return scores for residual attention
    pattern: tuple = ()                 # the stack's pattern choices, for a direct kernel that applies them


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
    prefix_span: tuple[Tensor, Tensor] | None = None   # prefix-LM: keys at [start, end), (b, 1) each, seen by all
    attn_mask: Tensor | None = None         # (b|1, h|1, n, n) bool: which keys each query may see (attn_mask.py)
    shift_mask: Tensor | None = None        # (b, n) positions token shift reads: text, not padding / memory tokens
    state: "DecodeState | None" = None      # decoding: keys / values come from and go to the cache
    carried: dict | None = None             # by self-attention block, a memory crossing forward calls that its
                                            # kernel continues and rewrites (memory/infini_carry.py)
    memo: dict = field(default_factory=dict)
    losses: AuxLosses = field(default_factory=lambda: AuxLosses())   # blocks report auxiliary losses here


class PositionStage(Protocol):
    def __call__(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]: ...


class ScoreBias(Protocol):
    def __call__(self, q_pos: Tensor, k_pos: Tensor) -> Tensor: ...   # (b|1, h, i, j)


class Normalizer(Protocol):
    def __call__(self, scores: Tensor, mask: Tensor | None) -> Tensor: ...


class Kernel(Protocol):
    """A kernel of form "scores" (dense): the mask and bias are built for it."""

    caps: Caps

    def __call__(self, q: Tensor, kv: KV, *, mask: Tensor | None, bias: Tensor | None,
                 causal: bool, prev_scores: Tensor | None, need_weights: bool) -> AttnOut: ...


class DirectKernel(Protocol):
    """A kernel of form "direct" (Performer, linear, Linformer, Nyström, AFT): it reads the keys'
    positions and padding from `kv` itself. Keys beyond the queries' count come first and every query
    may see them (memory key / values, XL memories, a decode state's keys). `memory` is the block's
    recurrent decode state (`memory/recurrent.py`) when the kernel declares decode="recurrent" and
    the stack is decoding: the kernel reads it and adds this step's keys to it."""

    caps: Caps

    def __call__(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                 need_weights: bool) -> AttnOut: ...
