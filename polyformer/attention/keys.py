"""The key source stage: what keys and values come from (the layer input, its XL memory, a
context), and the learned persistent memory key / values joined after projection (arXiv:1907.01470)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..interfaces import KV, Context, Source


def self_source(x: Tensor, ctx: Context, layer: int) -> Source:
    """x (b, n, dim), preceded by this layer's XL memory when there is one."""
    mem = ctx.mems[layer] if ctx.mems is not None else None
    if mem is None or mem.shape[1] == 0:
        return Source(x, ctx.pos, ctx.mask)
    m = mem.shape[1]
    mem_pos = ctx.pos[..., :1] - m + torch.arange(m, device=x.device)
    mem_mask = ctx.mem_masks[layer] if ctx.mem_masks is not None else None
    mask = None
    if mem_mask is not None or ctx.mask is not None:
        b = x.shape[0]
        mem_mask = mem_mask if mem_mask is not None else x.new_ones(b, m, dtype=torch.bool)
        own = ctx.mask if ctx.mask is not None else x.new_ones(b, x.shape[1], dtype=torch.bool)
        mask = torch.cat((mem_mask, own), dim=1)
    return Source(torch.cat((mem.to(x.dtype), x), dim=1), torch.cat((mem_pos, ctx.pos), dim=-1), mask)


def context_source(ctx: Context) -> Source:
    return Source(ctx.context, None, ctx.context_mask)


class MemoryKV(nn.Module):
    """`num` learned key / value pairs per head, seen by every query, placed before the other keys."""

    def __init__(self, num: int, k_heads: int, dim_k: int, v_heads: int, dim_v: int):
        super().__init__()
        self.k = nn.Parameter(torch.randn(k_heads, num, dim_k))
        self.v = nn.Parameter(torch.randn(v_heads, num, dim_v))

    def forward(self, kv: KV) -> KV:
        b = kv.k.shape[0]
        k = torch.cat((self.k.to(kv.k.dtype).expand(b, -1, -1, -1), kv.k), dim=2)
        v = torch.cat((self.v.to(kv.v.dtype).expand(b, -1, -1, -1), kv.v), dim=2)
        return KV(k=k, v=v, pos=kv.pos, mask=kv.mask, free=kv.free + self.k.shape[1])
