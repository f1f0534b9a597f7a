"""The algebra of the Attention Free Transformer (aft.py): per feature f, over the keys j a query t sees,

    out_tf = Σ_j e^{K_jf + w_tj} V_jf / Σ_j e^{K_jf + w_tj}

with K = -inf on padded keys. Every exponent is taken relative to maxima over keys the query sees
(in a causal stack: a running maximum over j <= t), so scaled inputs cannot overflow and the future
never enters, not even through a maximum. Maxima only rescale numerator and denominator alike, so
they carry no gradient. Three forms:

- `summary` / `scan`: no biases, all keys or prefix sums (O(n d), quadratic only inside chunks);
- `windowed`: biases only for keys near the query (local, conv): the unbiased sums of the keys
  outside the window (a prefix, and a suffix when bidirectional) plus the window, unfolded: O(n s d);
- `pairwise`: any biases (full): exp(w) @ (exp(K) ⊙ V), per chunk of queries when causal.

Keys are (b, g, j, d): the first `free` carry no position (memory key / values) and every query sees
them unbiased; the last i of the rest are the queries' own, and in a causal stack the j - i before
them (a decode state's keys, XL memories) are seen by every query."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .dense import causal_keep

Sums = tuple[Tensor, Tensor, Tensor]     # numerator, denominator relative to a maximum, and it: each (b, g, n, d)
Bias = Callable[[Tensor, Tensor], Tensor]    # (query indices (i,), key indices (i|1, S)) -> (b|1, g|1, i, S)


def _finite(x: Tensor) -> Tensor:
    """A maximum, detached, with -inf (no key seen) read as 0."""
    x = x.detach()
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den, and 0 where a query sees no key at all."""
    return num / torch.where(den > 0, den, torch.ones_like(den))


def summary(k: Tensor, v: Tensor) -> Sums:
    """The sums over all keys k, v (b, g, j, d), relative to their maximum: each (b, g, 1, d)."""
    b, g, _, d = k.shape
    top = k.amax(2, keepdim=True) if k.shape[2] else k.new_full((b, g, 1, d), float("-inf"))
    e = (k - _finite(top)).exp()
    return (e * v).sum(2, keepdim=True), e.sum(2, keepdim=True), top.detach()


def scan(k: Tensor, v: Tensor, start: Sums, chunk: int) -> Sums:
    """Prefix sums after each key of k, v (b, g, n, d), continuing `start` (each (b, g, 1, d)), each
    relative to the running maximum: quadratic inside chunks, one carried sum across them."""
    b, g, n, d = k.shape
    if n == 0:
        return tuple(t[:, :, :0].expand(b, g, 0, d) for t in start)
    L = min(chunk, n)
    C = -(-n // L)
    pad = C * L - n
    k = F.pad(k, (0, 0, 0, pad), value=float("-inf")).view(b, g, C, L, d)
    v = F.pad(v, (0, 0, 0, pad)).view(b, g, C, L, d)
    run = k.detach().cummax(3).values                                     # within each chunk
    top = run[:, :, :, -1]                                                # (b, g, C, d)
    e = (k - _finite(top)[:, :, :, None]).exp()
    part_num, part_den = (e * v).sum(3), e.sum(3)
    num, den, seen = (t[:, :, 0] for t in start)
    carried = []
    # the sums before each chunk; unbind, not indexing: one backward for all chunks, not a full-size one each
    for c_top, c_num, c_den in zip(top.unbind(2), part_num.unbind(2), part_den.unbind(2)):
        carried.append((num, den, seen))
        both = torch.maximum(seen, c_top)
        safe = _finite(both)
        mine, theirs = (seen - safe).exp(), (c_top - safe).exp()
        num = num * mine + c_num * theirs
        den = den * mine + c_den * theirs
        seen = both
    s_num, s_den, s_max = (torch.stack(t, 2) for t in zip(*carried))     # (b, g, C, d)
    ref = torch.maximum(run, s_max[:, :, :, None])                        # per key: the running maximum
    safe = _finite(ref)
    later = ~causal_keep(L, L, k.device)
    x = (k[:, :, :, None] - safe[:, :, :, :, None]).masked_fill(later[..., None], float("-inf"))
    w = x.exp()                                                           # (b, g, C, t, j, d)
    scale = (s_max[:, :, :, None] - safe).exp()
    num = (w * v[:, :, :, None]).sum(4) + s_num[:, :, :, None] * scale
    den = w.sum(4) + s_den[:, :, :, None] * scale
    return tuple(t.reshape(b, g, C * L, d)[:, :, :n] for t in (num, den, ref))


def windowed(k: Tensor, v: Tensor, free: int, i: int, window: int, causal: bool, bias: Bias | None,
             chunk: int) -> tuple[Tensor, Tensor]:
    """(num, den) (b, g, i, d) where keys within `window` places of a query (j <= t when causal) may
    carry a bias, and all others are unbiased. window 0: no biases at all (simple, causal)."""
    b, g, j, d = k.shape
    n = j - free
    kf, vf, kp, vp = k[:, :, :free], v[:, :, :free], k[:, :, free:], v[:, :, free:]
    at = torch.arange(n - i, n, device=k.device)                          # the queries' own keys
    if causal:           # outside the window: keys up to t - window, seen by every query from `head` on
        head = min(max(n - i - window + 1, 0), n)
        first = summary(torch.cat((kf, kp[:, :, :head]), 2), torch.cat((vf, vp[:, :, :head]), 2))
        sums = scan(kp[:, :, head:max(head, n - window)], vp[:, :, head:max(head, n - window)], first, chunk)
        row = (at - window - head + 1).clamp(min=0)
        num, den, top = (torch.cat((a, c), 2)[:, :, row] for a, c in zip(first, sums))
    else:                # outside the window: a prefix and a suffix of the keys, and the free keys
        top = _finite(k.amax(2, keepdim=True))
        e = (kp - top).exp()
        pre = [F.pad(t.cumsum(2), (0, 0, 1, 0)) for t in (e * vp, e)]                       # sums of u < index
        post = [F.pad(t.flip(2).cumsum(2).flip(2), (0, 0, 0, 1)) for t in (e * vp, e)]      # sums of u >= index
        ef = (kf - top).exp()
        lo, hi = (at - window + 1).clamp(0, n), (at + window).clamp(0, n)
        num = pre[0][:, :, lo] + post[0][:, :, hi] + (ef * vf).sum(2, keepdim=True)
        den = pre[1][:, :, lo] + post[1][:, :, hi] + ef.sum(2, keepdim=True)
    if window == 0:
        return num, den
    # the window of query t: keys n - i + t + o for o in [1 - window, 0] (causal) or [1 - window, window - 1]
    span = window if causal else 2 * window - 1
    start, end = n - i - window + 1, n - i + span - window + i
    side = (0, 0, max(0, -start), max(0, end - n))
    kw = F.pad(kp[:, :, max(start, 0):end], side, value=float("-inf")).unfold(2, span, 1)     # (b, g, i, d, S)
    vw = F.pad(vp[:, :, max(start, 0):end], side).unfold(2, span, 1)
    u = at[:, None] + torch.arange(1 - window, span - window + 1, device=k.device)           # (i, S)
    x = kw + bias(at, u.clamp(0, max(n - 1, 0)))[..., None, :]
    ref = _finite(torch.maximum(top, x.amax(-1)))
    e = (x - ref[..., None]).exp()
    scale = (top - ref).exp()
    return num * scale + (e * vw).sum(-1), den * scale + e.sum(-1)


def pairwise(k: Tensor, v: Tensor, free: int, i: int, causal: bool, bias: Bias, chunk: int) -> tuple[Tensor, Tensor]:
    """(num, den) (b, g, i, d) with a bias for every (query, key) pair: exp(w - max) @ (exp(K - max) ⊙ V).
    Causal: per chunk of queries, the keys before the chunk (all seen) by one product, the chunk's own
    keys elementwise against each query's running maximum."""
    j = k.shape[2]
    n = j - free
    at = torch.arange(n - i, n, device=k.device)
    keys = torch.arange(-free, n, device=k.device)                        # free keys: index < 0, bias 0
    if not causal:
        w = bias(at, keys[None])                                          # (b|1, g|1, i, j)
        p = (w - _finite(w.amax(-1, keepdim=True))).exp()
        top = _finite(k.amax(2, keepdim=True))
        e = (k - top).exp()
        return p @ (e * v), p @ e
    nums, dens = [], []
    for s0 in range(0, i, chunk):
        s1 = min(s0 + chunk, i)
        a0, a1 = j - i + s0, j - i + s1                                   # the chunk's own keys
        w = bias(at[s0:s1], keys[None, :a1])                              # (b|1, g|1, l, a1)
        later = ~causal_keep(s1 - s0, s1 - s0, k.device)
        w = torch.cat((w[..., :a0], w[..., a0:].masked_fill(later, float("-inf"))), -1)
        w = w - _finite(w.amax(-1, keepdim=True))
        seen = k[:, :, :a0].amax(2, keepdim=True) if a0 else torch.full_like(k[:, :, :1], float("-inf"))
        top = _finite(seen)
        e = (k[:, :, :a0] - top).exp()
        p = w[..., :a0].exp()
        own = k[:, :, a0:a1]
        run = _finite(torch.maximum(own.detach().cummax(2).values, seen.detach()))   # (b, g, l, d)
        x = own[:, :, None] + w[..., a0:, None] - run[:, :, :, None]               # (b, g, t, j, d)
        ex = x.exp()
        scale = (top - run).exp()
        nums.append((p @ (e * v[:, :, :a0])) * scale + (ex * v[:, :, None, a0:a1]).sum(3))
        dens.append((p @ e) * scale + ex.sum(3))
    return torch.cat(nums, 2), torch.cat(dens, 2)
