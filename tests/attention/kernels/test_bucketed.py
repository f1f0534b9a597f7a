"""The bucketed core (kernels/bucketed.py) against an explicit reference of its rule, written here query
by query: a query sees the kept keys of its bucket whose rank (by position) falls in its own chunk or
the one before, its chunk being where its position falls among them; causal: positions up to its own;
exclude_self: its own position only when nothing else is visible. Random buckets, causal and not,
padding, separate query / key buckets, more keys than queries; outputs, log-sum-exps, weights and
gradients agree; the scores computed grow as n * chunk; the block layout covers every query once."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer.attention.kernels.bucketed import bucketed


def visible_mask(q_bucket, k_bucket, chunk, causal, q_pos, k_pos, k_mask, exclude_self):
    """(visible, self) (b, h, i, j) bool, by the rule, one query at a time."""
    b, h, i = q_bucket.shape
    j = k_bucket.shape[2]
    q_pos, k_pos = q_pos.expand(b, i), k_pos.expand(b, j)
    seen = torch.zeros(b, h, i, j, dtype=torch.bool)
    own = torch.zeros(b, h, i, j, dtype=torch.bool)
    for z in range(b):
        for y in range(h):
            for t in range(i):
                p = int(q_pos[z, t])
                mine = [u for u in range(j) if int(k_bucket[z, y, u]) == int(q_bucket[z, y, t])
                        and (k_mask is None or bool(k_mask[z, u]))]
                mine.sort(key=lambda u: (int(k_pos[z, u]), u))
                m = sum(int(k_pos[z, u]) < p for u in mine) // chunk
                for rank, u in enumerate(mine):
                    if (m - 1) * chunk <= rank < (m + 1) * chunk and (not causal or int(k_pos[z, u]) <= p):
                        if exclude_self and int(k_pos[z, u]) == p:
                            own[z, y, t, u] = True
                        else:
                            seen[z, y, t, u] = True
    return seen, own


def reference(q, k, v, q_bucket, k_bucket, chunk, causal, q_pos, k_pos, k_mask, scale, exclude_self):
    seen, own = visible_mask(q_bucket, k_bucket, chunk, causal, q_pos, k_pos, k_mask, exclude_self)
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    any_seen = seen.any(-1, keepdim=True)
    masked = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(torch.where(any_seen, masked, torch.zeros_like(masked)), -1)
    weights = torch.where(any_seen, torch.softmax(torch.where(any_seen, masked, torch.zeros_like(masked)), -1),
                          own.to(q.dtype))
    return weights @ v, torch.where(any_seen[..., 0], lse, torch.full_like(lse, float("-inf"))), weights


def case(seed, b=2, h=2, i=13, j=13, d=4, buckets=3, q_buckets=None, padded=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for n in (i, j, j))
    k_bucket = torch.randint(0, buckets, (b, h, j), generator=g)
    q_bucket = (k_bucket[..., -i:] if q_buckets is None else torch.randint(0, q_buckets, (b, h, i), generator=g))
    k_pos = torch.arange(j).expand(b, j).clone()
    k_pos[-1] -= 3                                  # another row's positions (left padding: shifted)
    mask = None
    if padded:
        mask = torch.ones(b, j, dtype=torch.bool)
        mask[-1, :3] = False
        mask[0, 5] = False
    return q, k, v, q_bucket, k_bucket, k_pos[:, -i:], k_pos, mask


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("exclude_self", [True, False])
@pytest.mark.parametrize("shape", [dict(), dict(i=5, j=17), dict(q_buckets=3), dict(i=6, j=6, buckets=1),
                                   dict(i=1, j=9, q_buckets=4), dict(padded=False, buckets=5),
                                   dict(i=40, j=40, buckets=2, b=1), dict(i=40, j=40, q_buckets=6, buckets=6, b=1)])
def test_core_equals_the_rule(causal, exclude_self, shape):
    for chunk in (1, 2, 3, 8):
        q, k, v, qb, kb, qp, kp, mask = case(chunk, **shape)
        q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
        out, lse, weights = bucketed(q, k, v, qb, kb, chunk=chunk, causal=causal, q_pos=qp, k_pos=kp, k_mask=mask,
                                     scale=0.5, exclude_self=exclude_self, need_weights=True)
        ref_out, ref_lse, ref_weights = reference(q, k, v, qb, kb, chunk, causal, qp, kp, mask, 0.5, exclude_self)
        assert_close(out, ref_out)
        assert_close(lse, ref_lse)
        assert_close(weights, ref_weights)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum(), (q, k, v))
        ref_grads = torch.autograd.grad((ref_out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum(),
                                        (q, k, v))
        for got, want in zip(grads, ref_grads):
            assert torch.isfinite(got).all()
            assert_close(got, want)


def test_causal_rule_depends_on_earlier_keys_only():
    """Changing the buckets and vectors of keys after position t leaves the outputs up to t as they were."""
    q, k, v, qb, kb, qp, kp, mask = case(7, i=16, j=16, buckets=3)
    out, _ = bucketed(q, k, v, qb, kb, chunk=2, causal=True, q_pos=qp, k_pos=kp, k_mask=mask, scale=1.0)
    g = torch.Generator().manual_seed(11)
    k2, v2, kb2 = k.clone(), v.clone(), kb.clone()
    k2[:, :, 9:] = torch.randn(k2[:, :, 9:].shape, generator=g, dtype=k.dtype)
    v2[:, :, 9:] += 1.0
    kb2[:, :, 9:] = torch.randint(0, 3, kb2[:, :, 9:].shape, generator=g)
    q2, qb2 = q.clone(), kb2.clone()
    q2[:, :, 9:] += 1.0
    out2, _ = bucketed(q2, k2, v2, qb2, kb2, chunk=2, causal=True, q_pos=qp, k_pos=kp, k_mask=mask, scale=1.0)
    assert_close(out2[:, :, :9], out[:, :, :9])
    assert not torch.allclose(out2[:, :, 9:], out[:, :, 9:])


def test_scores_computed_grow_as_n_times_chunk():
    """O(n * chunk), no (n, n) tensor: with the queries' own buckets (shared QK), the scores computed stay
    under 4 * n * chunk whatever the number of buckets; dense attention would compute n * n."""
    counted = []
    original = torch.bmm

    def spy(a, b_):
        if a.shape[-1] == 4:                    # the score product (blocks, chunk, d) @ (blocks, d, run)
            counted.append(a.shape[0] * a.shape[1] * b_.shape[-1])
        return original(a, b_)

    for buckets in (1, 3, 16, 64, 400):
        q, k, v, qb, kb, qp, kp, mask = case(buckets, b=1, h=2, i=400, j=400, buckets=buckets)
        counted.clear()
        torch.bmm = spy
        try:
            bucketed(q, k, v, qb, kb, chunk=8, causal=False, q_pos=qp, k_pos=kp, k_mask=mask, scale=1.0)
        finally:
            torch.bmm = original
        assert 0 < sum(counted) <= 2 * 4 * 400 * 8, (buckets, sum(counted))


def test_blocks_cover_every_query_once_in_groups_of_similar_runs():
    """Runs of very different lengths go in separate groups (each computed with its own longest run);
    every query sits in exactly one slot of one group."""
    from polyformer.attention.kernels.bucket_blocks import layout

    i, chunk = 96, 4
    order = torch.arange(i)[None]
    lo = torch.arange(i)[None] * 2
    hi = lo + torch.where(torch.arange(i) < 80, 3, 40)[None]             # a few queries read long runs
    blocks = layout(order, lo, hi, torch.arange(i)[None] // chunk, chunk, 400)
    groups = blocks.groups()
    assert len(groups) > 1 and [run for _, run in groups] == sorted(run for _, run in groups)
    slots = torch.cat([blocks.query.view(-1, chunk)[sel].flatten() for sel, _ in groups])
    assert sorted(slots[slots < i].tolist()) == list(range(i))
    assert blocks.cost < len(blocks.length.nonzero()) * max(run for _, run in groups)
