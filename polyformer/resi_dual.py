"""ResiDual (arXiv:2304.14802): Post-LN blocks, x_{k+1} = LN(x_k + f_k(x_k)), and beside them a Pre-LN-like stream
that only accumulates, d_0 = x_0, d_{k+1} = d_k + f_k(x_k); the stack's output is x_N + LN(d_N). resi_dual_scale s
multiplies d_0 and every f_k added to d (the paper's fp16 remedy: LN(s d) = LN(d) up to eps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor, nn

from . import checks

if TYPE_CHECKING:
    from .config import LayersConfig
    from .stack import AttentionLayers


@dataclass(frozen=True)
class ResiDualOptions:
    scale: float = 1.0                  # resi_dual_scale


class DualStream(nn.Module):
    """The accumulating stream d of one forward and the norm it leaves through."""

    def __init__(self, norm: nn.Module | None, scale: float):
        super().__init__()
        self.norm = norm
        self.scale = scale
        self.d: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        """x_N (b, n, dim) -> x_N + LN(d_N); the stream is let go."""
        d, self.d = self.d, None
        return x + (self.norm(d) if self.norm is not None else d)


class DualTap(nn.Module):
    """A block's residual policy that also adds the branch output y (b, n, dim) to the dual stream."""

    def __init__(self, combine: nn.Module, stream: DualStream):
        super().__init__()
        self.combine = combine
        self._stream = (stream,)        # the stack's, registered once there

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        stream = self._stream[0]
        if stream.d is not None:        # None: a checkpointed block recomputed in the backward
            stream.d = stream.d + y * stream.scale
        return self.combine(x, y)


def setup(stack: "AttentionLayers", norm: nn.Module | None) -> None:
    o = stack.cfg.resi_dual
    stack.resi_dual = None
    if o is None:
        return
    stack.resi_dual = DualStream(norm, float(o.scale))
    for block in stack.blocks:
        block.combine = DualTap(block.combine, stack.resi_dual)


def enter(stack: "AttentionLayers", x: Tensor) -> None:
    if stack.resi_dual is not None:
        stack.resi_dual.d = x * stack.resi_dual.scale


def leave(stack: "AttentionLayers", x: Tensor) -> Tensor:
    return stack.resi_dual(x) if stack.resi_dual is not None else x


def problems(cfg: "LayersConfig") -> list[str]:
    o = cfg.resi_dual
    if o is None:
        return []
    if not checks.number(o.scale) or o.scale <= 0:
        return [f"resi_dual_scale must be a finite number > 0, got {o.scale!r}"]
    if cfg.placement != "post":
        return ["resi_dual=True runs Post-LN blocks beside its accumulating stream: it cannot combine with "
                "sandwich_norm (pre_norm is set for you)"]
    clash = [name for name, on in (("reversible", cfg.reversible), ("hourglass", cfg.hourglass is not None),
                                   ("exit_layers", cfg.early_exit is not None),
                                   ("num_residual_streams > 1", cfg.residual_streams > 1),
                                   ("deepnorm", cfg.residual == "deepnorm")) if on]
    if clash:
        return [f"resi_dual and {clash[0]} conflict: each decides how the blocks' outputs form the stream; choose one"]
    return []
