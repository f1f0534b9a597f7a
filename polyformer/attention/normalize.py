"""Score normalisers: softmax, explicit top-k sparse softmax (arXiv:1912.11637), entmax-1.5
(arXiv:1909.00015). Masked keys get weight zero; a query that may see no key gets all zeros."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..precision import upcast


def fill_masked(scores: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return scores
    return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)


def zero_masked(weights: Tensor, mask: Tensor | None) -> Tensor:
    return weights if mask is None else weights * mask


def masked_softmax(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Softmax over the last dim with keep-mask `mask` (broadcastable bool); a row keeping nothing is 0."""
    return zero_masked(fill_masked(scores, mask).softmax(dim=-1), mask)


class Softmax(nn.Module):
    fusable = True      # scaled_dot_product_attention computes exactly this
    def forward(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        return masked_softmax(upcast(scores), mask).to(scores.dtype)


class TopK(nn.Module):
    """Keep the k largest scores of each row, softmax over them; the rest get weight zero."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        s = fill_masked(upcast(scores), mask)
        if self.k < s.shape[-1]:
            kth = s.topk(self.k, dim=-1).values[..., -1:]
            keep = s >= kth
            mask = keep if mask is None else keep & mask
        weights = fill_masked(s, mask).softmax(dim=-1)
        return zero_masked(weights, mask).to(scores.dtype)


class Entmax15(nn.Module):
    """entmax with alpha = 1.5: sparse weights that sum to one (the `entmax` package)."""

    def forward(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        from entmax import entmax15

        if scores.shape[-1] == 0:          # no keys at all (an empty context): entmax cannot reduce over them
            return scores
        weights = entmax15(fill_masked(upcast(scores), mask), dim=-1)
        return zero_masked(weights, mask).to(scores.dtype)
