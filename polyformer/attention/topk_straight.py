"""attn_sparse_topk_straight_through (x-transformers; arXiv:2505.22074): the forward keeps the top-k weights
(attn_sparse_topk), the backward takes the gradient of the full softmax over every kept key,
w = topk(s) + softmax(s) - stop_gradient(softmax(s))."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from ..precision import upcast
from .normalize import masked_softmax

if TYPE_CHECKING:
    from ..config import AttentionConfig


class StraightThrough(nn.Module):
    """(scores (b, h, i, j), keep-mask) -> the inner normaliser's weights, with softmax's gradient."""

    fusable = False

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        soft = masked_softmax(upcast(scores), mask)
        hard = upcast(self.inner(scores, mask))
        return (hard.detach() + (soft - soft.detach())).to(scores.dtype)


def wrap(normalize: nn.Module, cfg: "AttentionConfig") -> nn.Module:
    return StraightThrough(normalize) if cfg.topk_straight_through else normalize


def problems(cfg) -> list[str]:
    for a in cfg.self_attention:
        if not isinstance(a.topk_straight_through, bool):
            return [f"attn_sparse_topk_straight_through must be True or False, got {a.topk_straight_through!r}"]
        if a.topk_straight_through and a.normalize != "topk":
            return ["attn_sparse_topk_straight_through=True needs attn_sparse_topk=k (it passes the full softmax's "
                    "gradient through the top-k weights)"]
    return []

