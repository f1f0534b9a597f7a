"""Reused CPU memory for the large tensors of a training step.

A fresh CPU tensor of 32 MiB or more comes from its own `mmap`, and every page of it faults on first
write; freeing it unmaps it again. A training step at seq 512 batch 8 (dim 512) allocates four such
tensors per feedforward layer and spent 0.11-0.25 s of system time a step faulting them in (70-190
thousand faults, `getrusage`), on 3.1-3.6 s steps. The pool behind `empty` keeps the buffers it hands
out and hands one out again once nothing holds it any more (the autograd graph that saved it is
gone), so that the second and later steps of a training loop write into memory already mapped. The
pool lives in the compiled CPU kernel (`attention/kernels/cpu_attention.cpp`), which also takes the
attention weights it keeps for the backward, its outputs and its gradients from it; the feedforward
(`PooledFeedForward`) and the attention projections (`pooled.linear`) take theirs from `empty`; without that kernel (or with
`POLYFORMER_CPU_ATTENTION=0`) `empty` is `torch.empty`.

A request takes the smallest free buffer of at least its size and at most twice it, or a new one.
Free buffers are dropped, least recently used first, only while they add up to more than the most
the pool has had handed out at once, so a training loop keeps every buffer its steps use and the pool
stays under twice a step's own peak. Between steps that memory stays mapped (as a GPU caching
allocator's does); `release` gives the free buffers back.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from .attention.kernels import cpu


def _module():
    if os.environ.get(cpu.SWITCH, "1") == "0":
        return None
    return cpu.extension()


def available() -> bool:
    """Whether `empty` hands out pooled memory (the compiled kernel exists and is not switched off)."""
    return _module() is not None


def empty(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """An uninitialised contiguous CPU tensor from the pool (or `torch.empty` without it)."""
    module = _module()
    if module is None:
        return torch.empty(shape, dtype=dtype)
    return module.pooled_tensor(list(shape), dtype)


def state() -> dict[str, int]:
    """The pool: buffers, how many of them are free, bytes held."""
    module = _module()
    if module is None:
        return {"buffers": 0, "free": 0, "bytes": 0}
    buffers, free, held = module.pool_state(False)
    return {"buffers": buffers, "free": free, "bytes": held}


def release() -> None:
    """Drop the pool's free buffers (what a finished training loop left mapped)."""
    module = _module()
    if module is not None:
        module.pool_state(True)
