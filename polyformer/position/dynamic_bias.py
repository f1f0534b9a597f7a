"""Dynamic position bias: a small MLP from the query-key offset to one bias per head, so the bias is a
continuous function of distance (SwinV2's continuous position bias, arXiv:2111.09883; x-transformers'
dynamic_pos_bias, with its log-spaced offsets sign(d) log(1 + |d|))."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .. import checks

if TYPE_CHECKING:
    from ..config import LayersConfig


@dataclass(frozen=True)
class DynamicBiasOptions:
    depth: int = 2                      # dynamic_pos_bias_mlp_depth: hidden layers of the MLP
    log_distance: bool = False          # dynamic_pos_bias_log_distance: offsets d -> sign(d) log(1 + |d|)
    norm: bool = False                  # dynamic_pos_bias_norm: a LayerNorm after each hidden linear


class DynamicPositionBias(nn.Module):
    """bias(h, i, j) = MLP(q_pos_i - k_pos_j)[h]: Linear(1, w), then `depth - 1` times Linear(w, w), each
    followed by [LayerNorm] and SiLU, then Linear(w, heads); w = dim // 4. One per stack, as T5's bias."""

    def __init__(self, dim: int, heads: int, options: DynamicBiasOptions | None = None):
        super().__init__()
        options = options or DynamicBiasOptions()
        width = max(dim // 4, 1)
        layers: list[nn.Module] = []
        for index in range(options.depth):
            layers.append(nn.Linear(1 if index == 0 else width, width))
            if options.norm:
                layers.append(nn.LayerNorm(width))
            layers.append(nn.SiLU())
        layers.append(nn.Linear(width, heads))
        self.mlp = nn.Sequential(*layers)
        self.log_distance = options.log_distance

    def table(self, offsets: Tensor) -> Tensor:
        """(u,) integer offsets q_pos - k_pos -> (u, heads) biases."""
        d = offsets.to(self.mlp[0].weight.dtype)[:, None]
        if self.log_distance:
            d = torch.sign(d) * torch.log1p(d.abs())
        return self.mlp(d)

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        offsets, where = torch.unique(q_pos[..., :, None] - k_pos[..., None, :], return_inverse=True)   # (b|1, i, j)
        return self.table(offsets)[where].movedim(-1, -3)                                       # (b|1, h, i, j)

    def aligned(self, q_pos: Tensor, k_pos: Tensor, heads: Tensor) -> Tensor:
        """As `AlibiBias.aligned`: (..., H, G, i), (..., H, G, j) -> (..., len(heads), G, i, j)."""
        offsets, where = torch.unique(q_pos[..., :, None] - k_pos[..., None, :], return_inverse=True)
        table = self.table(offsets).t()[heads]                                                 # (hp, u)
        return table[torch.arange(len(heads), device=where.device).view(-1, 1, 1, 1), where]


def problems(cfg: "LayersConfig") -> list[str]:
    """dynamic_pos_bias's out-of-range options, by keyword."""
    o = cfg.dynamic_pos_bias
    if o is None:
        return []
    found = checks.whole(o.depth, "dynamic_pos_bias_mlp_depth")
    found += checks.flag(o.log_distance, "dynamic_pos_bias_log_distance") + checks.flag(o.norm, "dynamic_pos_bias_norm")
    if cfg.attention.bias != "dynamic":
        found.append("dynamic_pos_bias options need dynamic_pos_bias=True")
    return found
