"""Exact softmax attention in float32 on the CPU, training and inference, from our own compiled kernel.

ATen's CPU flash kernel, which `scaled_dot_product_attention` runs, reaches a third to a half of the
machine's matmul rate over forward and backward. `cpu_attention.cpp` computes the same thing in blocks
of 64 query rows whose scores against a chunk of 1024 keys are one BLAS product held in cache (a
running maximum and sum join the chunks), skipping the causal upper triangle; with a sliding window
(`window`: causal, row r sees r - w < j <= r; bidirectional, |r - j| <= w // 2) it skips the keys
outside each block's band too, so that its work grows with length times window (the backward is in
`cpu_backward.cpp`). In training up to KEEP_KEYS keys a row the forward keeps each block's weights for
the backward (`keeps`); longer or larger calls recompute them in the backward from the forward's
log-sum-exp (FlashAttention, arXiv:2205.14135). Its large outputs, gradients and kept
weights come from a pool that hands the same memory out again every step (`polyformer/buffers.py`;
the pool is in `cpu_module.cpp`). When q, k and v are the columns of one fused projection
(`packed_columns`), the backward writes that projection's gradient whole, in place of three
gradients autograd would concatenate; the log-sum-exp and kept weights take no gradient, so autograd
makes no zeros for them (it did: 38 MB of weights per layer zero-filled in every step at seq 512).
With 8 heads of 64 it runs a causal forward + backward 2.2x (seq 512, batch 8) and 1.4x (seq 1024,
batch 4) faster than ATen's (`benchmarks/attention.py`).

This module builds the kernel, decides when it runs and is its public entry (`attention`); the
registered operators, with their fake implementations and autograd formulas, are in `cpu_ops.py`,
re-exported here. The dense kernel's fused path takes it for float32 CPU attention with no mask,
bias or dropout, outside export, tracing, autocast, torch.func transforms and forward-mode AD: always
in training (forward + backward is faster at every length measured, 1.08x at 8k keys), and without
autograd from FEW_QUERIES + 1 queries up to LONGEST_INFERENCE keys (a decode step's one query and
longer contexts are faster or as fast in ATen's forward). Everything
else keeps `scaled_dot_product_attention`. It is built once per machine on first use with
`torch.utils.cpp_extension` (a C++ compiler and ninja; about 30 s, announced by one line on stderr) into
PyTorch's extension cache, under a name made from its sources' bytes, the flags and torch's version
(`cache_name`), from copies of the sources kept there: a checkout with other sources never loads or
overwrites this build, and checkouts of the same sources share it without rebuilding. It
is a registered operator (`polyformer::attention`), so `torch.compile` keeps it in its graphs;
compiling first builds it too. Where it cannot be built, one warning says why and
`scaled_dot_product_attention` runs instead.
`POLYFORMER_CPU_ATTENTION=0` in the environment turns it off.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
from torch import Tensor

from ...autodiff import deeper, transformed
from ...native_build import Lazy, cache_name, load_extension

SWITCH = "POLYFORMER_CPU_ATTENTION"
SOURCES = [Path(__file__).with_name(name) for name in ("cpu_attention.cpp", "cpu_backward.cpp", "cpu_module.cpp")]
ISA_FLAGS = {                               # torch's own reading of the CPU: build for what it found
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}

LONGEST_INFERENCE = 4096   # keys; past it ATen's forward is as fast or faster (16k: 1.8 s against 1.9)
FEW_QUERIES = 4            # queries up to which inference keeps SDPA, at any length (see applies)
KEEP_KEYS = 512            # keys up to which training keeps the weights for the backward (see keeps)
KEEP_BYTES = 256 * 2**20   # and the most memory one call's kept weights may take
_off = [0]                                  # depth of `switched_off()` blocks
_recompute = [0]                            # depth of `recomputed_weights()` blocks


def switched_off() -> ContextManager[None]:
    """Within the block every call keeps `scaled_dot_product_attention` (the benchmarks' baseline)."""
    return deeper(_off)


def recomputed_weights() -> ContextManager[None]:
    """Within the block no call keeps its weights: the backward recomputes them (tests, benchmarks)."""
    return deeper(_recompute)


def kept_floats(i: int, j: int, causal: bool, window: int = 0) -> int:
    """Floats one (batch, head) keeps: each block of 64 query rows times the keys of its band, from
    its first row's first key to its last row's last (the kernel's `kept_per_task`), in closed form so
    that symbolic sizes (torch.compile with dynamic shapes) go through: the full blocks that end within
    the keys see up to their end, the other full blocks all j keys, the last partial block min(i, j);
    with a window w, block n starts at key max(0, 64 n - w + 1), which is 0 for n < ceil(w / 64).
    Bidirectional (i == j keys, window w: h = w // 2 keys each side), block n reads the keys from
    max(0, 64 n - h) to min(64 n + 64 + h, i)."""
    if not causal:
        return i * j if window <= 0 else _bidirectional_kept(i, window // 2)
    full, rest = i // 64, i % 64
    within = torch.sym_min(full, j // 64)
    floats = 2048 * within * (within + 1) + 64 * j * (full - within) + rest * torch.sym_min(i, j)
    if window <= 0:
        return floats
    first = (window + 63) // 64                 # the first block whose band does not start at key 0
    late = torch.sym_max(full - first, 0)       # full blocks from it on: starts 64 n - w + 1
    skipped = 64 * (32 * late * (first + full - 1) - (window - 1) * late)
    return floats - skipped - rest * torch.sym_max(64 * full - window + 1, 0)


def _bidirectional_kept(i: int, h: int) -> int:
    """kept_floats of the bidirectional band, h keys each side of every row, i queries and keys: the
    full blocks' ends min(64 n + 64 + h, i) are 64 n + 64 + h for the first (i - h) // 64 of them, i
    after; their starts max(0, 64 n - h) are 0 up to block ceil(h / 64); the last partial block of
    `rest` rows reads up to key i."""
    full, rest = i // 64, i % 64
    ends = torch.sym_min(torch.sym_max(i - h, 0) // 64, full)           # blocks whose band ends inside
    end_sum = 32 * ends * (ends - 1) + ends * (64 + h) + (full - ends) * i
    first = (h + 63) // 64                      # the first block whose band does not start at key 0
    late = torch.sym_max(full - first, 0)
    start_sum = 32 * late * (first + full - 1) - h * late
    return 64 * (end_sum - start_sum) + rest * (i - torch.sym_max(64 * full - h, 0))


def keeps(q: Tensor, k: Tensor, causal: bool, window: int = 0) -> bool:
    """Whether a call keeps its softmax weights for the backward instead of recomputing them from the
    log-sum-exp: when autograd records it, up to KEEP_KEYS keys and KEEP_BYTES of weights. The
    backward then skips one of its five products and every exp. Measured in whole training steps
    (paired rounds, dim 512, 8 heads): 0.06 s a step faster at seq 512 batch 8. At seq 1024 batch 4
    (71 MB of weights per layer) two paired runs gave +0.15 s and -0.02 s, not a clear gain; hence
    512. Memory is quadratic in the length; with a window it grows with length times window, and the
    limit on keys is on those a row sees (the window: w causal, 2 (w // 2) + 1 bidirectional).
    """
    recording = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    width = window if causal else 2 * (window // 2) + 1
    seen = min(width, k.shape[-2]) if window else k.shape[-2]       # keys a row sees, at most
    if not recording or _recompute[0] or seen > KEEP_KEYS:
        return False
    b, h, i, _ = q.shape
    return b * h * kept_floats(i, k.shape[-2], causal, window) * 4 <= KEEP_BYTES


def build() -> Any:
    isa = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *ISA_FLAGS.get(isa, [])]
    return load_extension(cache_name(f"polyformer_cpu_attention_{isa.lower()}", SOURCES, flags), SOURCES, flags,
                          f"the CPU attention kernel for {isa}", ldflags=["-fopenmp"])


def lazy(builder: Callable[[], Any] | None = None) -> Lazy:
    """The kernel, built by `builder` (default `build`) on first use."""
    return Lazy(builder or build, "CPU attention kernel", "scaled_dot_product_attention runs instead")


_built = lazy()


def extension() -> Any | None:
    """The compiled module, built on first call; None (after one warning) where it cannot be built."""
    return _built.get()


def applies(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None,
            dropout: float, window: int = 0) -> bool:
    """Whether this call runs on the compiled kernel (builds it on the first call that would). With a
    window (w > 0, causal or not) inference has no length limit: the kernel computes only the band, where
    the alternative (the block-sparse kernel's gathers) is 5x slower at 8k keys and w = 256. Inference
    with up to FEW_QUERIES queries (a decode step, a short speculative draft) keeps SDPA: 8 heads of 64,
    process time, 1 and 2 threads, batch 1 and 8, 8 or 2 kv heads, 1 / 2 / 4 queries, SDPA is faster
    at every length from 64 to 2048 keys (2.3x at 1 query and 64 keys, 1.9x at 150, 1.3x at 512, 1.06x
    at 2048; 1.1-1.9x at 4 queries) and even at 4096 (0.96-1.08x); from 8 queries on the two are within
    a few percent past 2048 keys."""
    if mask is not None or bias is not None or dropout > 0 or q.device.type != "cpu" or k.shape[-2] == 0:
        return False
    if not (q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0]
            and k.shape[-2] == v.shape[-2] and q.shape[-1] == k.shape[-1] and q.shape[1] % k.shape[1] == 0
            and k.shape[1] == v.shape[1]):
        return False                        # shapes SDPA broadcasts (a batch of 1 against b ...)
    recording = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not recording and not window and (k.shape[-2] > LONGEST_INFERENCE or q.shape[-2] <= FEW_QUERIES):
        return False
    if any(t.dtype != torch.float32 for t in (q, k, v)) or torch.is_autocast_enabled("cpu"):
        return False
    if torch.compiler.is_exporting() or torch.jit.is_tracing() or torch.jit.is_scripting():
        return False
    if _off[0] or os.environ.get(SWITCH, "1") == "0":
        return False
    if torch.compiler.is_compiling():       # dynamo cannot read torch.func's levels (see autodiff)
        return built_for_graphs()
    if transformed(q, k, v):                # the operator has a backward formula only: under torch.func
        return False                        # or forward-mode AD it would drop a tangent silently
    return extension() is not None


def built_for_graphs() -> bool:
    """`extension() is not None`, run by dynamo outside the graph it traces (its result is a constant
    there), so that a model compiled before any eager call builds and takes the kernel too."""
    return extension() is not None


# what torch.compiler.assume_constant_result sets, without importing dynamo with polyformer (1.7 s);
# test_cpu's compile-first test pins it
built_for_graphs._dynamo_marked_constant = True         # type: ignore[attr-defined]


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window: int = 0) -> Tensor:
    """softmax(q k^T scale, causal top-left aligned) v for q (b, h, i, d), k (b, hk, j, d), v (b, hk, j, dv),
    each of the hk kv heads serving h // hk query heads in a row (grouped-query attention). A window
    w > 0 lets row r see, causal, the keys r - w < j <= r alone: w keys, fewer in the first rows
    (every row must see a key: i - w < j; w >= i is plain causal attention); not causal, the keys
    |r - j| <= w // 2 (w >= 2; queries and keys one sequence, i == j; w and w + 1 are the same band
    for an even w; w // 2 >= i - 1 is full attention). The kernel computes each block's band of keys
    only, O(i w) work and memory.

    The output is laid out as (b, i, h, dv), so merging the heads afterwards is a view. A registered
    operator (`polyformer::attention`), so that `torch.compile` keeps it in its graphs.
    """
    if not torch.compiler.is_compiling() and transformed(q, k, v):
        raise RuntimeError("cpu.attention has a backward formula only: it cannot run under torch.func "
                           "transforms or forward-mode AD (DenseKernel keeps scaled_dot_product_attention "
                           "or its reference path there)")
    if window:
        window = checked_window(q.shape[-2], k.shape[-2], causal, window)
    keep = keeps(q, k, causal, window)
    columns = packed_columns(q, k, v)
    if columns is not None:
        return attention_packed_op(columns, q.shape[1], k.shape[1], v.shape[-1], scale, causal, keep, window)[0]
    return attention_op(q, k, v, scale, causal, keep, window)[0]


def checked_window(i: int, j: int, causal: bool, window: int) -> int:
    """The window as the kernel takes it (ValueError for one it does not): 0 where it covers every
    row's keys."""
    if window < 0:
        raise ValueError(f"cpu.attention: the window must be >= 0, got {window}")
    if causal:
        if i - window >= j:
            raise ValueError(f"cpu.attention: with a window every query row must see a key: {i} rows, "
                             f"window {window}, {j} keys")
        return 0 if window >= i else window     # every row's band starts at key 0: plain causal attention
    if window < 2:
        raise ValueError(f"cpu.attention: a bidirectional window sees w // 2 keys each side: it must be >= 2, "
                         f"got {window}")
    if i != j:
        raise ValueError(f"cpu.attention: a bidirectional window needs queries and keys of one sequence "
                         f"(as many): {i} queries, {j} keys")
    return 0 if window // 2 >= i - 1 else window     # every row sees every key: full attention


def packed_columns(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """The (b, t, C) tensor whose columns q, k and v are, heads side by side (a fused projection's
    output, split and viewed as heads), or None. From it the backward writes one gradient in place of
    three that autograd would then concatenate. Eager only (a traced graph keeps the plain operator)."""
    base = q._base
    if base is None or k._base is not base or v._base is not base or torch.compiler.is_compiling():
        return None
    (b, h, t, d), hk, dv = q.shape, k.shape[1], v.shape[-1]
    if base.shape != (b, t, h * d + hk * d + hk * dv) or not base.is_contiguous() or k.shape[2] != t:
        return None
    width = base.shape[-1]
    offsets = (0, h * d, h * d + hk * d)
    for part, offset in zip((q, k, v), offsets):
        strides = (t * width, part.shape[-1], width, 1)
        if part.storage_offset() != base.storage_offset() + offset or part.stride() != strides:
            return None
    return base


def module() -> Any:
    """The compiled module, or a RuntimeError that says why there is none."""
    built = extension()
    if built is None:
        raise RuntimeError(f"polyformer's CPU attention kernel is not available: {_built.error}")
    return built


# the registered operators (cpu_ops.py imports this module: the names it uses are defined above)
from .cpu_ops import (  # noqa: E402
    attention_backward_op, attention_op, attention_packed_backward_op, attention_packed_op, band_mask,
    explicit_gradients, fake_attention, heads_inner, reference_attention, unit_stride, unpack)

__all__ = [
    "SWITCH", "SOURCES", "ISA_FLAGS", "LONGEST_INFERENCE", "FEW_QUERIES", "KEEP_KEYS", "KEEP_BYTES",
    "switched_off", "recomputed_weights", "kept_floats", "keeps", "extension", "build", "applies", "built_for_graphs",
    "attention", "checked_window", "packed_columns", "module", "attention_op", "attention_backward_op",
    "attention_packed_op", "attention_packed_backward_op", "fake_attention", "explicit_gradients",
    "reference_attention", "band_mask", "heads_inner", "unit_stride", "unpack"]
