"""Logit filters for sampling, composable: each maps logits (b, v) to logits with the removed
entries at -inf."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def top_k(logits: Tensor, k: int | None = None, frac_num_tokens: float = 0.1) -> Tensor:
    """Keep the k largest logits per row (default: 10% of the vocabulary)."""
    if k is None:
        k = max(1, int(frac_num_tokens * logits.shape[-1]))
    if k < 1:
        raise ValueError(f"top_k needs k >= 1, got {k}")
    k = min(k, logits.shape[-1])
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p(logits: Tensor, p: float = 0.9) -> Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability mass is >= p."""
    if not 0 < p <= 1:
        raise ValueError(f"top_p needs p in (0, 1], got {p}")
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs          # mass of the strictly more likely tokens
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p(logits: Tensor, p: float = 0.1) -> Tensor:
    """Keep tokens whose probability is at least p times the largest probability."""
    if not 0 <= p <= 1:
        raise ValueError(f"min_p needs p in [0, 1], got {p}")
    probs = logits.softmax(dim=-1)
    limit = probs.amax(dim=-1, keepdim=True) * p
    return logits.masked_fill(probs < limit, float("-inf"))


def sample(logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor:
    """(b, v) -> (b,) token ids; temperature 0 is greedy."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = (logits / temperature).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's penalty (arXiv:1909.05858): logits of tokens already in the sequence (`seen`, (b, v)
    bool) are divided by `penalty` when positive and multiplied by it when negative."""
    if penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {penalty}")
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


class Sampler:
    """Turns next-token logits into tokens: repetition penalty, then each filter in order, then
    sampling at `temperature` (0 = greedy). Filters are given as one callable or a list, with one
    kwargs dict or a list of them, e.g. `[top_k, top_p]` with `[{"k": 50}, {"p": 0.9}]`."""

    def __init__(self, temperature: float = 1.0, filter_logits_fn: Callable | list | None = None,
                 filter_kwargs: dict | list | None = None, repetition_penalty: float = 1.0,
                 generator: torch.Generator | None = None):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        fns = [] if filter_logits_fn is None else (
            list(filter_logits_fn) if isinstance(filter_logits_fn, (list, tuple)) else [filter_logits_fn])
        if filter_kwargs is None:
            kwargs: list[dict] = [{} for _ in fns]
        elif isinstance(filter_kwargs, dict):
            kwargs = [filter_kwargs] if fns else []
            if not fns and filter_kwargs:
                raise ValueError("filter_kwargs were given without a filter_logits_fn to receive them")
        else:
            kwargs = list(filter_kwargs)
        if len(kwargs) != len(fns):
            raise ValueError(f"filter_kwargs needs one dict per filter: {len(fns)} filters, {len(kwargs)} dicts")
        self.filters = list(zip(fns, kwargs))
        self.temperature = temperature
        self.penalty = repetition_penalty
        self.generator = generator

    def check(self, num_tokens: int) -> None:
        """Run the filters once on dummy logits, so bad filter arguments fail before any compute."""
        logits = torch.zeros(1, num_tokens)
        for fn, kw in self.filters:
            fn(logits, **kw)

    def probs(self, logits: Tensor) -> Tensor:
        """(..., v) logits -> (..., v) float32 probabilities that sampling draws from: the filters in
        order, then softmax(logits / temperature); temperature 0 is a one-hot argmax. (No repetition
        penalty: it depends on the sequence, see `__call__`.)"""
        shape = logits.shape
        logits = logits.reshape(-1, shape[-1])           # filters take (b, v)
        for fn, kw in self.filters:
            logits = fn(logits, **kw)
        logits = logits.float().reshape(shape)
        if self.temperature == 0:
            return torch.nn.functional.one_hot(logits.argmax(dim=-1), shape[-1]).float()
        return (logits / self.temperature).softmax(dim=-1)

    def __call__(self, logits: Tensor, seen: Tensor | None = None) -> Tensor:
        if self.penalty != 1.0 and seen is not None:
            logits = repetition_penalty(logits, seen, self.penalty)
        for fn, kw in self.filters:
            logits = fn(logits, **kw)
        return sample(logits, self.temperature, self.generator)
