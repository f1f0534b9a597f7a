"""Global tokens (Longformer, arXiv:2004.05150; ETC, arXiv:2004.08483; BigBird, arXiv:2007.14062):
the first g positions, or the tokens `global_mask` marks, see every key and are seen by every query
(a Decoder keeps causality); attention sinks (StreamingLLM, arXiv:2309.17453; LM-Infinite): the first
s positions stay visible to every query."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from ... import checks
from ...interfaces import Caps
from .layout import Geometry, Pairs, Part, blocks, causal_ok, select, take

GROUP = 64


@dataclass(frozen=True)
class GlobalOptions:
    tokens: int = 0                     # the first g positions (besides the forward's global_mask)
    projections: bool = False           # global rows from their own q / k / v projections (Longformer)


@dataclass(frozen=True)
class SinkOptions:
    tokens: int


class Global:
    """`queries_too`: global tokens also see every key (global); False: they are only seen (sinks)."""

    options = GlobalOptions
    caps = Caps(exact=True, decode="keys")
    queries_too = True
    keyword = "attn_global_tokens"

    def __init__(self, tokens: int, causal: bool):
        self.tokens = tokens
        self.causal = causal

    @classmethod
    def build(cls, opts: GlobalOptions | SinkOptions, *, heads: int, causal: bool, layer: int = 0,
              choices: tuple = ()) -> "Global":
        return cls(opts.tokens, causal)

    @classmethod
    def check(cls, opts: GlobalOptions | SinkOptions, heads: int, causal: bool) -> list[str]:
        if wrong := checks.whole(opts.tokens, cls.keyword, 0 if cls.queries_too else 1):
            return wrong
        if getattr(opts, "projections", False) and causal:
            return ["attn_global_projections recomputes global rows over every key (Longformer, an encoder): "
                    "it cannot be causal (causal=True, a Decoder)"]
        return []

    def active(self, geo: Geometry) -> bool:
        return self.tokens > 0 or geo.flags is not None

    def is_global(self, pos: Tensor, idx: Tensor, geo: Geometry) -> Tensor:
        """Keys (positions pos, indices idx) that are global: among the first tokens, or marked."""
        marked = pos < self.tokens
        if geo.flags is not None:
            marked = marked | take(geo.flags, idx)
        return marked

    def sees(self, pr: Pairs, geo: Geometry) -> Tensor:
        on = self.is_global(pr.kp, pr.ki, geo)
        if self.queries_too:
            on = on | self.is_global(pr.qp, pr.qi + geo.shift, geo)
        return on & causal_ok(pr, self.causal)

    def parts(self, geo: Geometry) -> list[Part]:
        marked = geo.k_pos < self.tokens
        if geo.flags is not None:
            marked = marked | geo.flags
        keys = select(marked)                                             # (z, M)
        if keys.shape[1] == 0:
            return []
        queries = blocks(geo.nq, GROUP, geo.device)
        seen = Part(queries[None, None], keys[:, None, None].expand(-1, 1, queries.shape[0], -1),
                    lambda pr: self.is_global(pr.kp, pr.ki, geo) & causal_ok(pr, self.causal))
        if not self.queries_too:
            return [seen]
        own = select(marked[:, geo.shift:])                                # global queries (z, M')
        if own.shape[1] == 0:
            return [seen]
        g = -(-own.shape[1] // GROUP)
        own = F.pad(own, (0, g * GROUP - own.shape[1]), value=-1).view(own.shape[0], 1, g, GROUP)
        every = blocks(geo.nk, geo.nk, geo.device).view(1, 1, 1, -1).expand(1, 1, g, -1)

        def seeing(pr: Pairs) -> Tensor:
            return (self.is_global(pr.qp, pr.qi + geo.shift, geo) & ~self.is_global(pr.kp, pr.ki, geo)
                    & causal_ok(pr, self.causal))

        return [seen, Part(own, every, seeing)]


class Sinks(Global):
    options = SinkOptions
    caps = Caps(exact=True, decode="window", bidirectional=False)
    queries_too = False
    keyword = "attn_sink_tokens"

