"""Which keys a query may see, from explicit positions: boolean, True = keep."""

from __future__ import annotations

from torch import Tensor


def causal(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """(b|1, i, j): a key is visible when it is not after the query."""
    return k_pos[..., None, :] <= q_pos[..., :, None]
