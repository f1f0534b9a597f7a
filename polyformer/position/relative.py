"""The relative-position stage: q-dependent score terms of query-key distances (Shaw et al. 2018,
position/shaw.py; Transformer-XL, position/xl_relative.py), chosen by `AttentionConfig.relative`.

A scheme turns (q, keys, positions) into an additive score bias (b, h, i, j) that the dense kernel
takes on either path (the fused SDPA path accepts a float bias); a scheme whose output also reads
the weights (Shaw's value term) asks the dense kernel for them, which takes its reference path.
Keys without a position (memory key / values, `kv.free`) get no positional term.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..config import BIAS_KEYWORD, AttentionConfig, LayersConfig
from ..interfaces import KV, AttnOut

KEYWORDS = {"shaw": "rel_pos_shaw", "xl": "rel_pos_xl", "cope": "attn_use_cope"}


class RelativeStage(nn.Module):
    """Base of a relative scheme: `terms` gives the scaled score bias of the positioned keys;
    `values` (when `reads_weights`) adds the scheme's term to the output from the weights."""

    reads_weights = False

    @staticmethod
    def shared(options: object, heads: int, dim_head: int) -> nn.Module | None:
        """What the stack holds once for every block of this scheme (Transformer-XL's shared u, v), or None."""
        return None

    @staticmethod
    def check(options: object, cfg: LayersConfig) -> list[str]:
        """The scheme's own problems with its options, naming the keywords."""
        return []

    def terms(self, q: Tensor, kv: KV, q_pos: Tensor, scale: float) -> Tensor:
        """q (b, h, i, d), kv.k (b, hk, j, d) -> the bias (b, h, i, j), the free keys' columns included."""
        raise NotImplementedError

    def values(self, weights: Tensor, kv: KV, q_pos: Tensor) -> Tensor:
        """weights (b, h, i, j) -> the scheme's addition to the output (b, h, i, dv)."""
        raise NotImplementedError

    def forward(self, kernel: nn.Module, q_pos: Tensor, q: Tensor, kv: KV, *, mask: Tensor | None,
                bias: Tensor | None, causal: bool, prev_scores: Tensor | None, need_weights: bool) -> AttnOut:
        """The dense `kernel` with this scheme's terms added to `bias` (and to the output)."""
        extra = self.terms(q, kv, q_pos, kernel.scale)
        bias = extra if bias is None else bias + extra
        out = kernel(q, kv, mask=mask, bias=bias, causal=causal, prev_scores=prev_scores,
                     need_weights=need_weights or self.reads_weights)
        if self.reads_weights:
            weights = out.weights
            if kernel.training and kernel.dropout.p > 0:     # the output again, from the same dropped weights
                from ..attention.kernels.dense import match_heads

                weights = kernel.dropout(weights)
                out.out = weights @ match_heads(kv.v, q.shape[1]).to(weights.dtype)
            out.out = out.out + self.values(weights, kv, q_pos).to(out.out.dtype)
            out.weights = out.weights if need_weights else None
        return out


def pad_free(terms: Tensor, free: int) -> Tensor:
    """(..., j - free) -> (..., j): zeros for the keys without a position."""
    return F.pad(terms, (free, 0)) if free else terms


def build(cfg: AttentionConfig, dim: int, shared: nn.Module | None) -> RelativeStage | None:
    """The block's relative stage from its config, or None."""
    if cfg.relative is None:
        return None
    from ..registry import RELATIVE

    return RELATIVE[cfg.relative.name].build(cfg.relative.options, dim=dim, heads=cfg.heads,
                                             dim_head=cfg.dim_head, shared=shared)


def shared(cfg: AttentionConfig) -> nn.Module | None:
    """What the stack holds once for every block (Transformer-XL's u, v with rel_pos_xl_shared_uv), or None."""
    if cfg.relative is None:
        return None
    from ..registry import RELATIVE

    return RELATIVE[cfg.relative.name].build.shared(cfg.relative.options, cfg.heads, cfg.dim_head)


def problems(cfg: LayersConfig) -> list[str]:
    """What a relative scheme cannot combine with, naming the keywords; then the scheme's own check."""
    from ..attention.patterns import own_projections
    from ..registry import RELATIVE

    a = cfg.attention
    blocks = cfg.attention_layers or ()
    if any(b.relative is not None and getattr(b.relative.options, "shared_uv", False) for b in blocks):
        return ["rel_pos_xl_shared_uv holds u and v once for every block; attn_per_layer gives blocks their own "
                "attention: choose one"]
    if a.relative is None:
        return []
    name = KEYWORDS[a.relative.name]
    found = score_term_problems(name, a, cfg)
    if a.collab_heads:
        found.append(f"{name} reads per-head queries of attn_dim_head features; attn_collab_heads shares them")
    if own_projections(a.pattern) is not None:
        found.append(f"{name} cannot combine with attn_global_projections (the global queries' own attention)")
    return found + RELATIVE[a.relative.name].build.check(a.relative.options, cfg)


def score_term_problems(name: str, a: AttentionConfig, cfg: LayersConfig) -> list[str]:
    """What a scheme adding terms to the dense self-attention scores (keyword `name`: a relative scheme, the
    Forgetting Transformer's gates) cannot combine with: a score bias, another kernel, a mixer, only_cross."""
    from ..attention.kernels.direct import switch

    found = []
    if a.bias != "none":
        other = BIAS_KEYWORD[a.bias]
        found.append(f"{name} and {other} conflict: both are relative position schemes of the scores; choose one")
    if a.kernel.name != "dense":
        found.append(f"{name} adds terms to the dense scores; {switch('attention.kernel.', a.kernel.name)} "
                     "computes attention its own way")
    if cfg.mixer is not None:
        found.append(f"{name} adds terms to attention scores; {switch('mixer.', cfg.mixer.name)} replaces attention")
    if cfg.only_cross:
        found.append(f"{name} acts on self-attention; only_cross=True has none")
    return found
