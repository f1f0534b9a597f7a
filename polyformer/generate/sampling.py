"""Logit filters for sampling, composable: each maps logits (b, v) to logits with the removed
entries at -inf. Each takes its keywords under our names and under x-transformers' (`top_p(thres=)`,
`min_p(min_p=)`); `FILTERS` names them for `filter_logits_fn="top_k"` and the like."""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _one(name: str, ours: str, value: float | None, theirs: str, other: float | None, default: float) -> float:
    """The value of a keyword given under either spelling (never both)."""
    if value is not None and other is not None:
        raise ValueError(f"{name} takes {ours} or {theirs} (the same setting), not both")
    return value if value is not None else other if other is not None else default


def top_k(logits: Tensor, k: int | None = None, frac_num_tokens: float = 0.1) -> Tensor:
    """Keep the k largest logits per row (default: ceil(frac_num_tokens * vocabulary))."""
    if k is None:
        if not 0 < frac_num_tokens <= 1:
            raise ValueError(f"top_k needs frac_num_tokens in (0, 1], got {frac_num_tokens}")
        k = math.ceil(frac_num_tokens * logits.shape[-1])
    if k < 1:
        raise ValueError(f"top_k needs k >= 1, got {k}")
    k = min(k, logits.shape[-1])
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p(logits: Tensor, p: float | None = None, thres: float | None = None) -> Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability mass is >= p
    (`thres` is x-transformers' name for p; default 0.9)."""
    p = _one("top_p", "p", p, "thres", thres, 0.9)
    if not 0 < p <= 1:
        raise ValueError(f"top_p needs p in (0, 1], got {p}")
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    mass_before = F.pad(mass[..., :-1], (1, 0))          # mass of the strictly more likely tokens
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p(logits: Tensor, p: float | None = None, min_p: float | None = None) -> Tensor:
    """Keep tokens whose probability is at least p times the largest probability (arXiv:2407.01082;
    `min_p` is x-transformers' name for p; default 0.1)."""
    p = _one("min_p", "p", p, "min_p", min_p, 0.1)
    if not 0 <= p <= 1:
        raise ValueError(f"min_p needs p in [0, 1], got {p}")
    probs = logits.softmax(dim=-1)
    limit = probs.amax(dim=-1, keepdim=True) * p
    return logits.masked_fill(probs < limit, float("-inf"))


def top_a(logits: Tensor, min_p_pow: float = 2.0, min_p_ratio: float = 0.02) -> Tensor:
    """Top-a: keep tokens whose probability is at least min_p_ratio * p_max ** min_p_pow, a cut that
    tightens when the model is confident and loosens when it is not (x-transformers' names)."""
    if not 0 <= min_p_ratio <= 1:
        raise ValueError(f"top_a needs min_p_ratio in [0, 1], got {min_p_ratio}")
    if not min_p_pow > 0:
        raise ValueError(f"top_a needs min_p_pow > 0, got {min_p_pow}")
    probs = logits.softmax(dim=-1)
    limit = probs.amax(dim=-1, keepdim=True) ** min_p_pow * min_p_ratio
    return logits.masked_fill(probs < limit, float("-inf"))


FILTERS: dict[str, Callable[..., Tensor]] = {"top_k": top_k, "top_p": top_p, "top_a": top_a, "min_p": min_p}


def filter_fn(fn: Callable | str) -> Callable:
    """A filter given by name (`FILTERS`) or as a callable."""
    if isinstance(fn, str):
        if fn not in FILTERS:
            raise ValueError(f"filter_logits_fn {fn!r} is not a filter; the named ones are {sorted(FILTERS)}")
        return FILTERS[fn]
    if not callable(fn):
        raise TypeError(f"filter_logits_fn must be a callable or one of {sorted(FILTERS)}, got {fn!r}")
    return fn


def check_kwargs(fn: Callable, kwargs: dict) -> None:
    """Refuse, by name, keywords that the filter `fn` does not take."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):      # a builtin without a signature: its own call will say
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    named = [name for name, p in list(params.items())[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [key for key in kwargs if key not in named]
    if unknown:
        name = getattr(fn, "__name__", repr(fn))
        raise TypeError(f"filter_kwargs {unknown} are not keywords of {name}; it takes {named}")


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
    sampling at `temperature` (0 = greedy). Filters are given as one callable or name (`FILTERS`) or a
    list, with one kwargs dict or a list of them, e.g. `[top_k, "top_p"]` with `[{"k": 50}, {"p": 0.9}]`."""

    def __init__(self, temperature: float = 1.0, filter_logits_fn: Callable | list | None = None,
                 filter_kwargs: dict | list | None = None, repetition_penalty: float = 1.0,
                 generator: torch.Generator | None = None):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        fns = [] if filter_logits_fn is None else [filter_fn(fn) for fn in (
            filter_logits_fn if isinstance(filter_logits_fn, (list, tuple)) else [filter_logits_fn])]
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
        for fn, kw in zip(fns, kwargs):
            check_kwargs(fn, kw)
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
