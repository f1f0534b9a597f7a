"""Logit filters for sampling, composable: each maps logits (b, v) to logits with the removed
entries at -inf."""

from __future__ import annotations

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
