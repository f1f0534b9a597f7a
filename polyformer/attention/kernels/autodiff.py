"""Which kinds of automatic differentiation a call runs under, for kernels whose operators have a
backward formula only (`cpu.py`'s, and SDPA's CPU flash kernel, which has no forward-mode formula)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad


def has_tangent(tensors: tuple[Tensor, ...]) -> bool:
    """Whether `torch.autograd.forward_ad` carries a tangent on one of `tensors`."""
    return forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None
                                                  for t in tensors)


def transformed(*tensors: Tensor) -> bool:
    """Whether a torch.func transform (grad, vmap, jvp ...) is running, or forward-mode AD tracks one of
    `tensors`."""
    return torch._C._functorch.peek_interpreter_stack() is not None or has_tangent(tensors)


def forward_mode(*tensors: Tensor) -> bool:
    """Whether forward-mode AD (`torch.func.jvp`, `torch.autograd.forward_ad`) tracks this computation.
    Not while torch.compile traces (it does not trace forward-mode AD through these kernels)."""
    if torch.compiler.is_compiling():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        return any(level.key() == torch._C._functorch.TransformType.Jvp
                   for level in retrieve_all_functorch_interpreters())
    return has_tangent(tensors)
