"""Queries, keys and values: heads, kv-heads (MQA arXiv:1911.02150 / GQA arXiv:2305.13245) and
collaborative heads (arXiv:2006.16362)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import AttentionConfig
from .. import pooled
from ..interfaces import KV, Source
from ..position.sinusoidal import PositionInfusion
from ..precision import upcast


def split_heads(t: Tensor, heads: int) -> Tensor:
    """(b, n, h * d) -> (b, h, n, d), a view."""
    b, n, _ = t.shape
    return t.view(b, n, heads, t.shape[-1] // heads).transpose(1, 2)   # explicit d: n may be 0 (empty context)


def shared_keys(q: Tensor, eps: float = 1e-6) -> Tensor:
    """Shared query-key attention's keys (the Reformer, arXiv:2001.04451): the queries (b, h, n, d)
    normalised to length sqrt(d), x / sqrt(mean(x²) + eps), so that the score scale d^-0.5 gives
    q · k / |k| (Hugging Face's Reformer: the same eps)."""
    x = upcast(q)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(q.dtype)


class Projection(nn.Module):
    """Projects the queries' input and the key / value source into heads.

    Self-attention uses one fused q|k|v weight. Collaborative heads share one query and one key
    projection of `collab_compression * heads * dim_head` features across heads, each head
    re-weighting those features with its own mixing vector; the key then has a single head.
    Shared query-key attention (a kernel option `shared_qk`, attn_shared_qk) has no key weights in
    self-attention: the keys are the queries, normalised (`shared_keys`).
    """

    def __init__(self, dim: int, cfg: AttentionConfig, dim_context: int | None = None,
                 infuse: bool = False):
        super().__init__()
        h, d = cfg.heads, cfg.dim_head
        self.heads, self.dim_head = h, d
        self.kv_heads = 1 if cfg.collab_heads else (cfg.kv_heads or h)
        self.shared_qk = dim_context is None and getattr(cfg.kernel.options, "shared_qk", False) is True
        self.v_heads = h if cfg.collab_heads else self.kv_heads
        if cfg.collab_heads:
            shared = max(2, int(cfg.collab_compression * h * d) // 2 * 2)
            self.qk_dim = shared
            self.mixing = nn.Parameter(torch.ones(h, shared))
            q_out, k_out = shared, shared
        else:
            self.qk_dim = d
            self.mixing = None
            q_out, k_out = h * d, 0 if self.shared_qk else self.kv_heads * d
        v_out = self.v_heads * d
        self.split = (q_out, k_out, v_out)
        self.infusion = PositionInfusion(dim) if infuse else None
        self.cross = dim_context is not None
        if self.cross:
            self.to_q = nn.Linear(dim, q_out, bias=cfg.qkv_bias)
            self.to_kv = nn.Linear(dim_context, k_out + v_out, bias=cfg.qkv_bias)
        else:
            self.to_qkv = nn.Linear(dim, q_out + k_out + v_out, bias=cfg.qkv_bias)

    @property
    def dim_value(self) -> int:
        return self.dim_head

    def forward(self, x: Tensor, src: Source, q_pos: Tensor) -> tuple[Tensor, KV]:
        q_out, k_out, v_out = self.split
        if self.cross:
            return self.queries(x), self.keys_values(src)
        if self.infusion is not None:
            w_q, w_k, w_v = self.to_qkv.weight.split(self.split, dim=0)
            b_q, b_k, b_v = (self.to_qkv.bias.split(self.split) if self.to_qkv.bias is not None
                             else (None, None, None))
            q = F.linear(self.infusion(x, q_pos), w_q, b_q)
            k = F.linear(self.infusion(src.x, src.pos), *((w_q, b_q) if self.shared_qk else (w_k, b_k)))
            v = F.linear(src.x, w_v, b_v)
        elif src.x is x:
            q, k, v = pooled.linear(self.to_qkv, x).split(self.split, dim=-1)
            k = q if self.shared_qk else k
        else:   # XL memories precede x in the source: project once, queries are the last rows
            q, k, v = self.to_qkv(src.x).split(self.split, dim=-1)
            k = q if self.shared_qk else k
            q = q[:, -x.shape[1]:]
        return self._heads_q(q), self._heads_kv(k, v, src)

    def queries(self, x: Tensor) -> Tensor:
        """Cross-attention queries (b, h, i, d)."""
        return self._heads_q(self.to_q(x))

    def keys_values(self, src: Source) -> KV:
        """Cross-attention keys and values of a context; computed once per context when decoding."""
        k, v = self.to_kv(src.x).split(self.split[1:], dim=-1)
        return self._heads_kv(k, v, src)

    def _heads_q(self, q: Tensor) -> Tensor:
        if self.mixing is not None:
            return q[:, None] * self.mixing[:, None, :]               # (b, h, i, shared)
        return split_heads(q, self.heads)

    def _heads_kv(self, k: Tensor, v: Tensor, src: Source) -> KV:
        if self.mixing is not None:
            k = k[:, None]                                            # (b, 1, j, shared)
        else:
            k = split_heads(k, self.kv_heads)
            k = shared_keys(k) if self.shared_qk else k
        v = split_heads(v, self.v_heads)
        return KV(k=k, v=v, pos=src.pos, mask=src.mask)
