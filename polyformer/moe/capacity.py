"""Which routing choices an expert takes when its capacity is limited: priority by token order within a
batch row, so a token is never evicted by a later one.

A choice of token i for expert e has rank r = the number of earlier real tokens of the row routed to e
(dropped or not). It is kept iff r < the capacity: an absolute `ff_moe_capacity` C; in an Encoder with
capacity factor c, ceil(c * n * k / E) for the row's n real tokens; in a Decoder the running capacity
ceil(c * (i + 1) * k / E) at token i (0-based among the row's real tokens), which depends on no later token
and still bounds an expert's tokens per row by ceil(c * n * k / E). A decode state keeps, per row, the
running count of tokens routed to each expert and of real tokens (in its per-block history, so rollback,
reorder and clone stay exact)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .options import MoeOptions


def capacity(factor: float, tokens: Tensor, k: int, num_experts: int) -> Tensor:
    """ceil(factor * tokens * k / E), in float64; the 1e-12 relative slack keeps a product that rounds just
    above a whole number (1.1 * 10) from gaining one."""
    return torch.ceil(factor * tokens.double() * k / num_experts * (1 - 1e-12)).long()


def kept(experts: Tensor, real: Tensor, options: MoeOptions, causal: bool, before: Tensor | None = None
         ) -> tuple[Tensor, Tensor]:
    """experts (b, n, k) chosen per token, real (b, n) bool -> (keep (b, n, k) bool, the running counts after
    each token (b, n, E + 1): tokens routed to each expert, then real tokens). `before` (b, E + 1): the
    counts of the row's earlier tokens (decoding), or None."""
    e = options.num_experts
    routed = F.one_hot(experts, e).sum(dim=2) * real[..., None]                     # (b, n, E)
    counts = torch.cat([routed, real[..., None].long()], dim=-1).cumsum(dim=1)       # inclusive
    if before is not None:
        counts = counts + before[:, None]
    rank = (counts[..., :e] - routed).gather(-1, experts)                           # earlier tokens only
    if options.capacity is not None:
        cap = torch.full_like(real, options.capacity, dtype=torch.long)
    elif causal:
        cap = capacity(options.capacity_factor, counts[..., e], options.top_k, e)   # i + 1 real tokens so far
    else:
        cap = capacity(options.capacity_factor, real.sum(dim=1, keepdim=True), options.top_k, e).expand_as(real)
    return real[..., None] & (rank < cap[..., None]), counts
