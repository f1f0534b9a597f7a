"""How a branch joins the residual stream: add, ReZero (arXiv:2003.04887), DeepNorm's alpha * x + y
(arXiv:2203.00555), GRU gate (arXiv:1910.06764)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Add(nn.Module):
    def __init__(self, dim: int):
        super().__init__()

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return x + y


class ReZero(nn.Module):
    """x + g * y with one scalar g initialised at zero, so each block starts as the identity."""

    def __init__(self, dim: int):
        super().__init__()
        self.g = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return x + self.g * y


class ScaledAdd(nn.Module):
    """alpha * x + y: DeepNorm's residual (arXiv:2203.00555), the stream up-weighted so that each
    post-LN block moves it less. alpha comes from the stack's depth (deepnet.setup writes it)."""

    def __init__(self, dim: int, alpha: float = 1.0):
        super().__init__()
        self.alpha = alpha

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return x * self.alpha + y


class GRUGate(nn.Module):
    """GTrXL gating of stream x by branch output y (arXiv:1910.06764, eq. for g(x, y)):

    r = s(W_r y + U_r x), z = s(W_z y + U_z x - b_g), h = tanh(W_g y + U_g (r * x)),
    out = (1 - z) * x + z * h.  b_g > 0 makes every block start close to the identity.
    """

    def __init__(self, dim: int, gate_bias: float = 2.0):
        super().__init__()
        self.w = nn.Linear(dim, 3 * dim, bias=False)        # W_r, W_z, W_g on y
        self.u = nn.Linear(dim, 2 * dim, bias=False)        # U_r, U_z on x
        self.u_g = nn.Linear(dim, dim, bias=False)
        self.gate_bias = gate_bias

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        wr, wz, wg = self.w(y).chunk(3, dim=-1)
        ur, uz = self.u(x).chunk(2, dim=-1)
        r = torch.sigmoid(wr + ur)
        z = torch.sigmoid(wz + uz - self.gate_bias)
        h = torch.tanh(wg + self.u_g(r * x))
        return (1 - z) * x + z * h
