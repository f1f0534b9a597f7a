"""Routing attention (kernels/routing.py, kmeans.py): one cluster with a window covering the sequence
is full (causal) attention and the local heads are attn_window's rule; a query sees keys of its own
cluster only, in its chunk and the previous one; assignment is to the nearest centroid; centroids move
by the EMA rule, in differentiated training forwards only (a recomputation inside backward, by gradient
checkpointing or reversible layers, routes as its forward did); the commitment loss is its formula and
reaches the wrapper's record and AutoregressiveWrapper's loss; causal routing leaks nothing from the
future; bad options are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder
from polyformer.attention.kernels.kmeans import OnlineKmeans, unit
from polyformer.attention.kernels.routing import Routing, RoutingOptions
from polyformer.interfaces import KV, KernelSpec
from polyformer.keywords import parse_layers
from tests.helpers import ids, tiny_lm


def kernel(h: int = 2, d: int = 8, causal: bool = True, window_heads: int | None = None, **options) -> Routing:
    pattern = parse_layers(dict(dim=16, depth=1, attn_window=window_heads)).attention.pattern if window_heads else ()
    return Routing(KernelSpec(heads=h, kv_heads=h, dim_qk=d, dim_v=d, causal=causal, layer=0,
                              scale=d ** -0.5, options=RoutingOptions(**options), pattern=pattern)).eval()


def qkv(b=2, h=2, n=12, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g) for _ in range(3))


def run(k: Routing, q, keys, values, causal=True, mask=None, free=0):
    pos = torch.arange(keys.shape[2] - free)[None]
    return k(q, KV(keys, values, pos, mask, free), q_pos=pos[:, -q.shape[2]:], causal=causal, memory=None,
             need_weights=False)


def dense(q, k, v, keep):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def clusters_of(k: Routing, q, keys):
    return k.kmeans(q, keys, None)[:2]


@pytest.mark.parametrize("causal", [True, False])
def test_one_cluster_and_a_covering_window_is_full_attention_and_local_heads_are_the_window(causal):
    """Heads 0-1 route (one cluster, window 16 >= n): dense (causal) attention over the kept keys;
    heads 2-3 are local: attn_window=4's rule (causal i - 4 < j <= i, else |i - j| <= 2)."""
    q, k, v = qkv(h=4)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, 2] = mask[1, 7:9] = False
    out = run(kernel(4, causal=causal, window_heads=4, clusters=1, window=16, heads=2), q, k, v, causal, mask).out
    t = torch.arange(12)
    delta = t[:, None] - t[None, :]
    full = (delta >= 0) if causal else torch.ones(12, 12, dtype=torch.bool)
    window = ((delta >= 0) & (delta < 4)) if causal else delta.abs() <= 2
    keep = mask[:, None, None, :]
    assert_close(out[:, :2], dense(q[:, :2], k[:, :2], v[:, :2], full & keep), atol=1e-5, rtol=1e-5)
    assert_close(out[:, 2:], dense(q[:, 2:], k[:, 2:], v[:, 2:], window & keep), atol=1e-5, rtol=1e-5)


def test_one_cluster_decoder_equals_the_dense_decoder_with_memory_key_values():
    """Through a whole model: the routed heads with one cluster are the dense stack, memory key / values
    (seen beside every cluster, merged by log-sum-exp) included."""
    x = ids(2, 12)
    base = tiny_lm(max_seq_len=16, seed=0, attn_num_mem_kv=2, rotary_pos_emb=True)
    routed = tiny_lm(max_seq_len=16, attn_num_mem_kv=2, rotary_pos_emb=True, attn_routing=True,
                     attn_routing_clusters=1, attn_routing_window=16)
    missing = routed.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert all(name.endswith("kmeans.centroids") for name in missing) and missing
    assert_close(routed(x), base(x), atol=1e-5, rtol=1e-5)


def rule(q_ids, k_ids, n, window, causal):
    """The explicit rule (b, h, i, j): key j is in query i's cluster, its chunk (its rank among the
    cluster's keys by position, // window) is the query's or the one before, where the query's chunk is
    the number of its cluster's keys before its position // window; causal: j <= i."""
    same = q_ids[..., :, None] == k_ids[..., None, :]                              # (b, h, i, j)
    t = torch.arange(n)
    member = k_ids[..., None, :] == k_ids[..., :, None]                            # (b, h, j', j)
    k_chunk = (member & (t[None, :] < t[:, None])).sum(-1) // window              # keys of j's cluster before j
    before = (same & (t[None, :] < t[:, None])).sum(-1) // window                 # (b, h, i)
    gap = before[..., :, None] - k_chunk[..., None, :]
    near = (gap == 0) | (gap == 1)
    return same & near & ((t[None, :] <= t[:, None]) if causal else True)


@pytest.mark.parametrize("causal", [True, False])
def test_a_query_sees_its_clusters_keys_in_its_chunk_and_the_previous_one(causal):
    q, k, v = qkv(n=16)
    routing = kernel(causal=causal, clusters=3, window=2)
    q_ids, k_ids = clusters_of(routing, q, k)
    keep = rule(q_ids, k_ids, 16, 2, causal)
    assert keep.sum() < 0.5 * keep.numel() and keep.any(-1).float().mean() > 0.5      # sparse, yet not empty
    expected = torch.nan_to_num(dense(q, k, v, keep))                              # a query seeing nothing: 0
    assert_close(run(routing, q, k, v, causal).out, expected, atol=1e-5, rtol=1e-5)


def test_keys_of_other_clusters_are_invisible():
    q, k, v = qkv(n=16)
    routing = kernel(clusters=3, window=16)
    q_ids, k_ids = clusters_of(routing, q, k)
    out = run(routing, q, k, v).out
    for b in range(2):
        for h in range(2):
            other = k_ids[b, h] != q_ids[b, h, 5]
            v2 = v.clone()
            v2[b, h, other] += 10.0
            assert_close(run(routing, q, k, v2).out[b, h, 5], out[b, h, 5])
            if (~other[:6]).any():
                v2[b, h, ~other] += 1.0
                assert not torch.allclose(run(routing, q, k, v2).out[b, h, 5], out[b, h, 5])


def test_assignment_is_to_the_nearest_centroid():
    """Nearest to x / ||x|| (the routing runs on the unit sphere), whatever x's length."""
    km = OnlineKmeans(heads=3, clusters=5, dim=8, decay=0.9, seed=0).eval()
    x = torch.randn(2, 3, 20, 8) * torch.rand(2, 3, 20, 1) * 10
    q_ids, _, _ = km(x, x, None)
    nearest = torch.cdist(unit(x), km.centroids[None].expand(2, -1, -1, -1)).argmin(-1)
    assert torch.equal(q_ids, nearest)
    assert len(q_ids.unique()) > 1


def test_centroids_move_toward_their_members_by_the_ema_rule_in_training_only():
    """mu <- normalise(decay mu + (1 - decay) mean of its kept members (queries and keys)); a
    cluster without members stays; nothing moves in eval."""
    decay = 0.8
    km = OnlineKmeans(heads=2, clusters=4, dim=6, decay=decay, seed=1)
    q, k = torch.randn(2, 2, 7, 6), 3 * torch.randn(2, 2, 7, 6)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, :3] = False
    before = km.centroids.clone()
    km.eval()
    km(q, k, keep)
    assert torch.equal(km.centroids, before)
    km.train()
    q_ids, k_ids, _ = km(q, k, keep)
    q, k = unit(q), unit(k)
    for h in range(2):
        for c in range(4):
            members = [x[b, h, t] for x, i in ((q, q_ids), (k, k_ids)) for b in range(2) for t in range(7)
                       if keep[b, t] and i[b, h, t] == c]
            if not members:
                assert torch.equal(km.centroids[h, c], before[h, c])
                continue
            mean = torch.stack(members).mean(0)
            assert_close(km.centroids[h, c], F.normalize(decay * before[h, c] + (1 - decay) * mean, dim=-1))
            assert km.centroids[h, c] @ mean > before[h, c] @ mean       # toward its members
    assert not torch.equal(km.centroids, before)


def test_commitment_loss_is_its_formula():
    q, k, v = qkv(n=10)
    routing = kernel(clusters=3, window=4, commitment=0.5)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :4] = False
    out = run(routing, q, k, v, mask=mask)
    c = routing.kmeans.centroids
    qu, ku = unit(q), unit(k)
    q_ids, k_ids = clusters_of(routing, q, k)
    d2 = [(x - c[torch.arange(2)[:, None], i]).square().sum(-1) for x, i in ((qu, q_ids), (ku, k_ids))]
    keep = mask[:, None, :].expand(2, 2, 10)
    expected = torch.cat([d[keep] for d in d2]).mean()
    assert_close(out.losses.terms["routing_commitment"], expected)
    assert out.losses.weights["routing_commitment"] == 0.5


def test_commitment_loss_reaches_the_record_and_the_autoregressive_loss():
    """Loss with weight w == loss with weight 0 + w * the recorded term (summed over the layers)."""
    x = ids(2, 12)
    nets = []
    for w in (0.0, 0.3):
        nets.append(tiny_lm(max_seq_len=16, seed=0, attn_routing=True, attn_routing_clusters=2,
                            attn_routing_window=4, attn_routing_commitment=w))
    _, record = nets[0](x[:, :-1], return_intermediates=True)
    term = record.losses.terms["routing_commitment"]
    assert term > 0 and record.losses.weights["routing_commitment"] == 0.0
    plain, weighted = AutoregressiveWrapper(nets[0])(x), AutoregressiveWrapper(nets[1])(x)
    assert_close(weighted, plain + 0.3 * term)


def test_causal_routing_leaks_no_future():
    """Random centroids and inputs: changing queries, keys and values after t (which moves later keys
    between clusters and would move chunk boundaries in a global sort) leaves outputs up to t as they were."""
    q, k, v = qkv(n=16, seed=3)
    routing = kernel(clusters=3, window=2)
    out = run(routing, q, k, v).out
    for t in (3, 8, 12):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):
            x[:, :, t + 1:] = torch.randn(x[:, :, t + 1:].shape)
        changed = run(routing, q2, k2, v2).out
        assert_close(changed[:, :, :t + 1], out[:, :, :t + 1], rtol=0, atol=0)
        assert not torch.allclose(changed[:, :, t + 1:], out[:, :, t + 1:])


def test_eval_is_deterministic_and_only_differentiated_training_forwards_move_centroids():
    model = tiny_lm(Encoder, max_seq_len=16, depth=1, seed=0, attn_routing=True, attn_routing_clusters=3,
                    attn_routing_window=4)
    centroids = model.attn_layers.blocks[0].branch.kernel.kmeans.centroids
    before = centroids.clone()
    x = ids(2, 12)
    assert torch.equal(model(x), model(x))
    assert torch.equal(centroids, before)
    model.train()
    with torch.no_grad():                   # a training forward autograd will not differentiate
        model(x)
    assert torch.equal(centroids, before)
    model(x)
    assert not torch.equal(centroids, before)


@pytest.mark.parametrize("policy", ["gradient_checkpointing", "reversible"])
def test_a_recomputation_in_backward_routes_with_the_centroids_of_its_forward(policy):
    """Gradient checkpointing and reversible layers recompute each block inside backward, after the
    centroids moved: the gradients equal those of the stack run without recomputation (checkpointing off;
    the reversible pairs as a plain loop, which return_attn takes), and the centroids move once (decay 0.5:
    big moves)."""
    x = ids(2, 12)
    grads, centroids = [], []
    for recompute in (False, True):
        model = tiny_lm(max_seq_len=16, seed=0, attn_routing=True, attn_routing_clusters=3, attn_routing_window=2,
                        attn_routing_decay=0.5, **{policy: recompute or policy == "reversible"}).train()
        out = model(x, return_attn=not recompute)
        (out[0] if not recompute else out).logsumexp(-1).mean().backward()
        grads.append([p.grad for p in model.parameters()])
        centroids.append([b.kmeans.centroids for b in model.modules() if isinstance(b, Routing)])
    for a, b in zip(*grads):
        assert_close(a, b)
    for a, b in zip(*centroids):
        assert_close(a, b)


@pytest.mark.parametrize("keywords, match", [
    (dict(attn_routing_clusters=0), "attn_routing_clusters"),
    (dict(attn_routing_window=0), "attn_routing_window"),
    (dict(attn_routing_heads=0), "attn_routing_heads"),
    (dict(attn_routing_heads=5), r"attn_routing_heads must be in \[1, heads=4\]"),
    (dict(attn_routing_decay=0.0), "attn_routing_decay"),
    (dict(attn_routing_decay=1.0), "attn_routing_decay"),
    (dict(attn_routing_commitment=-1.0), "attn_routing_commitment"),
    (dict(attn_window=4), "attn_routing_heads below 4"),
    (dict(attn_routing_heads=2), "need attn_window"),
    (dict(attn_routing_heads=2, attn_window=4, attn_global_tokens=1), "attn_global_tokens"),
    (dict(attn_routing_heads=2, attn_window=4, attn_window_dilation=2), "attn_window_dilation"),
    (dict(attn_dropout=0.1), "attn_dropout"),
    (dict(alibi_pos_emb=True), "alibi_pos_emb"),
])
def test_bad_options_are_refused_by_name(keywords, match):
    with pytest.raises(ValueError, match=match):
        Decoder(dim=32, depth=1, heads=4, attn_routing=True, **keywords)


def test_options_without_the_switch_are_refused():
    with pytest.raises(ValueError, match="attn_routing_clusters need.* attn_routing"):
        Decoder(dim=32, depth=1, heads=4, attn_routing_clusters=4)


def test_return_attn_weights_give_the_output():
    """The weights (routing heads with memory key / values, local heads) are each query's softmax rows
    over the keys it sees: rows sum to 1 and weights @ values is the output."""
    q, k, v = qkv(h=4, n=14)
    q = q[:, :, 2:]                                     # 2 memory key / values, then 12 positions
    routing = kernel(4, window_heads=4, clusters=2, window=3, heads=2)
    plain = run(routing, q, k, v, free=2)
    pos = torch.arange(12)[None]
    shown = routing(q, KV(k, v, pos, None, 2), q_pos=pos, causal=True, memory=None, need_weights=True)
    assert plain.weights is None
    assert_close(shown.out, plain.out)
    assert_close(shown.weights.sum(-1), torch.ones(2, 4, 12))
    assert_close(shown.weights @ v, shown.out, atol=1e-5, rtol=1e-5)


def test_bfloat16_model_keeps_float32_centroids_that_move():
    """A cast keeps the centroids in float32: one EMA step (1e-3 of a unit vector) is below bfloat16's
    resolution, so bfloat16 centroids would never move."""
    model = tiny_lm(max_seq_len=16, depth=1, seed=0, attn_routing=True, attn_routing_clusters=3,
                    attn_routing_window=4).to(torch.bfloat16).train()
    centroids = model.attn_layers.blocks[0].branch.kernel.kmeans.centroids
    before = centroids.clone()
    logits = model(ids(2, 12))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert centroids.dtype == torch.float32 and (centroids - before).abs().max() > 0
