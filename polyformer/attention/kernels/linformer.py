"""Linformer (Wang et al. 2020, arXiv:2006.04768): keys and values projected along the sequence to k
rows, K̄ = Eᵀ K and V̄ = Fᵀ V with learned E, F of shape (n, k), then softmax attention of the queries
over those k rows: O(n k) instead of O(n²). E and F are shared by the heads (the paper's headwise
sharing) and, with share_kv, are one matrix (its key-value sharing). n is fixed when the model is
built (`seq_len`): a shorter input uses E's first rows, a longer one is refused. Padded keys and
values are zeroed before the projection, so they add nothing to any row. Keys without a position
(memory key / values) are not projected: the queries attend to them beside the k rows."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import checks
from ...config import LayersConfig
from ...interfaces import KV, AttnOut, Caps, KernelSpec
from ...precision import upcast
from .dense import match_heads


@dataclass(frozen=True)
class LinformerOptions:
    k: int                          # projected rows
    seq_len: int                    # n: the longest input, E's rows
    share_kv: bool = False          # F = E


class Linformer(nn.Module):
    """Softmax attention of queries (b, h, i, d) over the k projected rows of the keys / values in `kv`
    (and their keys without positions): out (b, h, i, dv)."""

    caps = Caps(exact=False, bias=False, causal=False, bidirectional=True, padding=True, decode="none",
                form="direct", tolerance=1e-5)
    options: type = LinformerOptions

    def __init__(self, spec: KernelSpec):
        super().__init__()
        o: LinformerOptions = spec.options
        self.scale, self.seq_len, self.dropout = spec.scale, o.seq_len, spec.dropout
        # E_tr ~ N(0, 1/k): the random projection of the paper's Johnson-Lindenstrauss argument
        self.proj_k = nn.Parameter(torch.randn(o.seq_len, o.k) / math.sqrt(o.k))
        self.proj_v = None if o.share_kv else nn.Parameter(torch.randn(o.seq_len, o.k) / math.sqrt(o.k))

    @staticmethod
    def check(options: LinformerOptions, cfg: LayersConfig) -> list[str]:
        found = []
        for name, value in (("k", options.k), ("seq_len", options.seq_len)):
            found += checks.whole(value, f"attn_linformer_{name}")
        found += checks.flag(options.share_kv, "attn_linformer_share_kv")
        return found

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        if need_weights:
            raise ValueError("return_attn=True cannot combine with attn_linformer_k: its weights are over k "
                             "projected rows, not over the keys")
        n = kv.k.shape[2] - kv.free
        if n > self.seq_len:
            raise ValueError(f"attn_linformer_seq_len={self.seq_len} is the longest sequence Linformer projects; "
                             f"got {n} keys")
        dtype, h = q.dtype, q.shape[1]
        q, k, v = upcast(q), upcast(kv.k), upcast(kv.v)
        free_k, k, free_v, v = k[:, :, :kv.free], k[:, :, kv.free:], v[:, :, :kv.free], v[:, :, kv.free:]
        if kv.mask is not None:             # padded keys and values add nothing to a projected row
            keep = kv.mask[:, None, :, None].to(k.dtype)
            k, v = k * keep, v * keep
        e = self.proj_k[:n].to(k.dtype)
        f = (self.proj_v if self.proj_v is not None else self.proj_k)[:n].to(v.dtype)
        k = torch.cat((free_k, torch.einsum("bhjd,jr->bhrd", k, e)), dim=2)       # (b, hk, free + k, d)
        v = torch.cat((free_v, torch.einsum("bhjd,jr->bhrd", v, f)), dim=2)
        # softmax attention over the projected rows, fused: no (i, k) score matrix is kept for backward
        out = F.scaled_dot_product_attention(q, match_heads(k, h), match_heads(v, h),
                                             dropout_p=self.dropout if self.training else 0.0, scale=self.scale)
        return AttnOut(out.to(dtype))
