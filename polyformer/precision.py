"""The precision the sensitive steps compute in: never below float32, never below the input's."""

from __future__ import annotations

import torch
from torch import Tensor


def upcast(x: Tensor) -> Tensor:
    """float32 for half and bfloat16 tensors; float32 and float64 tensors as they are. Norms,
    softmax and rotary run in it, so low precision gains float32 and a float64 model stays float64
    (gradient checks and finite differences need every step in float64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


HIDDEN = -1e30      # the score of a key a query may not see: finite, so a query that sees no key stays finite (no NaN)
