"""NormFormer's head scale (attn_head_scale, arXiv:2110.09456): each head's output is multiplied by a learned
scalar gamma_h (init 1) before the heads are gated, merged and projected."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import AttentionConfig


class HeadScale(nn.Module):
    """out (b, h, n, dv) * gamma (h,), then the block's output stage."""

    def __init__(self, output: nn.Module, heads: int):
        super().__init__()
        self.output = output
        self.gamma = nn.Parameter(torch.ones(heads))

    def forward(self, out: Tensor, x: Tensor) -> Tensor:
        return self.output(out * self.gamma.to(out.dtype)[:, None, None], x)


def wrap(output: nn.Module, cfg: AttentionConfig) -> nn.Module:
    return HeadScale(output, cfg.heads) if cfg.head_scale else output


def problems(cfg) -> list[str]:
    for a in cfg.self_attention:
        if not isinstance(a.head_scale, bool):
            return [f"attn_head_scale must be True or False, got {a.head_scale!r}"]
        if a.head_scale and cfg.mixer is not None:
            from .kernels.direct import switch

            return [f"attn_head_scale scales attention heads; {switch('mixer.', cfg.mixer.name)} replaces attention"]
    return []
