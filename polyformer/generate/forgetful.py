"""Forgetful causal masking (FCM, arXiv:2210.13432): while training, each sequence hides a random set of
its past tokens from every query's self-attention (never the first, so every query sees a key), which
keeps a causal language model from leaning on the most recent tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from ..attn_mask import _refusal


def check(mask_prob: object, stack: object) -> float:
    """mask_prob in [0, 1), for a stack whose self-attention can take a (query, key) mask."""
    if isinstance(mask_prob, bool) or not isinstance(mask_prob, (int, float)) or not 0 <= mask_prob < 1:
        raise ValueError(f"mask_prob must be a fraction in [0, 1), got {mask_prob!r}")
    if mask_prob > 0:
        why = _refusal(stack)
        if why is not None:
            raise ValueError(f"mask_prob={mask_prob} masks self-attention keys, which this model cannot: {why}")
    return float(mask_prob)


def hidden_keys(b: int, n: int, mask_prob: float, device: torch.device,
                generator: torch.Generator | None = None) -> Tensor:
    """(b, n) bool, True = the key stays: in each row min(floor(n * mask_prob), n - 1) positions
    other than the first, drawn uniformly, are False."""
    count = min(int(n * mask_prob), n - 1)
    draw = torch.rand(b, n, device=device, generator=generator)
    draw[:, 0] = -1.0                               # below every draw: never among the hidden
    keep = torch.ones(b, n, dtype=torch.bool, device=device)
    return keep.scatter(1, draw.topk(count, dim=-1).indices, False)


def attn_mask(keep: Tensor) -> Tensor:
    """Key mask (b, n) -> the (b, 1, n, n) attn_mask that hides those keys from every query."""
    n = keep.shape[1]
    return keep[:, None, None, :].expand(-1, 1, n, n)
