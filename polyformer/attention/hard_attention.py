"""Two normalisers of x-transformers 2.x that pick keys (registry.NORMALIZE "hard", "gumbel").

`HardMax` (attn_hard): each query attends to the single key of largest score (a one-hot row), and the
backward takes the gradient of the softmax, w = onehot(argmax s) + softmax(s) - stop_gradient(softmax(s)).

`GumbelSoftmax` (attn_gumbel_softmax; Jang et al., arXiv:1611.01144): a draw y = softmax((s + g) / tau) with
g ~ Gumbel(0, 1) per score; with `hard` the row is onehot(argmax y) with y's gradient. By the Gumbel-max
trick the chosen key is distributed as softmax(s), whatever tau. As x-transformers does, it draws in every
forward, eval included; a decode step draws for its new query rows only (earlier rows keep their draws).

Masked keys get weight zero; a query that may see no key gets all zeros."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .. import checks
from ..precision import upcast
from .normalize import fill_masked, masked_softmax, zero_masked

if TYPE_CHECKING:
    from ..config import LayersConfig

# the keyword that chose each normaliser, for messages (registry.NORMALIZE's names)
KEYWORDS = {"softmax": "softmax", "topk": "attn_sparse_topk", "entmax15": "attn_use_entmax15",
            "hard": "attn_hard", "gumbel": "attn_gumbel_softmax"}


def keyword(normalize: str) -> str:
    return KEYWORDS.get(normalize, normalize)


@dataclass(frozen=True)
class GumbelOptions:
    temp: float = 1.0       # attn_gumbel_softmax_temp: tau
    hard: bool = True       # attn_gumbel_softmax_hard: one-hot forward, the soft draw's gradient


def gumbel_noise(like: Tensor) -> Tensor:
    """Standard Gumbel draws g = -log(e), e ~ Exp(1), of `like`'s shape and dtype (the draws of
    F.gumbel_softmax for the same seed, which a test holds)."""
    return torch.empty_like(like).exponential_().log().neg()


def one_hot_straight(soft: Tensor, scores: Tensor, mask: Tensor | None) -> Tensor:
    """onehot(argmax scores) among the kept keys in the forward, `soft`'s gradient in the backward."""
    if scores.shape[-1] == 0:               # no key at all (an empty context): no weight to place
        return soft
    index = fill_masked(scores, mask).argmax(dim=-1, keepdim=True)
    hot = zero_masked(torch.zeros_like(soft).scatter(-1, index, 1.0), mask)
    return hot + (soft - soft.detach())      # exactly one-hot: the bracket is zero


class HardMax(nn.Module):
    """(scores (b, h, i, j), keep-mask) -> one-hot rows on the largest score, softmax's gradient."""

    def forward(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        s = upcast(scores)
        return one_hot_straight(masked_softmax(s, mask), s, mask).to(scores.dtype)


class GumbelSoftmax(nn.Module):
    """(scores (b, h, i, j), keep-mask) -> a Gumbel-softmax draw per row (one-hot with `hard`)."""

    def __init__(self, options: GumbelOptions = GumbelOptions()):
        super().__init__()
        self.tau, self.hard = options.temp, options.hard

    def forward(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        s = upcast(scores)
        noisy = (s + gumbel_noise(s)) / self.tau
        soft = masked_softmax(noisy, mask)
        out = one_hot_straight(soft, noisy, mask) if self.hard else soft
        return out.to(scores.dtype)


def problems(cfg: "LayersConfig") -> list[str]:
    """attn_gumbel_softmax's options, by keyword."""
    found = []
    for a in cfg.self_attention:
        g = a.gumbel
        if g is None:
            continue
        if not checks.number(g.temp) or g.temp <= 0:
            found.append(f"attn_gumbel_softmax_temp must be a number > 0, got {g.temp!r}")
        found += checks.flag(g.hard, "attn_gumbel_softmax_hard")
    return found
