"""RMSNorm without a gain (use_simple_rmsnorm): x / rms(x), i.e. l2norm(x) * sqrt(dim); a linear attention
paper (arXiv:2307.14995) found the learned gamma of RMSNorm (arXiv:1910.07467) unnecessary."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .precision import upcast


class SimpleRMSNorm(nn.Module):
    """x / sqrt(mean(x ** 2) + eps), computed in at least float32; no parameters."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = upcast(x)
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
