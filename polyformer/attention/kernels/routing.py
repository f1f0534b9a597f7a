"""Routing attention (Roy et al. 2021, "Efficient Content-Based Sparse Attention with Routing
Transformers", arXiv:2003.05997), a kernel of form "direct".

The first `heads` heads route: queries and keys, unit-normalised, go to their nearest centroid of an
online k-means (`kmeans.py`: EMA updates in training, the commitment loss reported as
"routing_commitment"), and a query attends to the keys of its own cluster only. Inside a cluster the
keys are ordered by position and cut into chunks of `window`; a query sees its chunk (where its own
position falls among the cluster's keys) and the previous one (`bucketed.py`, shared with LSH
attention), so it costs O(n window), never n². In a causal stack a query sees earlier keys of its
cluster only, and which keys those are depends on earlier tokens alone: later tokens neither join
its chunk nor move its boundaries (routing-transformer 1.6.1 lets each cluster take its top tokens
from the whole sequence, which leaks the future). A decode step routes the new queries and every
cached key under the same centroids and rule, so cached == uncached.

The other heads attend locally, under the stack's `attn_window` (the window pattern's rule: causal
i - w < j <= i, bidirectional |i - j| <= w // 2), as the paper mixes local and routing heads.
Keys without a position (memory key / values) are seen by every routing query beside its cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ... import checks
from ...config import LayersConfig
from ...interfaces import KV, AttnOut, Caps, KernelSpec
from ...losses import AuxLosses
from ...precision import upcast
from ..normalize import masked_softmax
from ..patterns import PatternStage
from . import block_sparse
from .bucketed import bucketed
from .dense import match_heads
from .kmeans import OnlineKmeans

LOSS = "routing_commitment"


@dataclass(frozen=True)
class RoutingOptions:
    clusters: int = 16              # k; the paper takes k ~ sqrt(n) (n / k keys per cluster ~ window)
    window: int = 64                # keys per chunk of a cluster; a query sees two chunks
    heads: int | None = None        # how many heads route (the first ones); None: all
    decay: float = 0.999            # λ of the centroids' moving average (the paper's)
    commitment: float = 1e-4        # weight of the commitment loss (routing-transformer's default)


class Routing(nn.Module):
    """Routing heads (and local heads) on q (b, h, i, d), kv.k / kv.v (b, hk, j, d): out (b, h, i, dv)."""

    caps = Caps(exact=True, bias=False, causal=True, bidirectional=True, padding=True, decode="keys",
                form="direct", patterns=("window",))
    options: type = RoutingOptions
    loss_names = (LOSS,)

    def __init__(self, spec: KernelSpec):
        super().__init__()
        o: RoutingOptions = spec.options
        self.routed = o.heads or spec.heads
        self.window, self.commitment, self.scale = o.window, o.commitment, spec.scale
        self.kmeans = OnlineKmeans(self.routed, o.clusters, spec.dim_qk, o.decay, seed=spec.layer)
        local = spec.heads - self.routed
        self.local = PatternStage(spec.pattern, local, spec.causal, spec.layer) if local else None
        self.no_dropout = nn.Dropout(0.0)

    @staticmethod
    def check(options: RoutingOptions, cfg: LayersConfig) -> list[str]:
        heads = cfg.attention.heads
        found = checks.whole(options.clusters, "attn_routing_clusters")
        found += checks.whole(options.window, "attn_routing_window")
        wrong = checks.whole(options.heads, "attn_routing_heads", optional=True)
        if not wrong and options.heads is not None and options.heads > heads:
            wrong = [f"attn_routing_heads must be in [1, heads={heads}], got {options.heads}"]
        found += wrong
        if not checks.number(options.decay) or not 0 < options.decay < 1:
            found.append(f"attn_routing_decay must be a number in (0, 1), got {options.decay!r}")
        if not checks.number(options.commitment) or options.commitment < 0:
            found.append(f"attn_routing_commitment must be a number >= 0, got {options.commitment!r}")
        if cfg.attention.dropout:
            found.append("attn_dropout cannot combine with attn_routing: its bucketed attention has no dropout")
        window = next((c.options for c in cfg.attention.pattern if c.name == "window"), None)
        routed = heads if wrong or options.heads is None else options.heads
        if window is not None and routed == heads:
            found.append(f"attn_window gives attn_routing's local heads their window, but all {heads} heads route: "
                         f"set attn_routing_heads below {heads}, or leave attn_window out")
        if window is None and routed < heads:
            found.append(f"attn_routing_heads={routed} leaves {heads - routed} local heads: they need attn_window")
        if window is not None and window.dilation != 1:
            found.append("attn_window_dilation cannot combine with attn_routing: its local heads take a plain window")
        return found

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        h, r = q.shape[1], self.routed
        k, v = match_heads(kv.k, h), match_heads(kv.v, h)
        losses = AuxLosses()
        out, weights = self.route(q[:, :r], KV(k[:, :r], v[:, :r], kv.pos, kv.mask, kv.free), q_pos, causal, losses,
                                  need_weights)
        if self.local is not None:
            local, local_weights = self.attend_locally(q[:, r:], KV(k[:, r:], v[:, r:], kv.pos, kv.mask, kv.free),
                                                       q_pos, need_weights)
            out = torch.cat((out, local), dim=1)
            weights = torch.cat((weights, local_weights), dim=1) if need_weights else None
        return AttnOut(out, weights=weights, losses=losses)

    def route(self, q: Tensor, kv: KV, q_pos: Tensor, causal: bool, losses: AuxLosses, need_weights: bool
              ) -> tuple[Tensor, Tensor | None]:
        """The routing heads: q (b, r, i, d) against kv's keys of the same cluster and its keys without
        a position; (out (b, r, i, dv), weights (b, r, i, j) when asked)."""
        dtype, i, free = q.dtype, q.shape[2], kv.free
        k, v = kv.k[:, :, free:], kv.v[:, :, free:]
        q_ids, k_ids, loss = self.kmeans(q, k, None if kv.mask is None else kv.mask[:, -i:])
        losses.report(LOSS, loss, self.commitment)
        out, lse, *weights = bucketed(q, k, v, q_ids, k_ids, chunk=self.window, causal=causal, q_pos=q_pos,
                                      k_pos=kv.pos, k_mask=kv.mask, scale=self.scale, need_weights=need_weights)
        weights = weights[0] if need_weights else None
        if not free:
            return out, weights
        scores = upcast(q @ kv.k[:, :, :free].transpose(-1, -2)) * self.scale      # seen by every query
        free_weights = scores.softmax(-1)
        share = torch.stack((lse, scores.logsumexp(-1))).softmax(0)[..., None]      # softmax over the union
        out = (upcast(out) * share[0] + (free_weights * share[1]).to(v.dtype) @ kv.v[:, :, :free]).to(dtype)
        if need_weights:
            weights = torch.cat((free_weights * share[1], upcast(weights) * share[0]), -1).to(dtype)
        return out, weights

    def attend_locally(self, q: Tensor, kv: KV, q_pos: Tensor, need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """The local heads: attn_window's rule, block-sparse when the keys are one run of positions,
        else (and for the weights) through the pattern's mask; (out (b, l, i, dv), weights (b, l, i, j))."""
        geo = self.local.geometry(q_pos, kv.pos, kv.mask, None)
        if geo.run and not need_weights:
            out = block_sparse.attention(q, kv, q_pos, self.local.parts(geo), kv.mask, None, self.scale,
                                         self.no_dropout)
            return out, None
        keep = self.local.visible(self.local.counts(geo), kv)               # (z, l, i, free + j)
        weights = masked_softmax(upcast(q @ kv.k.transpose(-1, -2)) * self.scale, keep)
        return (weights.to(kv.v.dtype) @ kv.v).to(q.dtype), weights.to(q.dtype) if need_weights else None
