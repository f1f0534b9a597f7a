"""Longformer's global attention with its own projections (arXiv:2004.05150, section 3.1): the rows
of global tokens are recomputed from separate query / key / value projections over every key, and
replace what the pattern computed for them. Local rows keep the shared projections (and still see
the global tokens' keys from them)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..config import AttentionConfig
from ..interfaces import Context
from .keys import self_source
from .patterns.layout import select, take
from .projection import Projection


class GlobalQueries(nn.Module):
    def __init__(self, dim: int, cfg: AttentionConfig, tokens: int):
        super().__init__()
        self.project = Projection(dim, cfg)
        self.tokens = tokens

    def forward(self, out: Tensor, x: Tensor, ctx: Context, layer: int, position: nn.Module | None,
                bias: nn.Module | None, kernel: nn.Module) -> Tensor:
        """out (b, h, n, dv) from the pattern; returns it with the global rows replaced."""
        flags = ctx.pos.expand(x.shape[0], -1) < self.tokens
        if ctx.global_mask is not None:
            flags = flags | ctx.global_mask
        rows = select(flags)                                           # (b, M), -1 padded
        if rows.shape[1] == 0:
            return out
        q, kv = self.project(x, self_source(x, ctx, layer), ctx.pos)    # q (b, h, n, d)
        if position is not None:
            q, kv.k = position(q, kv.k, ctx.pos, kv.pos)
        b, h, _, d = q.shape
        q = q.gather(2, rows.clamp(min=0)[:, None, :, None].expand(b, h, -1, d))
        keep = kv.mask[:, None, None, :] if kv.mask is not None else None
        scores = bias(take(ctx.pos, rows), kv.pos) if bias is not None else None
        own = kernel(q, kv, mask=keep, bias=scores, causal=False, prev_scores=None, need_weights=False).out
        dv = own.shape[-1]
        slot = rows.masked_fill(rows < 0, out.shape[2])[:, None, :, None].expand(b, h, -1, dv)
        return F.pad(out, (0, 0, 0, 1)).scatter(2, slot, own)[:, :, :-1]
