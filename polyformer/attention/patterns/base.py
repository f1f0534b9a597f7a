"""Which keys a query may see, from explicit positions: boolean, True = keep."""

from __future__ import annotations

from torch import Tensor


def causal(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """(b|1, i, j): a key is visible when it is not after the query."""
    return k_pos[..., None, :] <= q_pos[..., :, None]


def prefix_causal(q_pos: Tensor, k_pos: Tensor, start: Tensor, end: Tensor) -> Tensor:
    """(b, i, j) prefix-LM: causal, and every query also sees the whole prefix (keys at positions
    in [start, end), each (b, 1)), so the prefix attends to itself bidirectionally."""
    return causal(q_pos, k_pos) | ((k_pos >= start) & (k_pos < end))[..., None, :]
