"""LayerScale (CaiT, arXiv:2103.17239): x + diag(lambda) f(x), a learned per-feature scale on each branch
initialised small; and its adaptive form (use_adaptive_layerscale), the scale regressed from a condition
as DiT's adaLN-Zero gate (arXiv:2212.09748): x + sigmoid(W c + b) * f(x), W = 0 and b = -2 at start.

Both wrap a block's residual (`Block.combine`), so they scale the branch output last, after a sandwich
norm (x-transformers scales before it, where the norm would undo a small start).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class LayerScaleOptions:
    init: float = 0.0           # layerscale_init_value: lambda's initial value (x-transformers' default 0)
    adaptive: bool = False      # use_adaptive_layerscale: sigmoid(W c + b) from the forward's condition


class LayerScale(nn.Module):
    """combine(x, lambda * y), lambda (dim,) learned."""

    def __init__(self, combine: nn.Module, dim: int, init: float):
        super().__init__()
        self.inner = combine
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.inner(x, y * self.gamma.to(y.dtype))


class AdaptiveLayerScale(nn.Module):
    """combine(x, sigmoid(W c + b) * y) with the condition c the stack was called with (conditioning.py);
    c (b, dim_c) for every position or (b, i, dim_c) per position."""

    def __init__(self, combine: nn.Module, dim: int, dim_condition: int, source: nn.Module, init_bias: float = -2.0):
        super().__init__()
        self.inner = combine
        self.to_gate = nn.Linear(dim_condition, dim)
        nn.init.zeros_(self.to_gate.weight)
        nn.init.constant_(self.to_gate.bias, init_bias)
        self._source = (source,)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        gate = torch.sigmoid(self.to_gate(self._source[0].current(self.to_gate.weight.dtype)))
        return self.inner(x, y * gate.to(y.dtype))


def problems(cfg) -> list[str]:
    o = cfg.layerscale
    if o is None:
        return []
    if not isinstance(o.init, (int, float)) or isinstance(o.init, bool):
        return [f"layerscale_init_value must be a number, got {o.init!r}"]
    if not isinstance(o.adaptive, bool):
        return [f"use_adaptive_layerscale must be True or False, got {o.adaptive!r}"]
    if o.adaptive and o.init != 0.0:
        return ["layerscale_init_value sets use_layerscale's lambda; use_adaptive_layerscale starts its gate at "
                "sigmoid(-2) from the condition: choose one"]
    return []
