"""Norms modulated by a condition (use_adaptive_layernorm / use_adaptive_rmsnorm with dim_condition), as
DiT's adaLN (arXiv:2212.09748) in x-transformers' form: norm(x) * (1 + W c), W zero at start so that the
norm begins as the plain one. c is the stack's forward argument `condition`: (b, dim_c) for every position
or (b, i, dim_c) per position; with adaptive_condition_mlp it first goes through Linear -> SiLU (widened
adaptive_condition_mlp_expansion times).

The stack hands the condition to its `Conditioning` once per forward (`residual_extras.enter`); the norms
and adaptive layerscales read it from there, so blocks keep their one-tensor norm call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .norm import rms_normalized
from .precision import upcast


@dataclass(frozen=True)
class ConditionOptions:
    dim: int | None = None      # dim_condition: the condition's feature size; None: the stack's dim
    mlp: bool = False           # adaptive_condition_mlp: Linear -> SiLU on the condition first
    mlp_expansion: int = 4      # adaptive_condition_mlp_expansion: that Linear's widening


class Conditioning(nn.Module):
    """Holds this forward's condition, (b, 1 | i, dim_in), for the modules that read it."""

    def __init__(self, dim_condition: int, options: ConditionOptions):
        super().__init__()
        self.dim_condition = dim_condition
        wide = dim_condition * options.mlp_expansion
        self.mlp = nn.Sequential(nn.Linear(dim_condition, wide, bias=False), nn.SiLU()) if options.mlp else None
        self.dim_in = wide if options.mlp else dim_condition
        self.value: Tensor | None = None

    def set(self, condition: Tensor) -> None:
        c = condition.unsqueeze(1) if condition.ndim == 2 else condition
        self.value = self.mlp(c) if self.mlp is not None else c

    def current(self, dtype: torch.dtype) -> Tensor:
        """The condition in `dtype` (the reading module's weights')."""
        if self.value is None:
            raise ValueError("condition: this stack's adaptive norms / layerscale need the forward's condition")
        return self.value.to(dtype)


class _Adaptive(nn.Module):
    """A norm scaled by (1 + W c); W (dim_c -> dim) is made when the stack binds it to its Conditioning."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.to_gamma: nn.Linear | None = None
        self._source: tuple[Conditioning, ...] = ()

    def bind(self, source: Conditioning) -> None:
        self.to_gamma = nn.Linear(source.dim_in, self.dim, bias=False)
        nn.init.zeros_(self.to_gamma.weight)
        self._source = (source,)

    def gamma(self, x: Tensor) -> Tensor:
        if not self._source:
            raise ValueError(f"{type(self).__name__} is only usable inside the stack that built it (it reads the "
                             "stack's condition); post_emb_norm=True cannot use use_adaptive_layernorm / _rmsnorm")
        return 1.0 + self.to_gamma(self._source[0].current(self.to_gamma.weight.dtype)).to(x.dtype)


class AdaptiveLayerNorm(_Adaptive):
    """LayerNorm(x) without its own affine, times (1 + W c)."""

    def forward(self, x: Tensor) -> Tensor:
        x32 = upcast(x)
        out = F.layer_norm(x32, (self.dim,), eps=self.eps) * self.gamma(x32)
        return out.to(x.dtype)


class AdaptiveRMSNorm(_Adaptive):
    """x / rms(x), times (1 + W c)."""

    def forward(self, x: Tensor) -> Tensor:
        x32 = upcast(x)
        out = rms_normalized(x32, self.eps) * self.gamma(x32)
        return out.to(x.dtype)


def problems(cfg) -> list[str]:
    o = cfg.condition
    if o is None:
        return []
    found = []
    if o.dim is not None and (isinstance(o.dim, bool) or not isinstance(o.dim, int) or o.dim < 1):
        found.append(f"dim_condition must be a positive integer, got {o.dim!r}")
    if not isinstance(o.mlp, bool):
        found.append(f"adaptive_condition_mlp must be True or False, got {o.mlp!r}")
    if isinstance(o.mlp_expansion, bool) or not isinstance(o.mlp_expansion, int) or o.mlp_expansion < 1:
        found.append(f"adaptive_condition_mlp_expansion must be a positive integer, got {o.mlp_expansion!r}")
    elif o.mlp_expansion != 4 and not o.mlp:
        found.append("adaptive_condition_mlp_expansion widens adaptive_condition_mlp, which is not True")
    named = [k for k, on in (("use_adaptive_layernorm", cfg.norm == "adaptive_layer"),
                             ("use_adaptive_rmsnorm", cfg.norm == "adaptive_rms"),
                             ("use_adaptive_layerscale", cfg.layerscale is not None and cfg.layerscale.adaptive)) if on]
    for on, keyword in ((cfg.gradient_checkpointing, "gradient_checkpointing=True"), (cfg.reversible, "reversible=True")):
        if on:
            found.append(f"{' / '.join(named)} read(s) the forward's condition, and {keyword} recomputes blocks in the "
                         "backward, after a later forward may have replaced it: choose one")
    if cfg.act is not None:
        found.append(f"{' / '.join(named)} read(s) the whole batch's condition, and act=True runs the rows still "
                     "pondering on their own: choose one")
    return found
