"""The default decode plan's block loop in C++ (`rows_native.cpp`): one call per step in place of one per block.

`rows.Rows` runs each block as a few ATen calls on preallocated buffers; from Python every call pays the
interpreter and the argument binding, about as much again as the call's own work for these small operations
(at dim 512 / depth 6 about 0.4 ms a token of the step's 0.6 ms outside the products and attention). The
extension holds the same tensors (buffers, views, weights, input-major copies) and runs the same operations in
the same order, so its rows equal the Python loop's bit for bit (tests/generate/test_native_rows.py). It takes
the plans made only of blocks it knows: a layer or RMS norm (or none), linear products (float, or int8 layers of
`quantize_int8` over float32 rows, on the extension's int8 kernel as `Int8Linear.forward` runs them), self-attention
without a position stage (absolute or no positions; a rotary stage keeps the Python loop) and with as many key
as value heads, and a feedforward with exact GELU. The input-major copies are checked every step (version
counter and storage address, as `plan.DecodeLayout.current`); a stale one makes `step` return False before
it writes anything, and `Rows` rebinds.

It is built once per machine and source version with `torch.utils.cpp_extension` (a C++ compiler and ninja;
about a minute, announced on stderr) into PyTorch's extension cache under a name made from the source's bytes
and torch's version. Where it cannot be built, one warning says why and the Python loop runs.
`POLYFORMER_NATIVE_DECODE=0` in the environment turns it off.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..native_build import Lazy, cache_name, load_extension
from ..norm import LayerNorm, RMSNorm
from ..quantize import Int8Linear

SWITCH = "POLYFORMER_NATIVE_DECODE"
SOURCE = Path(__file__).with_name("rows_native.cpp")


def _build() -> Any:
    flags = ["-O2"]
    return load_extension(cache_name("polyformer_native_rows", [SOURCE], flags), [SOURCE], flags,
                          "the native decode loop")


_built = Lazy(_build, "native decode loop", "the Python loop runs instead")


def extension() -> Any | None:
    """The compiled module, built on first call; None where it is switched off or cannot be built."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    return _built.get()


def _norm(module: nn.Module | None, dtype: torch.dtype) -> tuple | None:
    """(kind, weight, bias, shape, eps) as `rows.norm` runs it, or None when it runs the module's forward."""
    if module is None:
        return 0, None, None, [], 0.0
    w = getattr(module, "weight", None)
    if w is not None and w.dtype != dtype:
        return None
    if type(module) is LayerNorm and dtype in (torch.float32, torch.float64):
        return 1, module.weight, module.bias, list(module.normalized_shape), float(module.eps)
    if type(module) is RMSNorm and dtype == torch.float32 and w is not None:
        return 2, w, None, [w.shape[0]], float(module.eps)
    return None


def _product(module: nn.Module, layout: Any, dtype: torch.dtype) -> tuple | None:
    """(weight, its current input-major rows or None, bias) as `rows.product` / `rows.accumulate` read them;
    an int8 layer's (qweight, None, bias, scale) for float32 rows (its own kernel, `Int8Linear.forward`)."""
    if type(module) is Int8Linear and dtype == torch.float32:
        return module.qweight, None, module.bias, module.scale
    if type(module) is not nn.Linear:
        return None
    w = module.weight
    copy = layout.current(w).rows if layout is not None and layout.wants(module) else None
    return w, copy, module.bias


def bind(plan: Any, res: Tensor) -> Any | None:
    """A native loop over `plan` (a `rows.Rows` bound to buffers around the residual rows `res`), or None when
    one of its blocks is not of the kinds it runs, the rows are not on the CPU, or the extension is missing."""
    if res.device.type != "cpu":
        return None
    described = []
    for blk in plan.blocks:
        norm = _norm(blk.block.modules["norm"], res.dtype)
        if norm is None:
            return None
        if blk.block.attention:         # rows._Attention
            if blk.position is not None or blk.match:
                return None
            parts = (_product(blk.block.modules["qkv"], plan.layout, res.dtype),
                     _product(blk.block.modules["out"], plan.layout, res.dtype))
            views = (blk.buf, blk.q, blk.k3, blk.v3, blk.scale, blk.gqa)
        else:
            if blk.gelu is None or blk.glu:
                return None
            parts = (_product(blk.block.modules["proj_in"], plan.layout, res.dtype),
                     _product(blk.block.modules["proj_out"], plan.layout, res.dtype))
            views = (blk.hidden, blk.gelu)
        if None in parts:
            return None
        described.append((blk.block.attention, norm, parts, views))
    module = extension()
    if module is None:
        return None
    loop = module.NativeRows(res)
    for n, (attention, norm, (first, second), views) in enumerate(described):
        (loop.add_attention if attention else loop.add_feedforward)(*norm, *first[:3], *second[:3], *views)
        for which, part in enumerate((first, second)):
            if len(part) == 4:
                loop.set_int8(n, bool(which), part[3])
    return loop
