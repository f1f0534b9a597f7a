"""Adaptive Computation Time per position (Graves 2016, arXiv:1603.08983) as the Universal Transformer
uses it (arXiv:1807.03819): a depth policy that repeats the stack's shared unit of blocks (universal.py)
until each position halts.

After step n a running position's state s^n gets the halting probability h^n = sigmoid(w . s^n + b); the
position halts at the first step N where h^1 + ... + h^N >= act_threshold (1 - eps), or at act_max_steps.
Its halting weights are p^n = h^n for n < N and the remainder R = 1 - (h^1 + ... + h^(N-1)) at N, so they
sum to 1, and its output is sum_n p^n s^n. A halted position's state is copied forward unchanged: later
steps still feed it to the unit (its keys, computed from that state plus the step's coordinate embedding,
stay visible to the positions still running) but keep none of the result. The ponder cost mean(N + R) over
the kept positions is reported as "act_ponder" with weight act_ponder_weight (tau); only R has a gradient.

Skipped work is not done: the loop ends once every kept position has halted, and a batch row whose
positions have all halted leaves the batch (the unit runs on the rows still running). A decoding step runs
every step on every position instead, since a later token may read this one's keys at any step, and so does
a traced forward (torch.compile, export), which cannot branch on tensor values. Padding positions halt after
the first step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor, nn

from .checks import number, values_hidden, whole
from .interfaces import Context
from .precision import upcast
from .stack_policies import REINJECT

Step = Callable[[Tensor, int, Context], Tensor]     # (states (b', n, dim), step t from 0, their context) -> states


@dataclass(frozen=True)
class ActOptions:
    threshold: float = 0.99             # 1 - eps: a position halts once its halting probabilities reach it
    max_steps: int | None = None        # the most steps a position takes; None: the stack's depth
    ponder_weight: float = 0.01         # tau, the weight of the ponder cost mean(N + R)


@dataclass
class Ponder:
    """What the last forward's halting did, detached: weights[n] (steps run, b, n) the halting weights p of
    step n + 1, steps N (b, n) and remainders R (b, n) per position."""

    weights: Tensor
    steps: Tensor
    remainders: Tensor


def problems(options: ActOptions) -> list[str]:
    """What is wrong with the ACT keywords' values, each naming its keyword."""
    found = []
    t = options.threshold
    if not number(t) or not 0 < t < 1:
        found.append(f"act_threshold must be a number in (0, 1) (it is 1 - eps), got {t!r}")
    found += whole(options.max_steps, "act_max_steps", optional=True)
    w = options.ponder_weight
    if not number(w) or w < 0:
        found.append(f"act_ponder_weight must be a number >= 0, got {w!r}")
    return found


class Halting(nn.Module):
    """The halting unit (a linear layer and a sigmoid on the state) and the ACT loop over a step function."""

    loss_names = ("act_ponder",)

    def __init__(self, dim: int, options: ActOptions, steps: int):
        super().__init__()
        self.unit = nn.Linear(dim, 1)
        nn.init.constant_(self.unit.bias, 1.0)      # the Universal Transformer's initial halting bias
        self.threshold, self.weight, self.steps = options.threshold, options.ponder_weight, steps
        self.last: Ponder | None = None

    def probability(self, s: Tensor) -> Tensor:
        """States (b, n, dim) -> halting probabilities (b, n), in float32 or above."""
        return torch.sigmoid(upcast(self.unit(s).squeeze(-1)))

    def forward(self, step: Step, x: Tensor, ctx: Context, every_step: bool = False, gather: bool = True) -> Tensor:
        """x (b, n, dim) -> the halting-weighted mix of the step states (b, n, dim). `every_step`: run every
        step on every position (decoding); `gather`: run a step on the rows still running only."""
        if values_hidden():            # traced (torch.compile, export) or vmapped: no branch on tensor values
            every_step, gather = True, False
        b, n, _ = x.shape
        kept = ctx.mask if ctx.mask is not None else torch.ones(b, n, dtype=torch.bool, device=x.device)
        acc = upcast(x).dtype
        out = torch.zeros(b, n, x.shape[-1], dtype=acc, device=x.device)
        cum = torch.zeros(b, n, dtype=acc, device=x.device)          # sum of h over the steps taken before
        taken, remainder = torch.zeros_like(cum), torch.zeros_like(cum)
        running = torch.ones(b, n, dtype=torch.bool, device=x.device)
        weights, rows, sub, state = [], None, ctx, x
        for t in range(self.steps):
            live = running.any(-1)
            if gather and not bool(live.all()):
                picked = live.nonzero().squeeze(-1)
                if rows is None or not torch.equal(picked, rows):
                    rows, sub = picked, rows_of(ctx, picked)
                new = state.index_copy(0, rows, step(state.index_select(0, rows), t, sub))
            else:
                new = step(state, t, ctx)
            state = torch.where(running[..., None], new, state)     # a halted state is copied forward
            h = self.probability(state)
            stop = running & ((cum + h >= self.threshold) | (t == self.steps - 1) | ~kept)
            go = running & ~stop
            p = torch.where(stop, 1 - cum, torch.where(go, h, 0.0))
            out = out + p[..., None] * state
            remainder = torch.where(stop, 1 - cum, remainder)
            taken = torch.where(stop, float(t + 1), taken)
            cum = cum + torch.where(go, h, 0.0)
            running = go
            weights.append(p.detach())
            if not every_step and not bool(running.any()):
                break
        cost = ((taken + remainder) * kept).sum() / kept.sum().clamp(min=1)
        ctx.losses.report("act_ponder", cost, self.weight)
        self.last = Ponder(torch.stack(weights), taken, remainder.detach())
        return out.to(x.dtype)


def rows_of(ctx: Context, rows: Tensor) -> Context:
    """The forward's context for batch rows `rows` only (a fresh memo: its masks have the batch's size)."""
    def pick(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.index_select(0, rows)

    span = ctx.prefix_span
    inject = ctx.memo.get(REINJECT)         # reinject_input's W x0 (b, n, dim): these rows' own
    return replace(ctx, pos=ctx.pos if ctx.pos.shape[0] == 1 else pick(ctx.pos), mask=pick(ctx.mask),
                   context=pick(ctx.context), context_mask=pick(ctx.context_mask), global_mask=pick(ctx.global_mask),
                   prefix_span=None if span is None else (pick(span[0]), pick(span[1])),
                   shift_mask=pick(ctx.shift_mask), memo={} if inject is None else {REINJECT: pick(inject)})
