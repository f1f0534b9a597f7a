"""Sparse Sinkhorn attention (kernels/sinkhorn.py, sortnet.py): the balanced sort matrix is doubly
stochastic (bidirectional) or meets the causal balancing's own marginals and never reads a later block
(causal); one block is full attention; the attention equals a by-hand reference built from P; a hard
sort attends to exactly the chosen blocks (SortCut: exactly `sortcut` of them); no future leak; padding
is exact; Gumbel noise only in training; bad options are refused by name."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.attention.kernels.sinkhorn import Sinkhorn, SinkhornOptions
from polyformer.attention.kernels.sortnet import balance
from polyformer.interfaces import KV, KernelSpec
from tests.helpers import ids, tiny_lm


def kernel(causal: bool = False, size: int = 4, heads: int = 2, kv_heads: int | None = None, d: int = 8,
           **options) -> Sinkhorn:
    torch.manual_seed(0)
    spec = KernelSpec(heads=heads, kv_heads=kv_heads or heads, dim_qk=d, dim_v=d, causal=causal, layer=0,
                      scale=d ** -0.5, options=SinkhornOptions(bucket_size=size, **options))
    return Sinkhorn(spec).eval()


def qkv(b=2, h=2, n=10, d=8, hk=None, free=0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hk = hk or h
    return (torch.randn(b, h, n, d, generator=g, dtype=dtype),
            torch.randn(b, hk, free + n, d, generator=g, dtype=dtype),
            torch.randn(b, hk, free + n, d, generator=g, dtype=dtype))


def run(k: Sinkhorn, q, keys, values, pos=None, mask=None, free=0):
    n = keys.shape[2] - free
    pos = torch.arange(n)[None] if pos is None else pos
    return k(q, KV(keys, values, pos, mask, free), q_pos=pos[:, n - q.shape[2]:], causal=k.causal, memory=None,
             need_weights=False).out


def layout(k: Sinkhorn, keys, mask=None):
    n = keys.shape[2]
    return k.layout(keys, keys, KV(keys, keys, torch.arange(n)[None], mask), torch.arange(n)[None], n)


def reference(k: Sinkhorn, q, keys, values, pos, mask, free=0):
    """Each query's keys gathered by hand: slot t of its sorted block (row c, c - 1 causal, the first
    `sortcut` rows with SortCut) is the P-weighted mean of the kept keys at slot t of the blocks, weighted
    by the share of the row's mass on them; its own block (up to itself, causal); the free keys."""
    b, h, i, d = q.shape
    hk, n, size = keys.shape[1], keys.shape[2] - free, k.size
    pos = pos.expand(b, n)
    keep = mask if mask is not None else torch.ones(b, n, dtype=torch.bool)
    lay = k.layout(keys[:, :, free:], values[:, :, free:], KV(keys, values, pos, mask, free), pos[:, n - i:], i)
    p = k.permutation(lay.kb, lay.filled)
    out = torch.zeros(b, h, i, values.shape[-1], dtype=q.dtype)
    for z in range(b):
        if not keep[z].any():
            continue
        base = int(pos[z][keep[z]].min()) // size * size
        block = [(int(pos[z, u]) - base) // size for u in range(n)]
        for head in range(h):
            kh = head // (h // hk)
            for qi in range(i):
                t = n - i + qi
                if not keep[z, t]:
                    continue
                c = block[t]
                rows = range(min(k.sortcut, p.shape[-1])) if k.sortcut else [c - 1] if k.causal else [c]
                logits, vals = [], []
                for r in rows:
                    if r < 0:
                        continue
                    w = p[z, kh, r]
                    for slot in range(size):
                        members = [u for u in range(n) if keep[z, u] and (int(pos[z, u]) - base) % size == slot]
                        mass = sum(w[block[u]] for u in members)
                        if not members or mass == 0:
                            continue
                        key = sum(w[block[u]] * keys[z, kh, free + u] for u in members) / mass
                        logits.append(q[z, head, qi] @ key * k.scale + torch.log(mass / w.sum()))
                        vals.append(sum(w[block[u]] * values[z, kh, free + u] for u in members) / mass)
                own = [] if k.sortcut else [u for u in range(n) if keep[z, u] and block[u] == c
                                            and (not k.causal or pos[z, u] <= pos[z, t])]
                for u in own:
                    logits.append(q[z, head, qi] @ keys[z, kh, free + u] * k.scale)
                    vals.append(values[z, kh, free + u])
                for f in range(free):
                    logits.append(q[z, head, qi] @ keys[z, kh, f] * k.scale)
                    vals.append(values[z, kh, f])
                weights = torch.stack(logits).softmax(0)
                out[z, head, qi] = weights @ torch.stack(vals)
    return out


def padding_mask(b=2, n=10):
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, 3:5] = False          # a hole
    mask[1, :5] = False           # left padding: the row's blocks start at position 4
    return mask


def test_bidirectional_sort_matrix_is_doubly_stochastic():
    """After the iterations (the last one normalises columns) P's rows and columns sum to 1; a block
    holding no kept key has an empty row and column and the others still balance among themselves."""
    k = kernel(iters=20)
    _, keys, _ = qkv(n=16, seed=1)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 4:8] = False                                   # row 1, block 1: nothing kept
    lay = layout(k, keys, mask)
    p = k.permutation(lay.kb, lay.filled)
    filled = torch.tensor([[True] * 4, [True, False, True, True]])[:, None, :]
    assert_close(p.sum(-1), filled.expand_as(p.sum(-1)).double(), atol=1e-3, rtol=0)
    assert_close(p.sum(-2), filled.expand_as(p.sum(-2)).double(), atol=1e-3, rtol=0)
    assert (p[1, :, 1] == 0).all() and (p[1, :, :, 1] == 0).all()
    assert p.max() < 0.999                                  # a soft permutation, not a trivially hard one


def test_causal_sort_matrix_reads_earlier_blocks_only_and_meets_its_marginals():
    """Causal: row r (query block r + 1) weighs blocks j <= r only; at convergence its rows sum to 1 over
    j <= r and its columns to 1 over r' <= j (the column mask is the row mask transposed); the rows of a
    prefix's P are the first rows of the whole P, and changing a later block leaves them as they were."""
    k = kernel(causal=True, iters=60)
    _, keys, _ = qkv(n=20, seed=2)
    lay = layout(k, keys)
    p = k.permutation(lay.kb, lay.filled)
    lower = torch.ones(5, 5, dtype=torch.bool).tril()
    assert (p[..., ~lower] == 0).all() and (p[..., lower] > 0).all()
    assert_close(p.sum(-1), torch.ones_like(p.sum(-1)), atol=1e-3, rtol=0)
    scores, rows, cols = k.sort_scores(lay.kb, lay.filled)
    s = balance(scores, rows, cols, k.iters).exp()
    assert_close((s * cols).sum(-2), torch.ones_like(p.sum(-2)), atol=1e-3, rtol=0)
    prefix = layout(k, keys[:, :, :12])
    assert_close(k.permutation(prefix.kb, prefix.filled), p[..., :3, :3], atol=1e-6, rtol=0)
    changed = keys.clone()
    changed[:, :, 12:] = torch.randn_like(changed[:, :, 12:])
    later = layout(k, changed)
    assert torch.equal(k.permutation(later.kb, later.filled)[..., :3, :], p[..., :3, :])


@pytest.mark.parametrize("causal, sortcut", [(False, None), (True, None), (False, 2)])
def test_one_block_is_full_attention(causal, sortcut):
    """b >= n: one block, P = [1]. Bidirectional, the sorted block is the block itself: every key is
    seen twice, which halves each weight and leaves the softmax as it was (not against memory keys, seen
    once: none there). Causal, block 0 has no sorted block; SortCut sees the one sorted block only."""
    free = 0 if not causal and sortcut is None else 2
    k = kernel(causal=causal, size=16, heads=4, kv_heads=2, sortcut=sortcut)
    q, keys, values = qkv(h=4, hk=2, n=10, free=free, seed=3)
    mask = padding_mask()
    out = run(k, q, keys, values, mask=mask, free=free)
    kk, vv = keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1)
    allowed = torch.cat((torch.ones(2, free, dtype=torch.bool), mask), 1)[:, None, None, :].expand(2, 1, 10, 10 + free)
    if causal:
        allowed = allowed & torch.cat((torch.ones(10, free, dtype=torch.bool), torch.ones(10, 10).tril().bool()), 1)
    scores = (q @ kk.transpose(-1, -2) * k.scale).masked_fill(~allowed, float("-inf"))
    dense = scores.softmax(-1) @ vv
    assert_close(out[mask[:, None].expand(2, 4, 10)], dense[mask[:, None].expand(2, 4, 10)], atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal, sortcut, i", [(False, None, 10), (True, None, 10), (True, None, 3),
                                                (False, 2, 10), (False, 9, 10)])
def test_equals_the_reference_gathered_by_hand(causal, sortcut, i):
    """Partial last block, a hole, a left-padded row (blocks from position 4), memory keys, two query
    heads per key head, queries the last i keys (a decode step's shape)."""
    k = kernel(causal=causal, heads=4, kv_heads=2, sortcut=sortcut, iters=3, temperature=0.5)
    q, keys, values = qkv(h=4, hk=2, n=10, free=2, seed=4)
    mask = padding_mask()
    q = q[:, :, 10 - i:]
    out = run(k, q, keys, values, mask=mask, free=2)
    ref = reference(k, q, keys, values, torch.arange(10)[None], mask, free=2)
    kept = mask[:, None, 10 - i:].expand_as(out[..., 0])
    assert_close(out[kept], ref[kept], atol=1e-10, rtol=0)
    assert (out[~kept] == 0).all()


def hard_sort(k: Sinkhorn, order: list[int], d: int = 8):
    """SortNet weights and keys under which P is (to e⁻²⁸) the permutation row c -> block order[c]:
    block j's keys average to e_j, f(e_c) = 40·e_order[c], so R[c, j] = 40 / √d when j = order[c]."""
    with torch.no_grad():
        net = k.sortnet
        net.w1.copy_(torch.eye(d)), net.b1.zero_(), net.b2.zero_()
        w2 = torch.zeros(d, d)
        w2[torch.arange(len(order)), torch.tensor(order)] = 40.0
        net.w2.copy_(w2)
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(1, 2, len(order), k.size, d, generator=g, dtype=torch.float64)
    blocks = torch.eye(d, dtype=torch.float64)[:len(order)][None, None, :, None] + noise - noise.mean(-2, keepdim=True)
    return blocks.flatten(2, 3)


@pytest.mark.parametrize("sortcut", [None, 2, 4, 7])
def test_hard_sort_attends_to_exactly_the_chosen_blocks(sortcut):
    """With a hard permutation, query block c attends to block order[c] and its own block as dense
    attention over those keys; with SortCut every query attends to the blocks order[0 .. sortcut - 1]
    and nothing else: exactly min(sortcut, blocks) blocks."""
    order = [2, 0, 3, 1]
    k = kernel(temperature=0.5, iters=5, sortcut=sortcut)
    keys = hard_sort(k, order)
    q, _, values = qkv(b=1, n=16, seed=6)
    out = run(k, q, keys, values)
    block = torch.arange(16) // 4
    if sortcut is None:
        seen = (block[None, :] == torch.tensor(order)[block][:, None]) | (block[None, :] == block[:, None])
    else:
        seen = torch.isin(block, torch.tensor(order[:sortcut]))[None, :].expand(16, 16)
    scores = (q @ keys.transpose(-1, -2) * k.scale).masked_fill(~seen, float("-inf"))
    assert_close(out, scores.softmax(-1) @ values, atol=1e-9, rtol=0)


@pytest.mark.parametrize("train", [False, True])
def test_no_future_leak_and_a_step_equals_the_full_forward(train):
    """Changing later queries, keys and values leaves every earlier output bit-identical (in training
    with the same Gumbel draw too); a decode step, the keys so far and the last query, equals the full
    forward's row."""
    k = kernel(causal=True, heads=4, kv_heads=2, iters=4).train(train)
    q, keys, values = qkv(h=4, hk=2, n=13, free=1, seed=7)
    torch.manual_seed(1)
    full = run(k, q, keys, values, free=1)
    for t in (0, 3, 4, 9):
        q2, k2, v2 = q.clone(), keys.clone(), values.clone()
        q2[:, :, t + 1:] += 1.0
        k2[:, :, 1 + t + 1:] = torch.randn_like(k2[:, :, 1 + t + 1:])
        v2[:, :, 1 + t + 1:] += 1.0
        torch.manual_seed(1)
        changed = run(k, q2, k2, v2, free=1)
        assert torch.equal(changed[:, :, :t + 1], full[:, :, :t + 1])
        assert not torch.allclose(changed[:, :, t + 1:], full[:, :, t + 1:])
    if not train:
        for t in range(13):
            step = run(k, q[:, :, t:t + 1], keys[:, :, :1 + t + 1], values[:, :, :1 + t + 1], free=1)
            assert_close(step[:, :, 0], full[:, :, t], atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_is_exact(causal):
    """A length that is no multiple of b equals the same keys padded by hand with masked junk; masked keys'
    contents reach nothing; a left-padded row whose positions count its text equals that text alone."""
    k = kernel(causal=causal, heads=4, kv_heads=2)
    q, keys, values = qkv(h=4, hk=2, n=10, seed=8)
    out = run(k, q, keys, values)
    qx, kx, vx = qkv(h=4, hk=2, n=12, seed=9)
    qx[:, :, :10], kx[:, :, :10], vx[:, :, :10] = q, keys, values
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[:, 10:] = False
    assert_close(run(k, qx, kx, vx, mask=mask)[:, :, :10], out, atol=1e-12, rtol=0)

    mask = padding_mask()
    junk = torch.where(mask[:, None, :, None], keys, torch.randn_like(keys) * 5)
    junk_v = torch.where(mask[:, None, :, None], values, torch.randn_like(values) * 5)
    kept = mask[:, None].expand(2, 4, 10)
    assert_close(run(k, q, junk, junk_v, mask=mask)[kept], run(k, q, keys, values, mask=mask)[kept], atol=1e-12, rtol=0)

    left = torch.ones(1, 15, dtype=torch.bool)
    left[:, :5] = False
    pos = (left.long().cumsum(-1) - 1).clamp(min=0)
    pad = lambda x: torch.cat((torch.randn(1, x.shape[1], 5, 8, dtype=x.dtype), x[:1]), 2)   # noqa: E731
    padded = run(k, pad(q), pad(keys), pad(values), pos=pos, mask=left)[:, :, 5:]
    assert_close(padded, out[:1], atol=1e-12, rtol=0)


def test_gumbel_noise_in_training_only_and_bfloat16():
    k = kernel(causal=False, temperature=0.5)
    q, keys, values = qkv(n=12, seed=10, dtype=torch.float32)
    assert torch.equal(run(k, q, keys, values), run(k, q, keys, values))
    k.train()
    assert not torch.allclose(run(k, q, keys, values), run(k, q, keys, values))
    k.eval()
    low = run(k, q.bfloat16(), keys.bfloat16(), values.bfloat16())
    assert low.dtype == torch.bfloat16
    assert_close(low.float(), run(k, q, keys, values), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("stack, keywords, match", [
    (Encoder, dict(attn_sinkhorn=True, attn_sinkhorn_bucket_size=0), "attn_sinkhorn_bucket_size"),
    (Encoder, dict(attn_sinkhorn=True, attn_sinkhorn_bucket_size=2.5), "attn_sinkhorn_bucket_size"),
    (Encoder, dict(attn_sinkhorn=True, attn_sinkhorn_iters=0), "attn_sinkhorn_iters"),
    (Encoder, dict(attn_sinkhorn=True, attn_sinkhorn_temperature=0.0), "attn_sinkhorn_temperature"),
    (Encoder, dict(attn_sinkhorn=True, attn_sinkhorn_temperature=-1), "attn_sinkhorn_temperature"),
    (Encoder, dict(attn_sinkhorn=True, attn_sinkhorn_temperature=math.inf), "attn_sinkhorn_temperature"),
    (Encoder, dict(attn_sinkhorn=True, attn_sinkhorn_temperature="hot"), "attn_sinkhorn_temperature"),
    (Encoder, dict(attn_sinkhorn=True, attn_sinkhorn_sortcut=0), "attn_sinkhorn_sortcut"),
    (Decoder, dict(attn_sinkhorn=True, attn_sinkhorn_sortcut=2), "attn_sinkhorn_sortcut.*Decoder"),
    (Decoder, dict(attn_sinkhorn_iters=3), "attn_sinkhorn"),
    (Decoder, dict(attn_sinkhorn=True, attn_nystrom_landmarks=4), "attn_sinkhorn"),
])
def test_bad_options_are_refused_by_name(stack, keywords, match):
    with pytest.raises(ValueError, match=match):
        stack(dim=16, depth=1, heads=2, **keywords)


def test_return_attn_is_refused_by_name():
    model = tiny_lm(num_tokens=16, max_seq_len=16, dim=16, depth=1, heads=2, attn_sinkhorn=True)
    with pytest.raises(ValueError, match="attn_sinkhorn"):
        model(ids(1, 8, num_tokens=16), return_attn=True)
