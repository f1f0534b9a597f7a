"""The algebra of the Attention Free Transformer (aft.py): per feature f, over the keys j a query t sees,

    out_tf = Σ_j e^{K_jf + w_tj} V_jf / Σ_j e^{K_jf + w_tj}

with K = -inf on padded keys. Every exponent is taken relative to maxima over keys the query sees
(in a causal stack: a running maximum over j <= t), so scaled inputs cannot overflow and the future
never enters, not even through a maximum. Maxima only rescale numerator and denominator alike, so
they carry no gradient. Three forms:

- `summary` / `scan`: no biases, all keys or prefix sums (O(n d), quadratic only inside chunks);
- `windowed`: biases only for keys near the query (local, conv): the unbiased sums of the keys
  outside the window (a prefix, and a suffix when bidirectional) plus the window's (`near`): per block
  of queries one product exp(w) @ (exp(K) ⊙ V), elementwise only inside a causal block: O(n s d) flops
  in matrix products, O(n L d) elementwise, no (n, s, d) tensor;
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


def join(x: Sums, y: Sums) -> Sums:
    """The sums of two sets of keys, x's and y's, relative to the larger of their maxima."""
    top = torch.maximum(x[2], y[2])
    safe = _finite(top)
    a, c = (x[2] - safe).exp(), (y[2] - safe).exp()
    return x[0] * a + y[0] * c, x[1] * a + y[1] * c, top


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
    sums = tuple(t[:, :, 0] for t in start)
    carried = []
    # the sums before each chunk; unbind, not indexing: one backward for all chunks, not a full-size one each
    for part in zip(part_num.unbind(2), part_den.unbind(2), top.unbind(2)):
        carried.append(sums)
        sums = join(sums, part)
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
    return join((num, den, top), near(kp, vp, i, window, causal, bias, chunk))[:2]


def near(k: Tensor, v: Tensor, i: int, window: int, causal: bool, bias: Bias, block: int) -> Sums:
    """The sums over the keys u near each of the last i queries t (t - window < u <= t when causal,
    |t - u| < window otherwise) of e^{K_u + w_tu} V_u and e^{K_u + w_tu}, relative to a reference, and
    it: each (b, g, i, d), k and v (b, g, n, d) positioned keys. Queries go in blocks of L, a block's keys
    one slice (unfold) of the keys. Bidirectional (L >= window): one product per block, exp(w - max_u w)
    @ (exp(K - max_u K) ⊙ V). Causal (L <= window): so for the keys before the block (every query of the
    block is after them), and the block's own keys elementwise against each query's running maximum: the
    future never enters, not even through a maximum."""
    b, g, n, d = k.shape
    L = min(block, window) if causal else max(block, window)
    C = -(-i // L)
    before = window - 1
    R = before + L + (0 if causal else window - 1)                       # key slots per block
    first = n - i - before                                              # the key in the first block's slot 0
    at = torch.arange(n - i, n, device=k.device)
    slots = first + L * torch.div(at - (n - i), L, rounding_mode="floor")[:, None] + torch.arange(R, device=k.device)
    offset = slots - at[:, None]                                        # u - t: (i, R)
    inside = (offset > -window) & (offset <= (0 if causal else window - 1))
    w = bias(at, slots.clamp(0, max(n - 1, 0))).masked_fill(~inside, float("-inf"))
    w = F.pad(w, (0, 0, 0, C * L - i), value=float("-inf")).unflatten(-2, (C, L))          # (b|1, g|1, C, L, R)
    if not causal:
        sums = _product(*_slots(k, v, first, R, L, C), w)
    else:           # the block's own keys: (b, g, C, t, u, d)
        ko, vo = (F.pad(x[:, :, n - i:], (0, 0, 0, C * L - i), value=pad).unflatten(2, (C, L))
                  for x, pad in ((k, float("-inf")), (v, 0.0)))
        x = ko[:, :, :, None] + w[..., before:, None]
        own = x.detach().amax(-2)
        e = (x - _finite(own)[..., None, :]).exp()
        sums = ((e * vo[:, :, :, None]).sum(-2), e.sum(-2), own)
        if before:
            sums = join(_product(*_slots(k, v, first, before, L, C), w[..., :before]), sums)
    return tuple(t.reshape(b, g, C * L, d)[:, :, :i] for t in sums)


def _slots(k: Tensor, v: Tensor, first: int, R: int, L: int, C: int) -> tuple[Tensor, Tensor]:
    """Keys first + c L + r (r < R) of k, v (b, g, n, d) for each block c: (b, g, C, R, d) each; -inf keys and
    zero values outside 0 .. n - 1."""
    n = k.shape[2]
    end = first + (C - 1) * L + R
    lo, hi = min(max(first, 0), n), min(max(end, 0), n)
    side = (0, 0, lo - first, end - max(hi, lo))
    return tuple(F.pad(x[:, :, lo:hi], side, value=pad).unfold(2, R, L).transpose(-1, -2)
                 for x, pad in ((k, float("-inf")), (v, 0.0)))


def _product(k: Tensor, v: Tensor, w: Tensor) -> Sums:
    """Σ_u e^{K_u + w_tu} V_u, Σ_u e^{K_u + w_tu} by matrix products, k, v (b, g, C, R, d), w (b|1, g|1, C, L, R),
    relative to max_u K_u + max_u w_tu (an upper bound of the exponents): each (b, g, C, L, d)."""
    top = k.detach().amax(-2, keepdim=True)                             # (b, g, C, 1, d)
    wm = w.detach().amax(-1, keepdim=True)                              # (b|1, g|1, C, L, 1)
    e = (k - _finite(top)).exp()
    p = (w - _finite(wm)).exp()
    return p @ (e * v), p @ e, top + wm


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
