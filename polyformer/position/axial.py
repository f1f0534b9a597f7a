"""Axial positional embeddings, as the Reformer uses them (arXiv:2001.04451; Ho et al. 2019,
arXiv:1912.12180): positions laid out on an a x b grid, each row and each column with a learned vector,
so a table of a * b positions costs (a * d1 + b * d2) numbers instead of a * b * dim.

    E(p) = concat(E1[p // b], E2[p % b]),    d1 + d2 = dim

The two tables are held as Hugging Face's `AxialPositionEmbeddings` holds them, `weights.0` of shape
(a, 1, d1) and `weights.1` of shape (1, b, d2), so a converter copies them as they are. Unlike Hugging
Face's, no dropout of whole rows in training (the wrapper's emb_dropout applies to the sum).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..checks import whole


class AxialPositions(nn.Module):
    """Position p (< a * b) -> concat(E1[p // b], E2[p % b]) of size d1 + d2."""

    def __init__(self, shape: tuple[int, int], dims: tuple[int, int]):
        super().__init__()
        (a, b), (d1, d2) = shape, dims
        self.shape = (a, b)
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(a, 1, d1) * 0.02),
                                         nn.Parameter(torch.randn(1, b, d2) * 0.02)])

    def forward(self, pos: Tensor) -> Tensor:
        b = self.shape[1]
        rows, cols = self.weights[0][:, 0], self.weights[1][0]          # (a, d1), (b, d2)
        return torch.cat((rows[pos // b], cols[pos % b]), dim=-1)       # (b|1, n, d1 + d2)


def _pair(value: object, name: str, owner: str) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2 or any(whole(v, name) for v in value):
        raise TypeError(f"{owner}: {name} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def axial_positions(owner: str, dim: int, max_seq_len: int, shape: object, dims: object,
                    conflicts: list[str]) -> AxialPositions:
    """The wrapper's axial positions from its keywords axial_pos_emb=(a, b) and axial_pos_emb_dims=(d1, d2)
    (default: dim // 2 and the rest), refusing bad values and `conflicts` (other absolute-position
    keywords given) by name."""
    if shape is None:
        raise ValueError(f"{owner}: axial_pos_emb_dims is set but axial_pos_emb is not: give axial_pos_emb=(a, b)")
    if conflicts:
        raise ValueError(f"{owner}: axial_pos_emb chooses the absolute positions; it cannot combine with "
                         f"{' / '.join(conflicts)}")
    a, b = _pair(shape, "axial_pos_emb", owner)
    if a * b < max_seq_len:
        raise ValueError(f"{owner}: axial_pos_emb={shape!r} lays out a * b = {a * b} positions, fewer than "
                         f"max_seq_len={max_seq_len}")
    d1, d2 = _pair(dims, "axial_pos_emb_dims", owner) if dims is not None else (dim // 2, dim - dim // 2)
    if d1 + d2 != dim:
        raise ValueError(f"{owner}: axial_pos_emb_dims={dims!r} must add up to the model's dim ({dim}), "
                         f"got {d1 + d2}")
    return AxialPositions((a, b), (d1, d2))
