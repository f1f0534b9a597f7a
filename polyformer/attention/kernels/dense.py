"""The dense attention kernel: an explicit reference path and a fused path, side by side. The fused
path runs `scaled_dot_product_attention`, or, for float32 on the CPU without mask or bias, our own
compiled kernel (`cpu.py`). The reference is what every fast path and every other kernel is tested
against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...autodiff import needs_reference
from ...interfaces import KV, AttnOut, Caps, KernelSpec
from ...precision import upcast
from ..mixing import TalkingHeads
from . import cpu



def additive(keep: Tensor | None, bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The keep-mask and score bias folded into SDPA's one mask: the bias in `dtype` with -inf where
    keep is False; the keep-mask alone without a bias."""
    if bias is None:
        return keep
    mask = bias.to(dtype)
    return mask.masked_fill(~keep, float("-inf")) if keep is not None else mask

def match_heads(t: Tensor, heads: int) -> Tensor:
    """(b, hk, j, d) -> (b, heads, j, d): each kv head serves heads // hk query heads in a row."""
    hk = t.shape[1]
    if hk == heads:
        return t
    if hk == 1:
        return t.expand(-1, heads, -1, -1)
    return t.repeat_interleave(heads // hk, dim=1)


def causal_keep(i: int, j: int, device: torch.device) -> Tensor:
    """Top-left aligned causal pattern (i, j), the one `is_causal=True` means."""
    return torch.ones(i, j, dtype=torch.bool, device=device).tril()


class DenseKernel(nn.Module):
    """Full L x L attention.

    Args of forward: q (b, h, i, d); kv.k (b, hk, j, d); kv.v (b, hk, j, dv); mask (b|1, 1|h, i, j)
    bool keep or None; bias (b|1, h, i, j) additive or None; causal: additionally apply the top-left
    causal pattern (requires i == j); prev_scores: residual attention scores to add (b, h, i, j).
    """

    caps = Caps(exact=True, bias=True, fused=True, decode="keys", cross=True)

    def __init__(self, heads: int, scale: float, dropout: float, normalize: nn.Module,
                 pre_mix: nn.Module | None = None, post_mix: nn.Module | None = None,
                 fused: bool | None = None, keep_scores: bool = False):
        super().__init__()
        self.heads = heads
        self.scale = scale
        self.normalize = normalize
        self.pre_mix = pre_mix
        self.post_mix = post_mix
        self.dropout = nn.Dropout(dropout)
        self.keep_scores = keep_scores
        self.can_fuse = (fused is not False and getattr(normalize, "fusable", False)
                         and pre_mix is None and post_mix is None and not keep_scores)

    @classmethod
    def from_spec(cls, spec: KernelSpec) -> "DenseKernel":
        return cls(spec.heads, spec.scale, spec.dropout, spec.normalize,
                   pre_mix=TalkingHeads(spec.heads) if spec.talking_heads else None,
                   post_mix=TalkingHeads(spec.heads) if spec.talking_heads else None,
                   fused=spec.fused, keep_scores=spec.keep_scores)

    def forward(self, q: Tensor, kv: KV, *, mask: Tensor | None, bias: Tensor | None,
                causal: bool, prev_scores: Tensor | None = None, need_weights: bool = False) -> AttnOut:
        h = q.shape[1]
        # forward mode and nested torch.func reverse mode take the reference path: no fused kernel has
        # those derivatives (autodiff.needs_reference)
        if (self.can_fuse and prev_scores is None and not need_weights
                and not needs_reference(q, kv.k, kv.v, bias)):
            if kv.k.shape[1] == kv.v.shape[1]:      # grouped heads: SDPA reads each kv head in place
                return AttnOut(self.fused(q, kv.k, kv.v, mask, bias, causal, gqa=kv.k.shape[1] != h))
            return AttnOut(self.fused(q, match_heads(kv.k, h), match_heads(kv.v, h), mask, bias, causal))
        return self.reference(q, match_heads(kv.k, h), match_heads(kv.v, h), mask, bias, causal,
                              prev_scores, need_weights)

    def fused(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None,
              causal: bool, gqa: bool = False) -> Tensor:
        p = self.dropout.p if self.training else 0.0
        if cpu.applies(q, k, v, mask, bias, p):         # float32 on the CPU: our own kernel (reads
            return cpu.attention(q, k, v, self.scale, causal)   # grouped kv heads in place)
        if causal and (mask is not None or bias is not None):
            keep = causal_keep(q.shape[-2], k.shape[-2], q.device)
            mask = keep if mask is None else mask & keep
            causal = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive(mask, bias, q.dtype), dropout_p=p,
                                              is_causal=causal, scale=self.scale, enable_gqa=gqa)

    def reference(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None,
                  causal: bool, prev_scores: Tensor | None, need_weights: bool) -> AttnOut:
        # scores and weights in at least float32 (autocast off): a half-precision q.k overflows to inf
        # and the softmax turns it into NaN, where the fused kernel accumulates in float32
        with torch.autocast(q.device.type, enabled=False):
            scores = torch.einsum("bhid,bhjd->bhij", upcast(q), upcast(k)) * self.scale
            if bias is not None:
                scores = scores + bias.to(scores.dtype)
            if prev_scores is not None:
                scores = scores + prev_scores.to(scores.dtype)
            if self.pre_mix is not None:
                scores = self.pre_mix(scores)
            if causal:
                keep = causal_keep(q.shape[-2], k.shape[-2], q.device)
                mask = keep if mask is None else mask & keep
            weights = self.normalize(scores, mask)
            if self.post_mix is not None:
                weights = self.post_mix(weights)
        out = torch.einsum("bhij,bhjd->bhid", self.dropout(weights).to(v.dtype), v)
        return AttnOut(out, scores=scores if self.keep_scores else None,
                       weights=weights.to(q.dtype) if need_weights else None)
