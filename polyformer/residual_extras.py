"""The x-transformers residual / norm options on a built stack (its hooks in `stack.py` call these):
hyper-connections (hyper.py), LayerScale and its adaptive form (layerscale.py), adaptive norms read from
the forward's condition (conditioning.py), DyT's initial alpha (dyt.py), and pre_norm_has_final_norm."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from . import conditioning, dyt, feedforward_norm, hyper, layerscale, resi_dual, residual_scale
from .attention import head_scale, topk_straight
from .registry import NORM
from .conditioning import Conditioning, _Adaptive
from .dyt import DynamicTanh
from .hyper import HyperConnection, StreamRead, Streams
from .hyper_manifold import ManifoldHyperConnection

if TYPE_CHECKING:
    from .stack import AttentionLayers


def setup(stack: "AttentionLayers") -> None:
    """Rewire the stack's blocks for the options its config names (after the blocks and final norm exist)."""
    cfg = stack.cfg
    resi_dual.setup(stack, NORM[cfg.norm].build(cfg.dim, cfg.norm_eps) if NORM[cfg.norm].build else None)
    residual_scale.setup(stack)         # scale_residual (residual_scale.py)
    if not cfg.keep_final_norm:
        stack.final_norm = None
    for m in stack.modules():
        if isinstance(m, DynamicTanh):
            nn.init.constant_(m.alpha, float(cfg.dyt_alpha))
    stack.conditioning = None
    if cfg.condition is not None:
        stack.conditioning = Conditioning(cfg.condition.dim or cfg.dim, cfg.condition)
        for m in stack.modules():
            if isinstance(m, _Adaptive):
                m.bind(stack.conditioning)
    stack.streams = Streams(cfg.residual_streams) if cfg.residual_streams > 1 else None
    for block in stack.blocks:
        if stack.streams is not None:
            connection = (HyperConnection(cfg.dim, cfg.residual_streams, block.index) if cfg.streams_sinkhorn is None
                          else ManifoldHyperConnection(cfg.dim, cfg.residual_streams, cfg.streams_sinkhorn))
            block.combine = connection
            block.norm_in = StreamRead(connection, block.norm_in)
        if cfg.layerscale is not None and cfg.layerscale.adaptive:
            block.combine = layerscale.AdaptiveLayerScale(block.combine, cfg.dim, stack.conditioning.dim_in,
                                                          stack.conditioning)
        elif cfg.layerscale is not None:
            block.combine = layerscale.LayerScale(block.combine, cfg.dim, cfg.layerscale.init)


def enter(stack: "AttentionLayers", x: Tensor, condition: Tensor | None) -> Tensor:
    """Before the blocks: the condition to the modules that read it (checked), x to n streams if any."""
    c = stack.conditioning
    if c is None and condition is not None:
        raise ValueError("condition was given, but this stack reads none (use_adaptive_layernorm, "
                         "use_adaptive_rmsnorm or use_adaptive_layerscale with dim_condition)")
    if c is not None:
        if condition is None:
            raise ValueError("condition is required: use_adaptive_layernorm / use_adaptive_rmsnorm / "
                             "use_adaptive_layerscale scale the blocks by it")
        if (not isinstance(condition, Tensor) or not condition.is_floating_point() or condition.ndim not in (2, 3)
                or condition.shape[0] != x.shape[0] or condition.shape[-1] != c.dim_condition
                or (condition.ndim == 3 and condition.shape[1] not in (1, x.shape[1]))):
            got = tuple(condition.shape) if isinstance(condition, Tensor) else type(condition).__name__
            raise ValueError(f"condition must be a float tensor (batch={x.shape[0]}, dim_condition={c.dim_condition}) "
                             f"or (batch, {x.shape[1]} positions, dim_condition), got {got}")
        if condition.ndim == 3 and condition.shape[1] > 1 and stack.hourglass is not None:
            raise ValueError("condition per position cannot follow hourglass's shortened sequences: give one "
                             "(batch, dim_condition) per row")
        c.set(condition)
    resi_dual.enter(stack, x)           # the accumulating stream starts as x (resi_dual.py)
    return stack.streams.expand(x) if stack.streams is not None else x


def leave(stack: "AttentionLayers", x: Tensor) -> Tensor:
    """After the blocks: the n streams summed back to one (before the final norm)."""
    return resi_dual.leave(stack, stack.streams.reduce(x) if stack.streams is not None else x)


def release(stack: "AttentionLayers") -> None:
    """After the final norm: the condition let go (its graph is not held until the next forward)."""
    if stack.conditioning is not None:
        stack.conditioning.value = None


def problems(cfg) -> list[str]:
    """The options' own checks, each naming its keywords (run by rules.check)."""
    found = [p for piece in (residual_scale, hyper, layerscale, conditioning, dyt, feedforward_norm, head_scale,
                             topk_straight) for p in piece.problems(cfg)]      # resi_dual's: before reversible's (rules.py)
    if not isinstance(cfg.keep_final_norm, bool):
        found.append(f"pre_norm_has_final_norm must be True or False, got {cfg.keep_final_norm!r}")
    elif not cfg.keep_final_norm and cfg.placement == "post":
        found.append("pre_norm_has_final_norm=False: a post-norm stack (pre_norm=False) has no final norm to drop")
    return found
