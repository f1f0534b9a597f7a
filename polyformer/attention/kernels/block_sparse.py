"""Exact softmax attention over a pattern's parts, computed sparse: for each group of queries only
its listed keys are gathered, multiplied and normalised, so time and memory grow with
n x (keys a query sees), never n^2. Parts are merged by their log-sum-exp (FlashAttention's
running-softmax identity, arXiv:2205.14135): disjoint parts give the softmax over their union; a
mixture's overlapping parts give LongNet's denominator-weighted mix. Plain PyTorch (gather, batched
matmul), so autograd gives the backward and it runs on any device."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...interfaces import KV
from ...precision import HIDDEN, upcast
from ..patterns.layout import Pairs, Part, take
from . import cpu


def heads_of(part: Part, h: int, device: torch.device) -> Tensor:
    return torch.tensor(part.heads, device=device) if part.heads is not None else torch.arange(h, device=device)


def gather_rows(t: Tensor, idx: Tensor) -> Tensor:
    """t (b, h, n, d) at idx (z, H, G, m) (-1 read as row 0) -> (b, h, G, m, d)."""
    b, h, _, d = t.shape
    z, H, G, m = idx.shape
    flat = idx.clamp(min=0).reshape(z, H, G * m, 1).expand(b, h, -1, d)
    return t.gather(2, flat).view(b, h, G, m, d)


def banded(q: Tensor, k: Tensor, v: Tensor, part: Part) -> tuple[Tensor, Tensor, Tensor]:
    """A window's groups as views: queries (b, h, G, Q, d) in order, keys / values (b, h, G, K, d)
    read from g Q + band on (zero rows where that leaves the keys; `keep` hides them)."""
    G, Q, K = part.queries.shape[2], part.queries.shape[3], part.keys.shape[3]
    i, j = q.shape[2], k.shape[2]
    qg = F.pad(q, (0, 0, 0, G * Q - i)).unflatten(2, (G, Q))
    front = max(0, -part.band)
    back = max(0, (G - 1) * Q + part.band + K - j)
    start = part.band + front

    def windows(t: Tensor) -> Tensor:
        t = F.pad(t, (0, 0, front, back))[:, :, start:]
        return t.unfold(2, K, Q)[:, :, :G].transpose(-1, -2)        # (b, h, G, K, d)

    return qg, windows(k), windows(v)


def part_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, k_mask: Tensor | None,
                   part: Part, bias: nn.Module | None, dropout: nn.Module, need_lse: bool
                   ) -> tuple[Tensor, Tensor | None, Tensor]:
    """One part, q already scaled: (out (b, hp, i, dv), lse (b, hp, i) when asked, heads (hp,))."""
    b, h, i, _ = q.shape
    heads = heads_of(part, h, q.device)
    if part.heads is not None:
        q, k, v = q[:, heads], k[:, heads], v[:, heads]
    hp = q.shape[1]
    if part.band is not None:
        qg, kg, vg = banded(q, k, v, part)
    else:
        qg = gather_rows(q, part.queries)                           # (b, hp, G, Q, d)
        kg, vg = gather_rows(k, part.keys), gather_rows(v, part.keys)    # (b, hp, G, K, d)
    qp, kp = take(q_pos, part.queries), take(k_pos, part.keys)      # (z', H, G, Q) / (z', H, G, K)
    pr = Pairs(qp=qp[..., None], kp=kp[..., None, :], qi=part.queries[..., None], ki=part.keys[..., None, :],
               head=heads.view(-1, 1, 1, 1))
    keep = part.keep(pr) & (part.queries >= 0)[..., None] & (part.keys >= 0)[..., None, :]
    if k_mask is not None:
        keep = keep & take(k_mask, part.keys)[..., None, :]
    scores = upcast(torch.matmul(qg, kg.transpose(-1, -2)))          # (b, hp, G, Q, K), float32 at least
    add = torch.zeros(keep.shape, dtype=scores.dtype, device=q.device).masked_fill_(~keep, HIDDEN)
    if bias is not None:
        add = add + bias.aligned(qp, kp, heads).to(scores.dtype)
    scores = scores + add if scores.requires_grad and not torch.is_inference_mode_enabled() else scores.add_(add)
    weights = scores.softmax(-1)
    lse = scores.logsumexp(-1) if need_lse else None                # (b, hp, G, Q)
    out = torch.matmul(dropout(weights).to(v.dtype), vg)           # (b, hp, G, Q, dv)
    out = out * keep.any(-1, keepdim=True).to(out.dtype)            # a query that sees no key gets zeros
    # back to query order; empty slots write to a spare row i, dropped
    z, H = part.queries.shape[:2]
    if part.band is not None:                                       # the groups are the queries in order
        return out.flatten(2, 3)[:, :, :i], lse.flatten(2)[:, :, :i] if lse is not None else None, heads
    slot = part.queries.masked_fill(part.queries < 0, i).reshape(z, H, -1)
    dv = out.shape[-1]
    full = out.new_zeros(b, hp, i + 1, dv).scatter(2, slot[..., None].expand(b, hp, -1, dv), out.flatten(2, 3))
    if lse is not None:
        lse = lse.new_full((b, hp, i + 1), HIDDEN).scatter(2, slot.expand(b, hp, -1), lse.flatten(2))[:, :, :i]
    return full[:, :, :i], lse, heads


def cpu_window(q: Tensor, kv: KV, parts: list[Part], k_mask: Tensor | None, bias: nn.Module | None,
               dropout: nn.Module) -> tuple[int, bool]:
    """(w, causal) when the pattern is one sliding window with dilation 1 for every head, queries and
    keys the same positions, no persistent memory, key mask, score bias or dropout, and the compiled
    CPU kernel takes the call (float32 on the CPU ...: cpu.applies); else (0, _). Causal: a band of
    w keys that ends at each group's last query (K = Q + w - 1, band 1 - w), row r sees
    r - w < j <= r. Bidirectional: a band of h = w // 2 keys either side of each group (K = Q + 2 h,
    band -h), row r sees |r - j| <= h; the kernel's window is then 2 h (its own half is window // 2),
    so an odd pattern window 2 h + 1 maps to 2 h, the same band."""
    if len(parts) != 1 or kv.free or k_mask is not None or bias is not None:
        return 0, False
    part = parts[0]
    if part.band is None or part.heads is not None or q.shape[2] != kv.k.shape[2]:
        return 0, False
    Q, K = part.queries.shape[3], part.keys.shape[3]
    if part.band + K == Q:
        window, causal = 1 - part.band, True
    elif part.band < 0 and K - Q == -2 * part.band:
        window, causal = -2 * part.band, False
    else:
        return 0, False
    p = dropout.p if dropout.training else 0.0
    return (window, causal) if cpu.applies(q, kv.k, kv.v, None, None, p, window=window) else (0, False)


def attention(q: Tensor, kv: KV, q_pos: Tensor, parts: list[Part], k_mask: Tensor | None,
              bias: nn.Module | None, scale: float, dropout: nn.Module) -> Tensor:
    """q (b, h, i, d); kv's first `free` keys (persistent memory) are seen by every query without
    bias; the parts index the rest. Returns (b, h, i, dv)."""
    window, causal = cpu_window(q, kv, parts, k_mask, bias, dropout)
    if window:      # the compiled kernel computes the band alone (O(i w)), kv heads read in place
        return cpu.attention(q, kv.k, kv.v, scale, causal, window=window)
    b, h, i, _ = q.shape
    k, v = kv.k, kv.v
    q = q * scale
    if k.shape[1] != h:
        k, v = k.repeat_interleave(h // k.shape[1], dim=1), v.repeat_interleave(h // v.shape[1], dim=1)
    outs, lses = [], []
    single = len(parts) + bool(kv.free) == 1 and parts[0].heads is None
    if kv.free:
        scores = upcast(torch.matmul(q, k[:, :, : kv.free].transpose(-1, -2)))
        outs.append(torch.matmul(dropout(scores.softmax(-1)).to(v.dtype), v[:, :, : kv.free]))
        lses.append(scores.logsumexp(-1))
        k, v = k[:, :, kv.free:], v[:, :, kv.free:]
    for part in parts:
        out, lse, heads = part_attention(q, k, v, q_pos, kv.pos, k_mask, part, bias, dropout, not single)
        if part.heads is not None:
            out = out.new_zeros(b, h, i, out.shape[-1]).index_copy(1, heads, out)
            lse = lse.new_full((b, h, i), HIDDEN).index_copy(1, heads, lse)
        outs.append(out)
        lses.append(lse)
    if not outs:
        return q.new_zeros(b, h, i, v.shape[-1])
    if single:
        return outs[0].to(q.dtype)
    share = torch.stack(lses).softmax(0)            # (parts, b, h, i): each part's share of the softmax mass
    return sum(o * s[..., None].to(o.dtype) for o, s in zip(outs, share)).to(q.dtype)
