"""Attention pooling (x-transformers' attn_pool): k learned queries cross-attend to the stack's output, giving
k pooled tokens (b, k, dim_pooled) (as a Perceiver's latents, arXiv:2103.03206, or CoCa's attentional pooler,
arXiv:2205.01917). Depth 1 is one cross-attention, nothing around it: softmax(q kᵀ / √d) v per head, through
the output projection, with q from the queries and k, v from the output (padding masked out); a greater depth
is a CrossAttender of that depth (pre-norm cross-attention and feedforward blocks) run on the queries."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import checks
from ..attention.attention import Attention
from ..config import AttentionConfig
from ..interfaces import Context
from ..stack import AttentionLayers, CrossAttender


class AttentionPool(nn.Module):
    """Learned queries (k, dim_pooled) -> pooled tokens (b, k, dim_pooled) from a context (b, n, dim)."""

    def __init__(self, dim: int, dim_pooled: int, num_pooled: int, depth: int, heads: int, dim_head: int):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(num_pooled, dim_pooled) * 1e-2)
        self.attend = (Attention(dim_pooled, AttentionConfig(heads=heads, dim_head=dim_head), causal=False,
                                 cross=True, dim_context=dim) if depth == 1 else None)
        self.blocks = (CrossAttender(dim=dim_pooled, depth=depth, heads=heads, attn_dim_head=dim_head, dim_context=dim)
                       if depth > 1 else None)

    def forward(self, context: Tensor, mask: Tensor | None) -> Tensor:
        """context (b, n, dim), mask (b, n) bool keep or None -> (b, k, dim_pooled)."""
        b, k = context.shape[0], self.queries.shape[0]
        queries = self.queries.to(context.dtype).expand(b, -1, -1)
        if self.blocks is not None:
            return self.blocks(queries, context=context, context_mask=mask)
        ctx = Context(pos=torch.arange(k, device=context.device)[None], context=context, context_mask=mask)
        return self.attend(queries, ctx).out

    @classmethod
    def build(cls, owner: str, attn_pool: object, num_pooled_tokens: object, attn_pool_depth: object,
              dim_pooled_tokens: object, stack: AttentionLayers) -> "AttentionPool | None":
        if not isinstance(attn_pool, bool):
            raise TypeError(f"{owner}: attn_pool must be True or False, got {attn_pool!r}")
        if not attn_pool:
            given = [f"{name}={value!r}" for name, value, default in (
                ("num_pooled_tokens", num_pooled_tokens, 1), ("attn_pool_depth", attn_pool_depth, 1),
                ("dim_pooled_tokens", dim_pooled_tokens, None)) if value != default]
            if given:
                raise ValueError(f"{owner}: {', '.join(given)} configure attention pooling; give attn_pool=True")
            return None
        num = checks.count(num_pooled_tokens, f"{owner}: num_pooled_tokens")
        depth = checks.count(attn_pool_depth, f"{owner}: attn_pool_depth")
        dim_pooled = (stack.out_dim if dim_pooled_tokens is None
                      else checks.count(dim_pooled_tokens, f"{owner}: dim_pooled_tokens"))
        attention = stack.cfg.attention
        return cls(stack.out_dim, dim_pooled, num, depth, attention.heads, attention.dim_head)
