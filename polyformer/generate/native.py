"""The default decode plan's block loop in C++ (`rows_native.cpp`): one call per step in place of one per block.

`rows.Rows` runs each block as a few ATen calls on preallocated buffers; from Python every call pays the
interpreter and the argument binding, about as much again as the call's own work for these small operations
(at dim 512 / depth 6 about 0.4 ms a token of the step's 0.6 ms outside the products and attention). The
extension holds the same tensors (buffers, views, weights, input-major copies) and runs the same operations in
the same order, so its rows equal the Python loop's bit for bit (tests/generate/test_native_rows.py). It takes
the plans made only of blocks it knows: a layer or RMS norm (or none), linear products, self-attention
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

import hashlib
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..norm import LayerNorm, RMSNorm

SWITCH = "POLYFORMER_NATIVE_DECODE"
SOURCE = Path(__file__).with_name("rows_native.cpp")
_lock = threading.Lock()
_built: dict[str, Any] = {}


def extension() -> Any | None:
    """The compiled module, built on first call; None where it is switched off or cannot be built."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    if "module" in _built or "error" in _built:
        return _built.get("module")
    with _lock:
        if "module" not in _built and "error" not in _built:
            try:
                _built["module"] = _build()
            except Exception as error:      # no compiler, unwritable cache ...
                _built["error"] = error
                warnings.warn(f"polyformer's native decode loop could not be built ({error!s:.300}); the "
                              "Python loop runs instead", RuntimeWarning, stacklevel=3)
    return _built.get("module")


def _build() -> Any:
    from torch.utils.cpp_extension import get_default_build_root, load

    if shutil.which("ninja") is None:       # the `ninja` package's binary, when its bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    flags = ["-O2"]
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + torch.__version__.encode())
    name = f"polyformer_native_rows_{digest.hexdigest()[:16]}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    root.mkdir(parents=True, exist_ok=True)
    src = root / SOURCE.name
    if not src.exists() or src.read_bytes() != SOURCE.read_bytes():
        partial = src.with_name(f".{src.name}.{os.getpid()}")
        partial.write_bytes(SOURCE.read_bytes())
        os.replace(partial, src)
    if not (root / f"{name}.so").exists():
        print(f"polyformer: building the native decode loop (once per machine and source version, about a "
              f"minute) in {root}", file=sys.stderr, flush=True)
    return load(name=name, sources=[str(src)], extra_cflags=flags, build_directory=str(root), verbose=False)


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


def _product(module: nn.Module, layout: Any) -> tuple | None:
    """(weight, its current input-major rows or None, bias) as `rows.product` / `rows.accumulate` read them."""
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
        if hasattr(blk, "cuts"):        # self-attention (rows._Attention)
            if blk.position is not None or blk.match:
                return None
            parts = (_product(blk.block.modules["qkv"], plan.layout), _product(blk.block.modules["out"], plan.layout))
            views = (blk.buf, blk.q, blk.k3, blk.v3, blk.scale, blk.gqa)
        else:
            if blk.gelu is None or blk.glu:
                return None
            parts = (_product(blk.block.modules["proj_in"], plan.layout),
                     _product(blk.block.modules["proj_out"], plan.layout))
            views = (blk.hidden, blk.gelu)
        if None in parts:
            return None
        described.append((hasattr(blk, "cuts"), norm, parts, views))
    module = extension()
    if module is None:
        return None
    loop = module.NativeRows(res)
    for attention, norm, (first, second), views in described:
        (loop.add_attention if attention else loop.add_feedforward)(*norm, *first, *second, *views)
    return loop
