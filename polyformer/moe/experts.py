"""E feedforwards of one kind (the stack's activation, GLU and bias choices) as stacked weights, run on the
tokens sorted by expert: one matrix product per expert on its contiguous slice."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..config import FeedForwardConfig
from ..feedforward import FeedForward


class Experts(nn.Module):
    """w_in (E, dim, inner) -- (E, dim, 2 inner) with GLU: value features, then gate features --, w_out
    (E, inner, dim), and biases (E, ...) when the feedforward has them. Initialised as nn.Linear is."""

    def __init__(self, dim: int, inner: int, num: int, ff: FeedForwardConfig):
        super().__init__()
        from ..registry import ACTIVATION

        width = inner * (2 if ff.glu else 1)
        self.glu = ff.glu
        self.act = ACTIVATION[ff.activation].build()
        self.dropout = nn.Dropout(ff.dropout)
        self.w_in = nn.Parameter(_uniform((num, dim, width), dim))
        self.w_out = nn.Parameter(_uniform((num, inner, dim), inner))
        self.b_in = nn.Parameter(_uniform((num, width), dim)) if ff.bias else None
        self.b_out = nn.Parameter(_uniform((num, dim), inner)) if ff.bias else None
        self.group = None       # expert parallelism (moe/parallel.py): the process group the experts are spread over,
        self.offset = 0         # and the global index of this process's first expert

    @property
    def num(self) -> int:
        return self.w_in.shape[0]

    def one(self, x: Tensor, e: int) -> Tensor:
        """Expert e on tokens x (..., dim) -> (..., dim)."""
        return self.run(x, *(None if p is None else p[e] for p in (self.w_in, self.b_in, self.w_out, self.b_out)))

    def run(self, x: Tensor, w_in: Tensor, b_in: Tensor | None, w_out: Tensor, b_out: Tensor | None) -> Tensor:
        """One expert of the given weights on tokens x (..., dim)."""
        def proj_in(t: Tensor) -> Tensor:
            return torch.addmm(b_in, t, w_in) if b_in is not None and t.dim() == 2 else _mm(t, w_in, b_in)

        def proj_out(t: Tensor) -> Tensor:
            return torch.addmm(b_out, t, w_out) if b_out is not None and t.dim() == 2 else _mm(t, w_out, b_out)

        return FeedForward.compute(x, proj_in, self.act, proj_out, self.glu, self.dropout)

    def grouped(self, x: Tensor, counts: list[int]) -> Tensor:
        """x (m, dim): tokens sorted by expert, counts[e] of them for expert e -> (m, dim). The stacked weights
        are unbound once (a select per expert would make its backward add a full-size gradient per expert)."""
        weights = [p.unbind(0) if p is not None else [None] * self.num for p in (self.w_in, self.b_in, self.w_out,
                                                                                 self.b_out)]
        parts = [self.run(part, *(w[e] for w in weights)) for e, part in enumerate(x.split(counts)) if counts[e]]
        if not parts:
            return x.new_zeros(0, self.w_out.shape[-1])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def routed(self, x: Tensor, counts: list[int]) -> Tensor:
        """`grouped` on this process's experts, or with expert parallelism on the experts of every process of
        the group, the tokens exchanged with all_to_all (counts: per global expert)."""
        if self.group is None:
            return self.grouped(x, counts)
        from .exchange import apply_sharded

        return apply_sharded(x, torch.tensor(counts, device=x.device), lambda t, c: self.grouped(t, c.tolist()),
                             self.group)

    def everywhere(self, x: Tensor, weights: Tensor) -> Tensor:
        """Every expert on every token x (t, dim), summed with weights (t, E) (zero where not chosen) -> (t, dim):
        the same mixture with shapes that do not depend on the routing, for a traced forward (torch.compile,
        torch.export), which cannot slice by counts it has not computed: one batched product over the experts."""
        b_in, b_out = (None if p is None else p[:, None] for p in (self.b_in, self.b_out))
        y = self.run(x.expand(self.num, *x.shape), self.w_in, b_in, self.w_out, b_out)      # (E, t, dim)
        return torch.einsum("etd,te->td", y, weights.to(y.dtype))


def _mm(t: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return t @ w + b if b is not None else t @ w


def _uniform(shape: tuple[int, ...], fan_in: int) -> Tensor:
    bound = 1 / math.sqrt(fan_in)
    return torch.empty(shape).uniform_(-bound, bound)


def dispatch(experts: Tensor, keep: Tensor | None, num: int) -> tuple[Tensor, Tensor, list[int]]:
    """The kept routing choices sorted by expert, without a loop over tokens: experts (t, k), keep (t, k)
    bool or None -> (slots (m,) into the flattened (t * k) choices, in expert order and token order within
    an expert; tokens (m,) their tokens; counts, the m choices per expert)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    if keep is not None:
        flat = flat.masked_fill(~keep.reshape(-1), num)     # dropped choices sort last, past every expert
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num + 1).tolist()
    slots = order[: sum(counts[:num])]
    return slots, slots // k, counts[:num]


def combine(y: Tensor, slots: Tensor, tokens: Tensor, gates: Tensor, t: int) -> Tensor:
    """Each kept choice's expert output y (m, dim) times its gate (gates (t, k), taken at `slots`), summed
    per token -> (t, dim); a token no expert took gets zero."""
    weighted = y * gates.reshape(-1).index_select(0, slots)[:, None].to(y.dtype)
    return y.new_zeros(t, y.shape[-1]).index_add_(0, tokens, weighted)
