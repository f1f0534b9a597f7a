"""Dynamic Tanh (DyT, arXiv:2503.10622): gamma * tanh(alpha x) + beta in place of a norm, alpha one
learned scalar (initial value dynamic_tanh_init_alpha), gamma and beta per feature."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class DynamicTanh(nn.Module):
    """Element-wise, no statistics over the features: (..., dim) -> (..., dim)."""

    def __init__(self, dim: int, eps: float = 1e-5, alpha: float = 1.0):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha)))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.alpha.to(x.dtype) * x) * self.weight.to(x.dtype) + self.bias.to(x.dtype)


def problems(cfg) -> list[str]:
    a = cfg.dyt_alpha
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0:
        return [f"dynamic_tanh_init_alpha must be a number > 0, got {a!r}"]
    if cfg.norm != "dyt" and a != 1.0:
        return ["dynamic_tanh_init_alpha is set but use_dynamic_tanh is not True"]
    if cfg.norm == "dyt" and cfg.norm_eps != 1e-5:
        return [f"norm_eps={cfg.norm_eps} has no role in use_dynamic_tanh=True (tanh needs no epsilon)"]
    return []
