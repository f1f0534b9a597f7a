"""x-transformers' scale_residual: the residual stream learns a per-feature scale s (init 1) before the branch
output joins it, out = combine(s * c * x, y) with c = scale_residual_constant; a number given as scale_residual
also scales the branch output y by it (x-transformers does both for a number)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from . import checks
from .routes import Route

if TYPE_CHECKING:
    from .config import LayersConfig
    from .stack import AttentionLayers


@dataclass(frozen=True)
class ResidualScaleOptions:
    learned: bool = False               # scale_residual: a learned per-feature scale of the stream, init 1
    branch: float = 1.0                 # scale_residual=<number>: the branch output times this number
    constant: float = 1.0               # scale_residual_constant: the stream times this number


@dataclass(frozen=True)
class ScaleRoute(Route):
    """Writes the options and one field of them, so either keyword switches the section on;
    scale_residual takes True / False or a number (then learned and the branch factor)."""

    def writes(self, arg: Any) -> dict[str, Any]:
        if self.path == "residual_scale.learned":
            if arg is False:
                return {}
            if arg is True:
                return {"residual_scale": ResidualScaleOptions(), self.path: True}
            if not checks.number(arg):
                raise TypeError(f"expected True, False or a number, got {arg!r}")
            return {"residual_scale": ResidualScaleOptions(), self.path: True, "residual_scale.branch": arg}
        return {"residual_scale": ResidualScaleOptions(), **super().writes(arg)}


class ScaledResidual(nn.Module):
    """combine(s * c * x, y): the stream x (b, n, dim) scaled per feature before the block's residual policy."""

    def __init__(self, combine: nn.Module, dim: int, learned: bool, constant: float):
        super().__init__()
        self.combine = combine
        self.scale = nn.Parameter(torch.ones(dim)) if learned else None
        self.constant = constant

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        if self.scale is not None:
            x = x * self.scale.to(x.dtype)
        if self.constant != 1.0:
            x = x * self.constant
        return self.combine(x, y)


def setup(stack: "AttentionLayers") -> None:
    """Every block's residual policy behind the stream's scale; a number's factor into the block's branch scale."""
    o = stack.cfg.residual_scale
    if o is None:
        return
    for block in stack.blocks:
        block.combine = ScaledResidual(block.combine, stack.cfg.dim, o.learned, float(o.constant))
        block.scale = block.scale * float(o.branch)


def problems(cfg: "LayersConfig") -> list[str]:
    o = cfg.residual_scale
    if o is None:
        return []
    found = [f"{name} must be a finite number > 0, got {value!r}"
             for name, value in (("scale_residual", o.branch), ("scale_residual_constant", o.constant))
             if not checks.number(value) or value <= 0]
    if not found and cfg.residual_streams > 1:
        found.append("scale_residual and num_residual_streams > 1 conflict: hyper-connections mix the streams "
                     "with their own learned weights; choose one")
    if not found and cfg.residual == "deepnorm":
        found.append("scale_residual and deepnorm conflict: DeepNet fixes the stream's scale alpha; choose one")
    return found
