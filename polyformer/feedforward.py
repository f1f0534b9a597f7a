"""Position-wise feedforward: GELU / ReLU / ReLU^2 (arXiv:2109.08668) / Swish, GLU variants (arXiv:2002.05202)."""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from .config import FeedForwardConfig


class ReluSquared(nn.Module):
    """relu(x)^2, from Primer (arXiv:2109.08668)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x).square()


class GeluTanh(nn.GELU):
    def __init__(self) -> None:
        super().__init__(approximate="tanh")


class FeedForward(nn.Module):
    """Linear -> activation (optionally gated: a * act(b)) -> dropout -> Linear."""

    def __init__(self, dim: int, cfg: FeedForwardConfig, dim_out: int | None = None):
        super().__init__()
        from .registry import ACTIVATION

        inner = int(dim * cfg.mult)
        self.glu = cfg.glu
        self.proj_in = nn.Linear(dim, inner * (2 if cfg.glu else 1), bias=cfg.bias)
        self.act = ACTIVATION[cfg.activation]()
        self.dropout = nn.Dropout(cfg.dropout)
        self.proj_out = nn.Linear(inner, dim_out or dim, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.compute(x, self.proj_in, self.act, self.proj_out, self.glu, self.dropout)

    @staticmethod
    def compute(x: Tensor, proj_in: Callable, act: Callable, proj_out: Callable, glu: bool,
                dropout: Callable | None = None) -> Tensor:
        """The feedforward over given stages (the fast decode step passes them resolved)."""
        h = proj_in(x)
        if glu:
            h, gate = h.chunk(2, dim=-1)
            h = h * act(gate)
        else:
            h = act(h)
        return proj_out(dropout(h) if dropout is not None else h)
