"""Attention inside buckets, chunked by position: the shared core of content-based sparse attention
(LSH attention, Kitaev et al. 2020, arXiv:2001.04451, in its causal form; Routing attention, Roy et al.
2021, arXiv:2003.05997).

Every query and key carries an integer bucket id (a hash, a cluster). The kept keys of a bucket, in
order of position (ties by index), are cut into chunks of `chunk` keys. A query's chunk is where its
own position falls among its bucket's keys: with r of them at earlier positions, chunk r // chunk. It
sees its bucket's keys in that chunk and the one before, in a causal stack only those at positions up
to its own, never a masked key. Masked keys belong to no bucket, so they move no chunk boundary.
Causal, the keys a query sees depend on earlier keys only (a rank counts earlier positions), so a
decode step that applies the rule to the cached keys reproduces the full forward exactly.

`exclude_self` (shared query-key attention, the Reformer's rule): the key at the query's own position
is seen only when no other key is visible to it.

Cost O(n * chunk), no (n, n) tensor: with the keys sorted by (bucket, position), the keys a query sees
are one run of at most 2 * chunk sorted keys (`bucket_blocks.py` lays the queries out in blocks that
share runs of keys).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...precision import HIDDEN, upcast
from .bucket_blocks import layout

_SHIFT = 32                 # sort_key: bucket << 32 | position + 2**31
_OFFSET = 1 << 31
NO_BUCKET = 1 << 30         # masked keys: after every real bucket (bucket ids must be below it)


def sort_key(bucket: Tensor, pos: Tensor) -> Tensor:
    """Integer buckets and positions as one int64 that sorts by bucket, then position."""
    return (bucket << _SHIFT) + pos + _OFFSET


def rows_of(t: Tensor, b: int, g: int, n: int) -> Tensor:
    """(b|1, n) or (b, n) -> (b * g, n), one row per (batch, bucket row)."""
    return t.expand(b, n)[:, None].expand(b, g, n).reshape(b * g, n)


class MaskedSoftmax(torch.autograd.Function):
    """softmax over the visible scores (s (..., k), visible bool) and its log-normaliser (...), from one
    pass of exponentials: lse = s_t - log w_t at the largest score t. Hidden keys weigh exactly 0, so the
    backward, w * (g - Σ g w + g_lse), needs no mask."""

    @staticmethod
    def forward(ctx, scores: Tensor, visible: Tensor) -> tuple[Tensor, Tensor]:
        scores = scores.masked_fill(~visible, HIDDEN)
        weights = torch.softmax(scores, -1)
        top = scores.argmax(-1, keepdim=True)
        ctx.save_for_backward(weights)
        return weights, (scores.gather(-1, top) - weights.gather(-1, top).log()).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_weights: Tensor, grad_lse: Tensor) -> tuple[Tensor, None]:
        (weights,) = ctx.saved_tensors
        return weights * (grad_weights - (grad_weights * weights).sum(-1, keepdim=True) + grad_lse[..., None]), None


def bucketed(q: Tensor, k: Tensor, v: Tensor, q_bucket: Tensor, k_bucket: Tensor, *, chunk: int, causal: bool,
             q_pos: Tensor, k_pos: Tensor, k_mask: Tensor | None, scale: float, exclude_self: bool = False,
             need_weights: bool = False) -> tuple[Tensor, ...]:
    """Bucketed attention of q (b, h, i, d) over k (b, h, j, d), v (b, h, j, dv) (heads matched).

    q_bucket (b, g, i), k_bucket (b, g, j): integer bucket ids in [0, 2**30), g a multiple of h: g / h
    rounds of buckets per head (row y * g / h + t is head y's round t; LSH's hash rounds). q_pos (b|1, i),
    k_pos (b|1, j): integer positions; k_mask (b, j) bool keep or None. Returns (out (b, g, i, dv) in q's
    dtype, lse (b, g, i) float32), and the weights (b, g, i, j) as a third element when need_weights.
    lse is the log-sum-exp of the query's visible scores (with exclude_self, of those other than its
    own key), -inf when there are none; rounds combine as exp(lse_r - logsumexp_r lse_r). A query that
    sees nothing gets 0; one that sees only its own key (exclude_self) gets its value.
    """
    b, h, i, d = q.shape
    g, j, dv, c, dtype, device = q_bucket.shape[1], k.shape[2], v.shape[-1], chunk, q.dtype, q.device
    if g % h:
        raise ValueError(f"bucket rows ({g}) must be a multiple of the heads ({h})")
    if i == 0 or j == 0:
        out = (q.new_zeros(b, g, i, dv), q.new_full((b, g, i), float("-inf"), dtype=torch.float32))
        return out + (q.new_zeros(b, g, i, j),) if need_weights else out
    rows = b * g
    head = (torch.arange(b, device=device)[:, None] * h + torch.arange(g, device=device) // (g // h)).reshape(rows)
    qf = (upcast(q) * scale).reshape(-1, d)
    kf, vf = upcast(k).reshape(-1, d), upcast(v).reshape(-1, dv)
    qp, kp = rows_of(q_pos.long(), b, g, i), rows_of(k_pos.long(), b, g, j)
    qb, kb = q_bucket.reshape(rows, i).long(), k_bucket.reshape(rows, j).long()
    if k_mask is not None:
        kb = kb.masked_fill(~rows_of(k_mask, b, g, j), NO_BUCKET)

    # each query's run [lo, hi) of keys in (bucket, position) order: its chunk m and the one before
    # (causal: cut at its position; exclude_self: less [before, after), the keys at its position)
    ordered, order = sort_key(kb, kp).sort(dim=1, stable=True)
    q_key = sort_key(qb, qp)
    first, end = torch.searchsorted(ordered, qb << _SHIFT), torch.searchsorted(ordered, (qb + 1) << _SHIFT)
    before, after = torch.searchsorted(ordered, q_key), torch.searchsorted(ordered, q_key, right=True)
    m = (before - first) // c
    lo, hi = first + (m - 1).clamp(min=0) * c, torch.minimum(first + (m + 1) * c, end)
    if causal:
        hi = torch.minimum(hi, before if exclude_self else after)
    q_order = q_key.sort(dim=1, stable=True)[1]
    blocks = layout(q_order, lo, hi, (qb << _SHIFT) + m, c, j)

    def attend(sel: Tensor, run: int) -> tuple[Tensor, ...]:
        """Blocks `sel` (flat ids) against their runs of `run` sorted keys: out (M, c, dv), lse, seen (M, c)."""
        row = sel // blocks.count
        at = blocks.start.view(-1)[sel][:, None] + torch.arange(run, device=device)          # (M, run)
        ki = order.view(-1)[row[:, None] * j + at.clamp(max=j - 1)]
        qi = blocks.query.view(-1, c)[sel].clamp(max=i - 1)                                  # (M, c)
        flat_q = row[:, None] * i + qi
        key_at = at[:, None]

        def of(t: Tensor) -> Tensor:
            return t.view(-1)[flat_q][..., None]

        visible = (key_at >= of(lo)) & (key_at < of(hi))       # empty slots repeat a query: never read
        if exclude_self and not causal:
            visible = visible & ((key_at < of(before)) | (key_at >= of(after)))
        q_rows, k_rows = head[row][:, None] * i + qi, (head[row][:, None] * j + ki).view(-1)
        scores = torch.bmm(qf.index_select(0, q_rows.view(-1)).view(-1, c, d),
                           kf.index_select(0, k_rows).view(-1, run, d).transpose(1, 2))
        weights, lse = MaskedSoftmax.apply(scores, visible)
        out = torch.bmm(weights, vf.index_select(0, k_rows).view(-1, run, dv))
        dense = None
        if need_weights:        # (rows * i, j + 1): each query's weights, one extra column for runs past j
            dense = weights.new_zeros(rows * i, j + 1).index_put_(
                (flat_q[..., None].expand_as(weights), torch.where(at < j, ki, j)[:, None].expand_as(weights)),
                weights * (blocks.query.view(-1, c)[sel] < i)[..., None], accumulate=True)
        return out, lse, visible.any(-1), dense

    groups = blocks.groups()
    parts = [attend(sel, run) for sel, run in groups]
    place = torch.full((rows * blocks.count,), -1, dtype=torch.long, device=device)      # block -> its place in parts
    done = 0
    for sel, _ in groups:
        place[sel] = torch.arange(done, done + sel.numel(), device=device)
        done += sel.numel()
    at_cat = place[torch.arange(rows, device=device)[:, None] * blocks.count + blocks.back // c] * c + blocks.back % c

    def gathered(t: Tensor) -> Tensor:        # per-slot values of every group -> (rows, i, ...)
        return t.reshape(-1, *t.shape[2:])[at_cat]

    seen = gathered(torch.cat([p[2] for p in parts]))
    out = gathered(torch.cat([p[0] for p in parts]))
    lse = torch.where(seen, gathered(torch.cat([p[1] for p in parts])), float("-inf")).view(b, g, i)
    # a query that saw no key takes its own value (exclude_self) or 0
    own = order.gather(1, before.clamp(max=j - 1))
    alone = ~seen & (after > before) if exclude_self else torch.zeros_like(seen)
    fallback = vf.index_select(0, (head[:, None] * j + own).view(-1)).view(rows, i, dv) * alone[..., None]
    out = torch.where(seen[..., None], out, fallback).view(b, g, i, dv).to(dtype)
    if not need_weights:
        return out, lse
    dense = sum(p[3] for p in parts)[:, :j].view(rows, i, j) * seen[..., None]
    dense = dense.scatter_add(2, own[..., None], alone[..., None].to(dense.dtype))
    return out, lse, dense.view(b, g, i, j).to(dtype)
