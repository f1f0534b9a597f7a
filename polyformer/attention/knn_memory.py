"""Memorizing Transformer (arXiv:2203.08913): at the chosen self-attention blocks each query also
retrieves its top-k (key, value) pairs from a non-differentiable memory of earlier forwards' keys,
attends over them with a softmax of its own, and a learned per-head gate mixes the two results:
sigmoid(b_h) * memory + (1 - sigmoid(b_h)) * local.

The memory (memory/knn_store.py) is per batch row. Every forward without a decode state writes its
own keys and values after reading (so a segment never retrieves itself), unless the model is built
with knn_memory_write=False or runs inside `read_only(model)` (generation does). `knn_clear` (b,) bool
on a forward clears the flagged rows first (a new document). Keys are normalised to length sqrt(d)
when written; queries and keys are taken before rotary positions, so the memory holds no position.
The memory is the module's extra state: state_dict / checkpoints carry it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import Tensor, nn

from .. import checks
from ..interfaces import KV, Context
from ..memory.knn_store import KnnStore, from_bytes, normalise_keys, to_bytes
from ..memory.vector_index import BACKENDS, KINDS, IndexSpec, have_faiss
from ..precision import HIDDEN, upcast

if TYPE_CHECKING:
    from ..config import LayersConfig


@dataclass(frozen=True)
class KnnMemoryOptions:
    """knn_memory_layers (self-attention block indices), knn_memory_size (entries per batch row and
    layer), knn_topk, knn_index ("flat" exact, "ivf", "hnsw"), knn_index_backend ("auto": torch for
    flat, faiss otherwise), knn_memory_write (False: forwards only read)."""

    layers: tuple[int, ...]
    size: int = 8192
    topk: int = 32
    index: str = "flat"
    backend: str = "auto"
    write: bool = True


def layers_keyword(arg: Any) -> KnnMemoryOptions | None:
    """knn_memory_layers: an index or a sequence of them -> the options; None: off."""
    if arg is None:
        return None
    if isinstance(arg, int) and not isinstance(arg, bool):
        arg = (arg,)
    if not isinstance(arg, (list, tuple)):
        raise TypeError(f"expected self-attention block indices (l, ...), got {arg!r}")
    return KnnMemoryOptions(layers=tuple(arg))


class KnnMemory(nn.Module):
    """forward(q (b, h, i, d), kv, ctx) -> what the memory recalls (b, h, i, dv), writing this
    forward's keys afterwards; mix(local, recalled) -> the gated output (b, h, i, dv)."""

    def __init__(self, heads: int, options: KnnMemoryOptions, scale: float):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(heads))        # b_h: sigmoid(0) = one half memory
        self.topk, self.scale, self.writes = options.topk, scale, options.write
        self.store = KnnStore(options.size, IndexSpec(kind=options.index, metric="ip", backend=options.backend))
        self.paused = 0

    def forward(self, q: Tensor, kv: KV, ctx: Context) -> Tensor:
        n = q.shape[2]
        recalled = self.recall(q, kv.v.shape[-1])
        if self.writes and not self.paused and ctx.state is None:
            keep = ctx.shift_mask if ctx.shift_mask is not None else ctx.mask   # text only: no padding, memory tokens
            self.store.write(normalise_keys(kv.k[:, :, -n:].detach()), kv.v[:, :, -n:].detach(), keep)
        return recalled

    def recall(self, q: Tensor, dim_v: int) -> Tensor:
        """softmax over each query's retrieved keys of scale * q.k, times their values; 0 where a
        query retrieves nothing (an empty row)."""
        b, h, i, _ = q.shape
        if self.store.empty:
            return q.new_zeros(b, h, i, dim_v)
        if self.store.rows != b:
            raise ValueError(f"the kNN memory (knn_memory_layers) holds {self.store.rows} batch rows, this forward "
                             f"has {b}: pass knn_clear=torch.ones({b}, dtype=torch.bool) to start new rows, or "
                             "clear_knn_memories(model)")
        scores, slots, valid = self.store.search_scored(q, self.topk)
        return Recall.apply(q, scores, slots, valid, self.store, self.scale)

    def mix(self, local: Tensor, recalled: Tensor) -> Tensor:
        g = torch.sigmoid(upcast(self.gate)).to(local.dtype)[:, None, None]
        return g * recalled + (1 - g) * local

    def get_extra_state(self) -> Tensor:
        return to_bytes(self.store.state())

    def set_extra_state(self, state: Tensor) -> None:
        self.store.load(from_bytes(state))


class Recall(torch.autograd.Function):
    """apply(q (b, h, i, d), scores, slots, valid (b, h, i, k), store, scale) -> (b, h, i, dv): the softmax
    of scale * scores (the search's q . key) over the valid slots, times their values. The gradient
    reaches q only (d scores / d q = the keys, gathered again in the backward): nothing of size k * d
    is held between the two."""

    @staticmethod
    def forward(ctx, q: Tensor, scores: Tensor, slots: Tensor, valid: Tensor, store: KnnStore,
                scale: float) -> Tensor:
        weights = (scores * scale).masked_fill(~valid, HIDDEN).softmax(dim=-1) * valid
        values = store.gathered(store.values, slots)
        ctx.save_for_backward(weights, slots)
        ctx.keys, ctx.values, ctx.scale = store.keys, store.values, scale   # a write replaces, never mutates
        return torch.einsum("bhik,bhikd->bhid", weights, values.to(weights.dtype)).to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        weights, slots = ctx.saved_tensors
        held = KnnStore.gathered
        values = held(ctx.values, slots)
        dw = torch.einsum("bhid,bhikd->bhik", grad.to(weights.dtype), values.to(weights.dtype))
        del values
        ds = weights * (dw - (weights * dw).sum(-1, keepdim=True)) * ctx.scale
        dq = torch.einsum("bhik,bhikd->bhid", ds, held(ctx.keys, slots).to(ds.dtype))
        return dq.to(grad.dtype), None, None, None, None, None


def attach(stack: nn.Module) -> None:
    """Give the self-attention blocks that knn_memory_layers names their memory (stack.py calls this)."""
    options = stack.cfg.knn_memory
    if options is None:
        return
    attention = [block.branch for block in stack.blocks if block.kind == "a"]
    for layer in options.layers:
        a = attention[layer]
        a.knn = KnnMemory(a.project.heads, options, a.project.qk_dim ** -0.5)


def memories(model: nn.Module) -> list[KnnMemory]:
    return [m for m in model.modules() if isinstance(m, KnnMemory)]


def begin(stack: nn.Module, knn_clear: Tensor | None, x: Tensor, decoding: bool) -> None:
    """A stack forward's `knn_clear` (b,) bool: the flagged rows of every kNN memory are cleared before
    it runs (a new document)."""
    if knn_clear is None:
        return
    found = memories(stack)
    if not found:
        raise ValueError("knn_clear was given, but the stack has no kNN memory (knn_memory_layers)")
    b = x.shape[0]
    if not isinstance(knn_clear, Tensor) or knn_clear.dtype != torch.bool or tuple(knn_clear.shape) != (b,):
        got = tuple(knn_clear.shape) if isinstance(knn_clear, Tensor) else type(knn_clear).__name__
        raise ValueError(f"knn_clear must be a bool tensor of shape ({b},) (True: the row starts a new document), "
                         f"got {got}")
    if decoding:
        raise ValueError("knn_clear cannot combine with a decode state: generation reads the kNN memory, never "
                         "writes it")
    for m in found:
        if m.store.rows not in (0, b):
            if not bool(knn_clear.all()):
                raise ValueError(f"the kNN memory holds {m.store.rows} batch rows, this forward has {b}: only "
                                 "knn_clear=True on every row can start a memory of another batch size")
            m.store.reset()
        m.store.clear(knn_clear)


def clear_knn_memories(model: nn.Module, rows: Tensor | None = None) -> None:
    """Forget what every kNN memory of `model` holds: all of it, or the rows where rows (b,) is True."""
    for m in memories(model):
        if rows is None:
            m.store.reset()
        else:
            m.store.clear(rows)


@contextlib.contextmanager
def read_only(model: nn.Module) -> Iterator[None]:
    """Forwards inside read the kNN memories and write nothing (generation; a probe of the memory)."""
    found = memories(model)
    for m in found:
        m.paused += 1
    try:
        yield
    finally:
        for m in found:
            m.paused -= 1


def problems(cfg: "LayersConfig") -> list[str]:
    """What knn_memory_layers and its options cannot be or combine with, naming the keywords."""
    o = cfg.knn_memory
    if o is None:
        return []
    n_self = cfg.layout.count("a")
    found = checks.whole(o.topk, "knn_topk")
    if not found and (isinstance(o.size, bool) or not isinstance(o.size, int) or o.size < o.topk):
        found.append(f"knn_memory_size must be an integer >= knn_topk ({o.topk}), got {o.size!r}")
    bad = [l for l in o.layers if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < n_self]
    if not o.layers or bad or len(set(o.layers)) != len(o.layers):
        found.append(f"knn_memory_layers must name distinct self-attention blocks in [0, {n_self}) (the stack has "
                     f"{n_self}), got {o.layers!r}")
    if o.index not in KINDS:
        found.append(f"knn_index must be one of {', '.join(KINDS)}, got {o.index!r}")
    if o.backend not in BACKENDS:
        found.append(f"knn_index_backend must be one of {', '.join(BACKENDS)}, got {o.backend!r}")
    elif o.index in KINDS and o.index != "flat" and o.backend == "torch":
        found.append(f"knn_index={o.index!r} is a faiss index; knn_index_backend='torch' searches exactly "
                     "(knn_index='flat')")
    elif o.index in KINDS and (o.backend == "faiss" or o.index != "flat") and not have_faiss():
        found.append(f"knn_index={o.index!r} needs faiss: pip install polyformer[memory] (faiss-cpu)")
    found += checks.flag(o.write, "knn_memory_write")
    found += _combinations(cfg, o, n_self)
    return found


def _combinations(cfg: "LayersConfig", o: KnnMemoryOptions, n_self: int) -> list[str]:
    from .kernels.direct import switch

    found = []
    if cfg.mixer is not None:
        found.append(f"knn_memory_layers adds to attention; {switch('mixer.', cfg.mixer.name)} replaces it")
    for flag, on in (("gradient_checkpointing", cfg.gradient_checkpointing), ("reversible", cfg.reversible),
                     ("universal", cfg.universal), ("hourglass", cfg.hourglass is not None)):
        if on:     # a recomputed or repeated block would read a memory its first run already wrote
            found.append(f"knn_memory_layers cannot combine with {flag}: its blocks run more than once per forward")
    for layer in (l for l in o.layers if isinstance(l, int) and 0 <= l < n_self):
        a = cfg.attention_of(layer)
        if a.kernel.name != "dense":
            found.append(f"knn_memory_layers mixes the memory into dense attention; block {layer} uses "
                         f"{switch('attention.kernel.', a.kernel.name)}")
        if a.collab_heads:
            found.append("knn_memory_layers keeps keys per key head; attn_collab_heads shares one mixed key")
    return found
