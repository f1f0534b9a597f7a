"""Multi-query associative recall (MQAR) in the layout of Zoology (Arora et al. 2023,
arXiv:2312.04927): key-value pairs, then every key queried once at power-law distributed gaps."""

from __future__ import annotations

import math

import torch

IGNORE = -100                 # target of a position without a label (the cross-entropy default)
_CHUNK_ELEMENTS = 1 << 22     # bounds the scratch scores of one without-replacement draw


def _draw_without_replacement(weights: torch.Tensor | None, size: int, rows: int, k: int,
                              g: torch.Generator) -> torch.Tensor:
    """(rows, k) indices into range(size), k distinct per row, in the order successive draws
    without replacement with the given weights (uniform when None) would give them: the k
    smallest of E_i / w_i with E_i ~ Exp(1) (an exponential race) have exactly that distribution
    and need no loop over draws. Uniform draws take the k largest of U[0, 1) scores instead,
    which is the same race and cheaper for a large vocabulary."""
    per_chunk = max(1, _CHUNK_ELEMENTS // size)
    parts = []
    for start in range(0, rows, per_chunk):
        n = min(per_chunk, rows - start)
        if weights is None:
            parts.append(torch.rand(n, size, generator=g).topk(k, dim=1).indices)
        else:
            race = torch.empty(n, size, dtype=torch.float64).exponential_(generator=g) / weights
            parts.append(race.topk(k, dim=1, largest=False).indices)
    return torch.cat(parts) if parts else torch.empty(0, k, dtype=torch.int64)


def generate(num: int, seed: int, *, seq_len: int = 128, num_pairs: int = 16, vocab_size: int = 512,
             power_a: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both (num, seq_len) int64, drawn from `seed` alone.

    The underlying sequence has seq_len + 1 tokens: num_pairs distinct keys from
    [1, vocab_size // 2), each followed by its value from [vocab_size // 2, vocab_size) (values
    distinct too), then every key once more, each followed by its value again, at slot
    positions 2 * num_pairs + 2 * gap. Gaps are distinct, drawn without replacement with weight
    (gap + 1) ** (power_a - 1) (Zoology's power law; power_a = 1 is uniform, small favours short), and
    each gap asks for a key chosen in a random order. Every other token is 0.
    inputs are its first seq_len tokens; targets[t] is the value at t + 1 where a query key sits at
    t, and IGNORE elsewhere (the context and the filler carry no label).

    Unlike Zoology the filler stays 0 rather than random tokens, the value follows its query in the
    input too (inputs shifted by one match targets wherever a label is), and the keys are asked in a
    random order: Zoology gives the j-th context key the j-th gap drawn, and as short gaps are drawn
    first the queries come roughly in context order, a positional shortcut that a small training
    budget learns instead of recall (2-layer attention, width 64, 8 pairs in 64 tokens, 10M tokens:
    35% of queries answered, every configuration tried stuck there).
    """
    if num < 0:
        raise ValueError(f"num: expected an integer >= 0, got {num}")
    if num_pairs < 1:
        raise ValueError(f"num_pairs: expected an integer >= 1, got {num_pairs}")
    if 4 * num_pairs > seq_len + 1:
        raise ValueError(f"seq_len: expected >= {4 * num_pairs - 1} so that {num_pairs} pairs and "
                         f"{num_pairs} queries with their values fit in seq_len + 1 tokens, got {seq_len}")
    half = vocab_size // 2
    if half - 1 < num_pairs:
        raise ValueError(f"vocab_size: expected >= {2 * num_pairs + 2} so that keys [1, vocab_size // 2) "
                         f"hold {num_pairs} distinct keys, got {vocab_size}")
    if not (math.isfinite(power_a) and power_a > 0):
        raise ValueError(f"power_a: expected a number > 0, got {power_a}")
    g = torch.Generator().manual_seed(seed)
    keys = 1 + _draw_without_replacement(None, half - 1, num, num_pairs, g)
    values = half + _draw_without_replacement(None, vocab_size - half, num, num_pairs, g)
    context = 2 * num_pairs
    slots = (seq_len + 1 - context) // 2
    rank = torch.arange(1, slots + 1, dtype=torch.float64)          # gap + 1
    gaps = _draw_without_replacement(rank ** (power_a - 1), slots, num, num_pairs, g)

    # which key each gap asks for: a random order, not the context's (see the docstring)
    asked = torch.rand(num, num_pairs, generator=g).argsort(dim=1)

    sequence = torch.zeros(num, seq_len + 1, dtype=torch.int64)
    sequence[:, 0:context:2] = keys
    sequence[:, 1:context:2] = values
    queries = context + 2 * gaps
    sequence.scatter_(1, queries, keys.gather(1, asked))
    sequence.scatter_(1, queries + 1, values.gather(1, asked))
    targets = torch.full((num, seq_len), IGNORE, dtype=torch.int64)
    targets.scatter_(1, queries, values.gather(1, asked))
    return sequence[:, :-1].contiguous(), targets
