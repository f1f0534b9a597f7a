"""Norms: LayerNorm, RMSNorm (arXiv:1910.07467), RMSNorm without a gain (use_simple_rmsnorm) and ScaleNorm
(arXiv:1910.05895)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .precision import upcast


def rms_normalized(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x ** 2) + eps) over the last dimension (x already in the precision to compute in)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in at least float32 (arXiv:1910.07467)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = upcast(x)
        return (rms_normalized(x32, self.eps) * self.weight.to(x32.dtype)).to(x.dtype)


class SimpleRMSNorm(nn.Module):
    """x / rms(x) without a gain, i.e. l2norm(x) * sqrt(dim) (use_simple_rmsnorm; a linear attention paper,
    arXiv:2307.14995, found RMSNorm's learned gain unnecessary); no parameters."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_normalized(upcast(x), self.eps).to(x.dtype)


class ScaleNorm(nn.Module):
    """g * x / ||x|| with one learned scalar g, initialised to sqrt(dim) (arXiv:1910.05895)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(dim)))

    def forward(self, x: Tensor) -> Tensor:
        x32 = upcast(x)
        norm = x32.norm(dim=-1, keepdim=True).clamp(min=self.eps)
        return (x32 / norm * self.g.to(x32.dtype)).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm that keeps the input dtype under autocast (computed in at least float32)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float32, torch.float64) and (self.weight is None or self.weight.dtype == x.dtype):
            return super().forward(x)
        x32 = upcast(x)
        weight = self.weight.to(x32.dtype) if self.weight is not None else None    # half weights too (model.half())
        bias = self.bias.to(x32.dtype) if self.bias is not None else None
        return F.layer_norm(x32, self.normalized_shape, weight, bias, self.eps).to(x.dtype)
