"""Which kinds of automatic differentiation or torch.func transform a call runs under.

Our CPU attention operator has a backward formula only, and so does ATen's CPU flash kernel, which
has no forward-mode formula either: the dense kernel routes around them (`attention/kernels`). The
input checks cannot read tensor values under vmap (`checks.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad


def running(kind: str) -> bool:
    """Whether a torch.func transform of this kind ("Vmap", "Grad", "Jvp", ...) is running, at any
    level of nesting."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return False
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    wanted = getattr(torch._C._functorch.TransformType, kind)
    return any(level.key() == wanted for level in retrieve_all_functorch_interpreters())


def has_tangent(tensors: tuple[Tensor, ...]) -> bool:
    """Whether `torch.autograd.forward_ad` carries a tangent on one of `tensors`."""
    return forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None
                                                  for t in tensors)


def transformed(*tensors: Tensor) -> bool:
    """Whether any torch.func transform is running, or forward-mode AD tracks one of `tensors`."""
    return torch._C._functorch.peek_interpreter_stack() is not None or has_tangent(tensors)


def forward_mode(*tensors: Tensor) -> bool:
    """Whether forward-mode AD (`torch.func.jvp`, `torch.autograd.forward_ad`) tracks this computation.
    Not while torch.compile traces (it does not trace forward-mode AD through these kernels)."""
    if torch.compiler.is_compiling():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return running("Jvp")
    return has_tangent(tensors)
