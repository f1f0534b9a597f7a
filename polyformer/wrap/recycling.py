"""Recycling (AlphaFold2, Jumper et al. 2021, Nature 596:583): the stack runs several times over the same
embedded input, each run after the first also given a projection of the previous run's output; gradients
flow through the last run only. Training draws the number of runs, evaluation is told it."""

from __future__ import annotations

import random
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .. import checks
from ..stack import AttentionLayers


class Recycling(nn.Module):
    """The projection of a run's output (b, n, dim) added to the next run's input."""

    def __init__(self, dim: int, train_max_steps: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.train_max_steps = train_max_steps

    @classmethod
    def build(cls, owner: str, recycling: object, train_max_steps: object, stack: AttentionLayers) -> "Recycling | None":
        if not isinstance(recycling, bool):
            raise TypeError(f"{owner}: recycling must be True or False, got {recycling!r}")
        checks.count(train_max_steps, f"{owner}: train_max_recycle_steps")
        if not recycling:
            return None
        if stack.out_dim != stack.dim:
            raise ValueError(f"{owner}: recycling=True feeds the stack's output back to its input, so it needs "
                             f"out_dim == dim; reversible_merge='concat' gives {stack.out_dim}")
        return cls(stack.dim, train_max_steps)

    def steps(self, given: int | None, training: bool) -> int:
        if given is not None:
            return checks.count(given, "recycle_steps")
        if training:
            return random.randint(1, self.train_max_steps)
        raise ValueError("recycling=True: pass recycle_steps= to the forward outside training")


def run(recycling: Recycling | None, h: Tensor, stack_run: Callable[[Tensor], tuple[Tensor, Any, Any]],
        steps: int | None, training: bool) -> tuple[Tensor, Any, Any]:
    """stack_run(h) once, or recycled: run r sees h + proj(out of run r - 1, detached); runs before the
    last one take no gradient. The stack's output must line up with h's positions (its last n)."""
    if recycling is None:
        if steps is not None:
            raise ValueError("recycle_steps was given, but the model was built without recycling=True")
        return stack_run(h)
    total = recycling.steps(steps, training)
    out = None
    for i in range(total):
        with torch.set_grad_enabled(torch.is_grad_enabled() and i == total - 1):
            given = h if out is None else h + recycling.proj(out[:, -h.shape[1]:].detach())
            out, record, mems = stack_run(given)
    return out, record, mems
