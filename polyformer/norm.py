"""Norms: LayerNorm, RMSNorm (arXiv:1910.07467) and ScaleNorm (arXiv:1910.05895)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in float32 (arXiv:1910.07467)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).to(x.dtype)


class ScaleNorm(nn.Module):
    """g * x / ||x|| with one learned scalar g, initialised to sqrt(dim) (arXiv:1910.05895)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(dim)))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        norm = x32.norm(dim=-1, keepdim=True).clamp(min=self.eps)
        return (x32 / norm * self.g.float()).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm that keeps the input dtype under autocast (computed in float32)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        weight = self.weight.float() if self.weight is not None else None    # half weights too (model.half())
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)
