"""Which kinds of automatic differentiation and torch.func transform a call runs under.

The fused attention kernels carry only some derivatives: our CPU operator (`attention/kernels/cpu.py`)
has a first-order backward formula, and ATen's CPU flash kernel behind SDPA has a backward with no
derivative of its own and no forward-mode formula. The dense kernel routes around them with these
helpers, and the input checks (`checks.py`) skip reading values where vmap cannot.

Written against torch 2.13's functorch interpreter stack (`torch._C._functorch`) and
`torch.autograd.forward_ad`; these are private interfaces, so tests/test_autodiff.py pins what they
report for each nesting the library relies on. While torch.compile traces, the stack cannot be read
(dynamo reports a level where there is none, and cannot trace the list of levels), so every helper
says "no transform" there: a torch.func transform traced by torch.compile is not routed (left open).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch._C._functorch import TransformType
from torch.autograd import forward_ad

VMAP, GRAD, JVP = TransformType.Vmap, TransformType.Grad, TransformType.Jvp


def any_transform() -> bool:
    """Whether a torch.func transform (grad, vjp, jacrev, vmap, jvp, jacfwd ...) is running (False while
    torch.compile traces)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


def levels(kind: TransformType) -> int:
    """How many torch.func transforms of this kind are running, nested."""
    if not any_transform():
        return 0
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return sum(level.key() == kind for level in retrieve_all_functorch_interpreters())


def has_tangent(tensors: tuple[Tensor | None, ...]) -> bool:
    """Whether `torch.autograd.forward_ad` carries a tangent on one of `tensors` (outside torch.func:
    reading a tangent under vmap is an error)."""
    return not torch.compiler.is_compiling() and forward_ad._current_level >= 0 and any(
        t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def transformed(*tensors: Tensor | None) -> bool:
    """Whether any torch.func transform is running, or forward-mode AD tracks one of `tensors`."""
    return any_transform() or has_tangent(tensors)


def forward_mode(*tensors: Tensor | None) -> bool:
    """Whether forward-mode AD (`torch.func.jvp` / `jacfwd`, `torch.autograd.forward_ad`) may track this
    computation. Under torch.func a forward_ad dual level counts whatever the tensors, since their
    tangents cannot be read there."""
    if any_transform():
        return levels(JVP) > 0 or forward_ad._current_level >= 0
    return has_tangent(tensors)


def needs_reference(*tensors: Tensor | None) -> bool:
    """Whether this computation needs derivatives that no fused attention kernel has: forward mode, or
    reverse mode nested twice under torch.func (`grad(grad(f))`, `jacrev(jacrev(f))`: SDPA's CPU flash
    backward has no derivative, and our operator steps aside under every transform)."""
    return forward_mode(*tensors) or levels(GRAD) >= 2


def graph_gradients(fn: Callable[..., Tensor], inputs: Sequence[Tensor | None], grad: Tensor,
                    wanted: Sequence[bool] | None = None) -> tuple[Tensor | None, ...]:
    """The gradients of fn(*inputs) against each input that requires grad (and is wanted), with a graph
    (create_graph=True): what a fused operator's backward returns under a second derivative, through
    plain differentiable operations. Each input is differentiated through its own alias, so that one
    tensor passed in two slots gets each slot's gradient (autograd adds them), not their sum in each."""
    slots = [t.view_as(t) if t is not None and t.requires_grad else t for t in inputs]
    taken = [t is not None and t.requires_grad and (wanted is None or wanted[n]) for n, t in enumerate(slots)]
    out = fn(*slots)
    found = iter(torch.autograd.grad(out, [t for t, take in zip(slots, taken) if take], grad,
                                     create_graph=True, allow_unused=True))
    return tuple(next(found) if take else None for take in taken)


@contextlib.contextmanager
def deeper(depth: list[int]) -> Iterator[None]:
    """depth[0] one higher while the block runs: a nesting counter for "inside such a call" flags (a reversible
    recomputation, the CPU kernel switched off)."""
    depth[0] += 1
    try:
        yield
    finally:
        depth[0] -= 1
