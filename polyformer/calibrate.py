"""Choosing the early-exit threshold by Learn-then-Test (Angelopoulos et al. 2021, arXiv:2110.01052), as CALM
does (Schuster et al. 2022, arXiv:2207.07061, section 4): a threshold is valid when the expected inconsistency
of early-exit generation with the full model is at most epsilon; `calibrate_exit` returns the smallest
threshold it can certify valid with probability at least 1 - delta over the calibration prompts.

Per prompt i and threshold t, the inconsistency L_i(t) in [0, 1] compares the greedy tokens of early-exit
generation with the full model's: the fraction of positions that differ (loss="tokens") or whether any does
(loss="sequence"). For each t the null hypothesis H_t: E[L(t)] > epsilon gets a p-value from the empirical
mean R over the n prompts: Hoeffding-Bentkus for losses in [0, 1],

    p_HB = min(exp(-n h(min(R, eps), eps)), e P(Binomial(n, eps) <= ceil(n R))),
    h(a, b) = a log(a / b) + (1 - a) log((1 - a) / (1 - b)),

or the exact binomial tail P(Binomial(n, eps) <= n R) for the 0 / 1 sequence loss. Fixed-sequence testing
walks the thresholds from the most conservative down, rejecting H_t while p <= delta and stopping at the first
that fails; that controls the family-wise error at delta without a multiplicity correction. Threshold 1 never
exits, so it is always valid and is returned when nothing below it is certified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from .checks import number

DEFAULT_THRESHOLDS = (0.999, 0.995, 0.99, 0.98, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4,
                      0.35, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05, 0.0)


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p)
            + (n - i) * math.log1p(-p) for i in range(k + 1)]
    return min(1.0, sum(math.exp(v) for v in logs))


def hoeffding_bentkus(risk: float, n: int, epsilon: float) -> float:
    """The p-value of H: E[L] > epsilon for losses in [0, 1] with empirical mean `risk` over n examples."""
    a = min(risk, epsilon)
    h = (a * math.log(a / epsilon) if a > 0 else 0.0) + (1 - a) * math.log((1 - a) / (1 - epsilon))
    return min(1.0, math.exp(-n * h), math.e * binomial_cdf(math.ceil(n * risk - 1e-9), n, epsilon))


def binomial_tail(risk: float, n: int, epsilon: float) -> float:
    """The exact p-value of H: P(L = 1) > epsilon for 0 / 1 losses with empirical mean `risk` over n examples."""
    return binomial_cdf(round(n * risk), n, epsilon)


@dataclass
class Calibration:
    """threshold: the one chosen; tested: (threshold, empirical risk, p-value, mean layers) in the order
    tested (the last may have failed); valid: the thresholds certified."""

    threshold: float
    tested: list[tuple[float, float, float, float]]
    valid: list[float]


def inconsistency(early: Tensor, full: Tensor, loss: str) -> Tensor:
    """Per-row inconsistency (b,) in [0, 1] of early-exit tokens (b, s) with the full model's."""
    differ = (early != full).float()
    return differ.mean(-1) if loss == "tokens" else differ.amax(-1)


def _batches(data: Tensor | Iterable[Tensor]) -> list[Tensor]:
    if isinstance(data, Tensor):
        if data.ndim != 2:
            raise ValueError(f"data must be prompts (n, prompt_len) or an iterable of such batches, got "
                             f"{tuple(data.shape)}")
        return list(data.split(64))
    batches = list(data)
    if not batches or any(not isinstance(x, Tensor) or x.ndim != 2 for x in batches):
        raise ValueError("data must be prompts (n, prompt_len) or a non-empty iterable of (b, prompt_len) tensors")
    return batches


def calibrate_exit(model: nn.Module, data: Tensor | Iterable[Tensor], delta: float, epsilon: float,
                   seq_len: int = 16, thresholds: Iterable[float] | None = None, loss: str = "tokens") -> Calibration:
    """The smallest threshold whose inconsistency with the full model is <= epsilon with probability >= 1 - delta.

    Args:
        model: a TransformerWrapper with exit_layers (or an AutoregressiveWrapper of one).
        data: calibration prompts, (n, prompt_len) token ids or an iterable of (b, prompt_len) batches; one
            example per row.
        delta: the allowed probability that the chosen threshold is not valid, in (0, 1).
        epsilon: the tolerated expected inconsistency, in (0, 1).
        seq_len: greedy tokens generated per prompt.
        thresholds: the candidates (default DEFAULT_THRESHOLDS), tested from the largest down.
        loss: "tokens" (fraction of differing tokens, Hoeffding-Bentkus) or "sequence" (any differs, binomial).
    """
    from .generate.early_exit import generate

    for name, value in (("delta", delta), ("epsilon", epsilon)):
        if not number(value) or not 0 < value < 1:
            raise ValueError(f"{name} must be a number in (0, 1), got {value!r}")
    if loss not in ("tokens", "sequence"):
        raise ValueError(f"loss must be 'tokens' or 'sequence', got {loss!r}")
    grid = sorted({float(t) for t in (thresholds if thresholds is not None else DEFAULT_THRESHOLDS)}, reverse=True)
    if not grid or any(not 0 <= t <= 1 for t in grid):
        raise ValueError(f"thresholds must be numbers in [0, 1], got {thresholds!r}")
    batches = _batches(data)
    full = [generate(model, x, seq_len, threshold=1.0).tokens for x in batches]
    n = sum(x.shape[0] for x in batches)
    p_value = hoeffding_bentkus if loss == "tokens" else binomial_tail
    tested, valid = [], []
    for t in grid:
        if t == 1.0:
            continue
        runs = [generate(model, x, seq_len, threshold=t) for x in batches]
        risks = torch.cat([inconsistency(r.tokens, f, loss) for r, f in zip(runs, full)])
        layers = torch.cat([r.layers.flatten().float() for r in runs]).mean()
        risk = float(risks.mean())
        p = p_value(risk, n, epsilon)
        tested.append((t, risk, p, float(layers)))
        if p > delta:
            break
        valid.append(t)
    return Calibration(min(valid) if valid else 1.0, tested, valid)
