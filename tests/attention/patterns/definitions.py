"""The issue's table of patterns, written out directly: query i, key j (positions), head h, stack
length n -> visible. Independent of polyformer's pattern code, which the tests hold to it."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

H = 4           # heads of every test stack
Rule = Callable[[Tensor, Tensor, Tensor, int, bool], Tensor]    # i (n, 1), j (1, n), head (H, 1, 1), n, causal


def causal_cut(i: Tensor, j: Tensor, causal: bool) -> Tensor:
    return j <= i if causal else torch.ones_like(i - j, dtype=torch.bool)


def window(w: int, d: int | tuple[int, ...] = 1) -> Rule:
    def rule(i, j, h, n, causal):
        dil = torch.tensor(d if isinstance(d, tuple) else (d,) * H)[h]
        k = (i - j) // dil
        on = (i - j) % dil == 0
        return on & ((k >= 0) & (k < w) if causal else k.abs() <= w // 2)
    return rule


def global_tokens(g: int, inner: Rule) -> Rule:
    return lambda i, j, h, n, causal: inner(i, j, h, n, causal) | (((i < g) | (j < g)) & causal_cut(i, j, causal))


def sinks(s: int, inner: Rule) -> Rule:
    return lambda i, j, h, n, causal: inner(i, j, h, n, causal) | ((j < s) & causal_cut(i, j, causal))


def strided(l: int, mode: str) -> Rule:
    def a1(i, j, causal):
        return (i - j >= 0) & (i - j < l) if causal else (i - j).abs() < l

    def a2(i, j, causal):
        return ((i - j) % l == 0) & causal_cut(i, j, causal)

    return _modes(a1, a2, mode)


def fixed(l: int, c: int, mode: str) -> Rule:
    def a1(i, j, causal):
        return (j // l == i // l) & causal_cut(i, j, causal)

    def a2(i, j, causal):
        return (j % l >= l - c) & causal_cut(i, j, causal)

    return _modes(a1, a2, mode)


def _modes(a1: Callable, a2: Callable, mode: str) -> Rule:
    def rule(i, j, h, n, causal):
        if mode == "union":
            return (a1(i, j, causal) | a2(i, j, causal)) & (h >= 0)
        return torch.where(h < H // 2, a1(i, j, causal), a2(i, j, causal))
    return rule


def blockwise(m: int) -> Rule:
    def rule(i, j, h, n, causal):
        size = math.ceil(n / m)
        shift = h // (H // m)
        return j // size == (i // size + shift) % m
    return rule


def block_local(q: int, mem: int) -> Rule:
    def rule(i, j, h, n, causal):
        start = (i // q) * q
        end = start + q + (0 if causal else mem)
        return (j >= start - mem) & (j < end) & causal_cut(i, j, causal) & (h >= 0)
    return rule


def local_2d(image: tuple[int, int], query: tuple[int, int], memory: tuple[int, int]) -> Rule:
    (_, W), (qh, qw), (mh, mw) = image, query, memory

    def rule(i, j, h, n, causal):
        r0, c0 = (i // W) // qh * qh, (i % W) // qw * qw
        rows = (j // W >= r0 - mh) & (j // W < r0 + qh + (0 if causal else mh))
        cols = (j % W >= c0 - mw) & (j % W < c0 + qw + mw)
        return rows & cols & causal_cut(i, j, causal) & (h >= 0)
    return rule


def dilated_counts(segments: tuple[tuple[int, int], ...]) -> Rule:
    """LongNet: how many configurations show key j to query i."""
    def rule(i, j, h, n, causal):
        total = torch.zeros((), dtype=torch.int32)
        for w, r in segments:
            member_i, member_j = (i % w) % r == h % r, (j % w) % r == h % r
            total = total + ((i // w == j // w) & member_i & member_j & causal_cut(i, j, causal)).int()
        return total
    return rule


def bigbird_blocks(b: int, r: int) -> Rule:
    """Hugging Face's BigBird blocks (ceil(n / b) of them, the last partial): the first / last query
    blocks see all, the others blocks 0, q - 1 .. q + 1 and the last; all of it up to (5 + 2 r) b."""
    def rule(i, j, h, n, causal):
        last, qb, kb = math.ceil(n / b) - 1, i // b, j // b
        on = (qb == 0) | (qb == last) | (kb == 0) | (kb == last) | ((qb - kb).abs() <= 1)
        return (on | (n <= (5 + 2 * r) * b)) & (h >= 0)
    return rule


# keyword sets, their definition, and whether they run on a Decoder / an Encoder
CASES: dict[str, tuple[dict[str, Any], Rule, tuple[bool, ...]]] = {
    "window": (dict(attn_window=6), window(6), (True, False)),
    "dilated_window": (dict(attn_window=4, attn_window_dilation=2), window(4, 2), (True, False)),
    "window_dilation_per_head": (dict(attn_window=4, attn_window_dilation=(1, 2, 3, 1)), window(4, (1, 2, 3, 1)),
                                 (True, False)),
    "longformer": (dict(attn_window=6, attn_global_tokens=3), global_tokens(3, window(6)), (True, False)),
    "sinks": (dict(attn_window=6, attn_sink_tokens=2), sinks(2, window(6)), (True,)),
    "strided_heads": (dict(attn_sparse="strided", attn_sparse_stride=5), strided(5, "heads"), (True, False)),
    "strided_union": (dict(attn_sparse="strided", attn_sparse_stride=5, attn_sparse_mode="union"),
                      strided(5, "union"), (True, False)),
    "fixed_heads": (dict(attn_sparse="fixed", attn_sparse_stride=6, attn_sparse_summary=2), fixed(6, 2, "heads"),
                    (True, False)),
    "fixed_union": (dict(attn_sparse="fixed", attn_sparse_stride=6, attn_sparse_summary=2, attn_sparse_mode="union"),
                    fixed(6, 2, "union"), (True, False)),
    "blockwise": (dict(attn_blockwise=2), blockwise(2), (False,)),
    "block_local": (dict(attn_block_local=(8, 5)), block_local(8, 5), (True, False)),
    "local_2d": (dict(attn_local_2d=dict(image=(6, 8), query=(2, 4), memory=(1, 2))),
                 local_2d((6, 8), (2, 4), (1, 2)), (True, False)),
    "bigbird_blocks": (dict(attn_bigbird_blocks=dict(block_size=5, random_blocks=1)), bigbird_blocks(5, 1), (False,)),
}


def dense(rule: Rule, n: int, causal: bool) -> Tensor:
    """(H, n, n) of the rule on positions 0..n-1."""
    i = torch.arange(n).view(n, 1)
    return rule(i, i.view(1, n), torch.arange(H).view(H, 1, 1), n, causal).expand(H, n, n)
