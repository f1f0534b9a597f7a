"""Randomized positional encodings (Ruoss et al. 2023, arXiv:2305.16843): in training, the n positions of
a sequence are a sorted sample of n distinct positions of [0, L), with L longer than any training
sequence, so every position a longer test sequence uses was seen in training; in evaluation they are
0 .. n-1. They reach whatever reads positions: learned absolute positions (a table of L rows), scaled
sinusoids, rotary, ALiBi, the T5 bias, per-layer tables.

One sample per row of the batch (the paper gives each training example its own; the authors' code draws
one per batch), fresh at every training forward, from torch's default generator (reproducible under
torch.manual_seed, as the trainer seeds it).
"""

from __future__ import annotations

import torch
from torch import Tensor

KEYWORD = "randomized_pos"


def limit(owner: str, value: object, max_seq_len: int) -> int:
    """How many positions the model's absolute positions must cover: L for randomized_pos=L, else
    max_seq_len; L <= max_seq_len or a non-integer is refused by name."""
    if value is None:
        return max_seq_len
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {KEYWORD} must be an integer L > max_seq_len (positions drawn from [0, L)), "
                        f"got {value!r}")
    if value <= max_seq_len:
        raise ValueError(f"{owner}: {KEYWORD}={value} must be greater than max_seq_len={max_seq_len}: training "
                         "positions are drawn from [0, L) to cover the longer sequences of evaluation")
    return value


def check(owner: str, value: int | None, positional: bool, max_mem_len: int) -> None:
    """randomized_pos needs positions to randomize, and no Transformer-XL memories (their positions run on
    from segment to segment, which a fresh sample per segment would break)."""
    if value is None:
        return
    if not positional:
        raise ValueError(f"{owner}: {KEYWORD}={value} randomizes positions, but the model reads none (no absolute "
                         "positions, rotary, ALiBi, relative bias or per-layer positions)")
    if max_mem_len:
        raise ValueError(f"{owner}: {KEYWORD}={value} cannot combine with max_mem_len={max_mem_len}: a memory's "
                         "positions continue the previous segment's")


def sample(batch: int, n: int, length: int, device: torch.device) -> Tensor:
    """(batch, n) positions: per row, n distinct positions of [0, length), increasing."""
    if n > length:
        raise ValueError(f"x has {n} positions, more than {KEYWORD}={length} can give distinct positions to")
    keys = torch.rand(batch, length, device=device)
    return keys.topk(n, dim=-1).indices.sort(dim=-1).values              # a uniform n-subset per row
