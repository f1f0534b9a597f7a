"""Token shift: chunks of the feature dimension move along the sequence (RWKV time-mixing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def shift_sequence(t: Tensor, amount: int) -> Tensor:
    """(b, n, d): position i receives position i - amount, zeros where that is outside the sequence."""
    if amount == 0:
        return t
    if abs(amount) >= t.shape[1]:
        return torch.zeros_like(t)
    return F.pad(t, (0, 0, amount, -amount))


class TokenShift(nn.Module):
    """Split the features into len(shifts) equal chunks (the remainder stays put) and shift
    chunk c by shifts[c] positions. Masked positions send zeros; their own features stay."""

    def __init__(self, shifts: tuple[int, ...]):
        super().__init__()
        self.shifts = tuple(shifts)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        size = x.shape[-1] // len(self.shifts)
        chunks = x.split(size, dim=-1)
        sent = x.masked_fill(~mask[..., None], 0.0) if mask is not None else x
        sent_chunks = sent.split(size, dim=-1)
        moved = [c if s == 0 else shift_sequence(m, s) for c, m, s in zip(chunks, sent_chunks, self.shifts)]
        return torch.cat(moved + list(chunks[len(self.shifts):]), dim=-1)

    @property
    def reach(self) -> int:
        """How many earlier positions the shift reads."""
        return max(self.shifts)

    def extra_repr(self) -> str:
        return f"shifts={self.shifts}"
