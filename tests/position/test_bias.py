"""Score biases, polyformer/position/bias.py: ALiBi (arXiv:2108.12409) and T5 relative buckets
(arXiv:1910.10683), checked against the papers' rules, explicit computations, and at model level."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.position.bias import AlibiBias, T5Bias, alibi_slopes, t5_buckets
from tests.helpers import ids, tiny_lm



# --- ALiBi ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_alibi_slopes_power_of_two_are_the_geometric_sequence(n):
    """Paper: for n heads the slopes are 2^(-8/n), 2^(-16/n), ..., 2^(-8)."""
    expected = torch.tensor([2.0 ** (-8.0 * i / n) for i in range(1, n + 1)])
    assert_close(alibi_slopes(n), expected)


@pytest.mark.parametrize("n, exponents", [
    # closest power of two below n (c) gives 2^(-8i/c), then every other slope of 2c, in order
    (3, [-4, -8, -2]),
    (6, [-2, -4, -6, -8, -1, -3]),
    (12, [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5]),
    (5, [-2, -4, -6, -8, -1]),
])
def test_alibi_slopes_non_power_of_two(n, exponents):
    assert_close(alibi_slopes(n), torch.tensor([2.0 ** e for e in exponents]))


def test_alibi_bias_is_minus_slope_times_distance():
    alibi = AlibiBias(heads=4)
    q_pos = torch.tensor([[0, 1, 2, 3, 4], [7, 2, 9, 0, 3]])
    k_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [1, 8, 3, 0, 12, 6, 2]])
    bias = alibi(q_pos, k_pos)
    slopes = alibi_slopes(4)
    expected = torch.empty(2, 4, 5, 7)
    for b in range(2):
        for h in range(4):
            for i in range(5):
                for j in range(7):
                    expected[b, h, i, j] = -slopes[h] * abs(int(q_pos[b, i]) - int(k_pos[b, j]))
    assert_close(bias, expected)


def test_alibi_bias_is_translation_invariant_and_symmetric():
    alibi = AlibiBias(heads=4)
    pos = torch.arange(8)[None]
    assert_close(alibi(pos + 100, pos + 100), alibi(pos, pos))
    b = alibi(pos, pos)
    assert_close(b, b.transpose(-1, -2))


def test_alibi_num_heads_leaves_other_heads_unbiased():
    alibi = AlibiBias(heads=8, alibi_heads=3)
    pos = torch.arange(6)[None]
    bias = alibi(pos, pos)
    assert torch.equal(bias[:, 3:], torch.zeros_like(bias[:, 3:]))
    # the biased heads use the slopes of a 3-head model, not the first 3 of an 8-head one
    distance = (pos[0][None, :] - pos[0][:, None]).abs().float()
    for h, slope in enumerate(alibi_slopes(3)):
        assert_close(bias[0, h], -slope * distance)


def test_stack_shared_alibi_zero_for_heads_past_alibi_num_heads():
    layers = Decoder(dim=32, depth=2, heads=4, alibi_pos_emb=True, alibi_num_heads=2)
    pos = torch.arange(10)[None]
    bias = layers.shared_bias(pos, pos)
    assert torch.equal(bias[:, 2:], torch.zeros_like(bias[:, 2:]))
    assert (bias[:, :2][..., ~torch.eye(10, dtype=torch.bool)] < 0).all()
    # every attention block uses that one module
    assert all(b.branch._bias[0] is layers.shared_bias for b in layers.blocks if b.kind == "a")


def test_unbiased_heads_are_position_blind_at_model_level():
    """Encoder with ALiBi on heads 0, 1 only and no other position signal: heads 2, 3 are
    permutation-equivariant (permuting tokens permutes their maps); heads 0, 1 are not."""
    model = tiny_lm(Encoder, depth=1, alibi_pos_emb=True, alibi_num_heads=2)
    assert model.pos_emb is None
    x = ids(batch=1, n=10)
    perm = torch.randperm(10)
    _, maps = model(x, return_attn=True)
    _, maps_p = model(x[:, perm], return_attn=True)
    a, a_p = maps[0], maps_p[0]
    permuted = a[:, :, perm][:, :, :, perm]
    assert_close(a_p[:, 2:], permuted[:, 2:], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(a_p[:, :2], permuted[:, :2], atol=1e-3)


def first_layer_map(model, x: torch.Tensor, bias: torch.Tensor, causal: bool) -> torch.Tensor:
    """The first attention block's weights computed by hand from its weights: softmax(q k^T / sqrt(d)
    + bias), causal or not, with the block's memory key / values (if any) first, unbiased and
    visible to every query. The wrapper must add no absolute positions."""
    block = model.attn_layers.blocks[0]
    h = block.norm_in(model.token_emb(x))
    attn = block.branch
    proj = attn.project
    heads, d = proj.heads, proj.dim_head
    q, k, _ = proj.to_qkv(h).split(proj.split, dim=-1)
    q = q.unflatten(-1, (heads, d)).transpose(1, 2)
    k = k.unflatten(-1, (heads, d)).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) * d ** -0.5 + bias
    if causal:
        n = x.shape[1]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    if attn.memory_kv is not None:
        mem_scores = q @ attn.memory_kv.k.transpose(-1, -2) * d ** -0.5     # (b, h, i, m)
        scores = torch.cat((mem_scores, scores), dim=-1)
    return scores.softmax(-1)


def alibi_matrix(n: int, heads: int = 4) -> torch.Tensor:
    pos = torch.arange(n)
    return -alibi_slopes(heads)[:, None, None] * (pos[None, :] - pos[:, None]).abs().float()


@pytest.mark.parametrize("keyword", ["alibi_pos_emb", "alibi_pos_bias"])
def test_alibi_enters_the_scores_of_a_decoder(keyword):
    model = tiny_lm(depth=1, **{keyword: True})
    x = ids(batch=2, n=10)
    _, maps = model(x, return_attn=True)
    assert_close(maps[0], first_layer_map(model, x, alibi_matrix(10), causal=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stack", [Decoder, Encoder])
def test_memory_key_values_carry_no_alibi_bias(stack):
    """Persistent memory keys have no position: no ALiBi penalty on them, whatever the query."""
    model = tiny_lm(stack, depth=1, alibi_pos_emb=True, attn_num_mem_kv=3)
    x = ids(batch=2, n=10)
    _, maps = model(x, return_attn=True)
    expected = first_layer_map(model, x, alibi_matrix(10), causal=stack is Decoder)
    assert_close(maps[0], expected, atol=1e-5, rtol=1e-5)


def test_alibi_pos_bias_is_alibi_pos_emb():
    a = Decoder(dim=32, depth=2, heads=4, alibi_pos_emb=True, alibi_num_heads=2)
    b = Decoder(dim=32, depth=2, heads=4, alibi_pos_bias=True, alibi_num_heads=2)
    assert a.cfg == b.cfg
    ma, mb = tiny_lm(alibi_pos_emb=True), tiny_lm(alibi_pos_bias=True)
    mb.load_state_dict(ma.state_dict())
    x = ids()
    assert_close(mb(x), ma(x))
    # the two spellings together agree with each other
    Decoder(dim=32, depth=1, heads=4, alibi_pos_emb=True, alibi_pos_bias=True)


# --- T5 relative position buckets ------------------------------------------------------------------

def t5_reference(relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's _relative_position_bucket (mesh-tensorflow / Hugging Face), relative = k_pos - q_pos."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    max_exact = num_buckets // 2
    is_small = relative < max_exact
    large = max_exact + (torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative, large)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (16, 64)])
def test_t5_buckets_equal_reference(causal, num_buckets, max_distance):
    relative = torch.arange(-300, 301)
    assert torch.equal(t5_buckets(relative, causal, num_buckets, max_distance),
                       t5_reference(relative, not causal, num_buckets, max_distance))


def test_t5_causal_buckets():
    """Causal, 32 buckets, max distance 128: distances 0..15 get their own bucket, then
    log-spaced buckets 16 + floor(16 log(n/16) / log 8), clamped at 31; future keys -> bucket 0."""
    past = -torch.arange(0, 16)                                  # k - q for keys in the past
    assert torch.equal(t5_buckets(past, True, 32, 128), torch.arange(0, 16))
    # 16 + floor(16 log(n / 16) / log(8)): 16 -> 16, 31 -> 21 (5.09), 32 -> 21 (5.33),
    # 64 -> 26 (10.67), 127 -> 31 (15.94), 128 -> 32 clamped to 31
    for n, bucket in [(16, 16), (31, 21), (32, 21), (64, 26), (127, 31), (128, 31), (1000, 31),
                      (10 ** 6, 31)]:
        assert int(t5_buckets(torch.tensor([-n]), True, 32, 128)) == bucket, n
    future = torch.arange(1, 300)
    assert torch.equal(t5_buckets(future, True, 32, 128), torch.zeros_like(future))
    # log buckets are monotone in distance and use every bucket
    all_b = t5_buckets(-torch.arange(0, 200), True, 32, 128)
    assert (all_b.diff() >= 0).all()
    assert set(all_b.tolist()) == set(range(32))


def test_t5_bidirectional_buckets_split_by_sign():
    """Bidirectional, 32 buckets: 16 per direction; keys before the query use 0..15, keys after it
    16..31; within each half distances < 8 are exact; the far ends clamp to 15 and 31."""
    d = torch.arange(0, 8)
    assert torch.equal(t5_buckets(-d, False, 32, 128), d)                # past, exact
    assert torch.equal(t5_buckets(d[1:], False, 32, 128), 16 + d[1:])    # future, exact
    rel = torch.arange(-500, 501)
    b = t5_buckets(rel, False, 32, 128)
    assert ((b[rel <= 0] >= 0) & (b[rel <= 0] < 16)).all()
    assert ((b[rel > 0] >= 16) & (b[rel > 0] < 32)).all()
    assert set(b.tolist()) == set(range(32)) - {16}      # distance 0 lives in the first half
    for dist in (1, 5, 20, 100):
        assert int(t5_buckets(torch.tensor([dist]), False, 32, 128)) \
            != int(t5_buckets(torch.tensor([-dist]), False, 32, 128))
    assert int(t5_buckets(torch.tensor([-10 ** 5]), False, 32, 128)) == 15
    assert int(t5_buckets(torch.tensor([10 ** 5]), False, 32, 128)) == 31


def test_t5_bias_looks_up_one_scalar_per_bucket_and_head():
    t5 = T5Bias(heads=4, causal=False, num_buckets=8, max_distance=20)
    q_pos = torch.tensor([[0, 1, 2, 30], [5, 4, 3, 2]])
    k_pos = torch.tensor([[0, 4, 9, 2, 40], [0, 1, 2, 3, 4]])
    bias = t5(q_pos, k_pos)
    w = t5.embedding.weight                                     # (buckets, heads)
    for b in range(2):
        for i in range(4):
            for j in range(5):
                bucket = t5_reference(torch.tensor(int(k_pos[b, j] - q_pos[b, i])), True, 8, 20)
                assert_close(bias[b, :, i, j], w[bucket])


@pytest.mark.parametrize("num_buckets", [32, 16])
def test_t5_bias_is_one_parameter_set_per_stack(num_buckets):
    """rel_pos_bias adds exactly num_buckets * heads parameters, whatever the depth."""
    def count(m):
        return sum(p.numel() for p in m.parameters())

    for depth in (1, 3):
        plain = Decoder(dim=32, depth=depth, heads=4)
        t5 = Decoder(dim=32, depth=depth, heads=4, rel_pos_bias=True, rel_pos_num_buckets=num_buckets)
        assert count(t5) - count(plain) == num_buckets * 4
        assert all(b.branch._bias[0] is t5.shared_bias for b in t5.blocks if b.kind == "a")


def test_t5_bias_enters_the_scores_of_an_encoder():
    model = tiny_lm(Encoder, depth=1, rel_pos_bias=True, rel_pos_num_buckets=8, rel_pos_max_distance=16)
    with torch.no_grad():
        model.attn_layers.shared_bias.embedding.weight.normal_()      # non-trivial bias values
    x = ids(batch=2, n=12)
    _, maps = model(x, return_attn=True)
    pos = torch.arange(12)
    bucket = t5_reference(pos[None, :] - pos[:, None], True, 8, 16)              # (i, j)
    bias = model.attn_layers.shared_bias.embedding.weight[bucket].permute(2, 0, 1)  # (h, i, j)
    assert_close(maps[0], first_layer_map(model, x, bias, causal=False), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_buckets", [2, 3])
def test_small_bidirectional_bucket_counts_are_refused_or_work(num_buckets):
    """rel_pos_num_buckets >= 2 passes the rules, so a bidirectional stack with 2 or 3 buckets (one
    per direction, no exact bucket) must either be refused when built, naming the keyword, or run."""
    try:
        model = tiny_lm(Encoder, rel_pos_bias=True, rel_pos_num_buckets=num_buckets, rel_pos_max_distance=16)
    except ValueError as err:
        assert "rel_pos_num_buckets" in str(err)
        return
    assert torch.isfinite(model(ids())).all()
    buckets = t5_buckets(torch.arange(-20, 21), False, num_buckets, 16)
    assert ((buckets >= 0) & (buckets < num_buckets)).all()


def test_t5_decoder_bias_uses_causal_buckets():
    layers = Decoder(dim=32, depth=1, heads=4, rel_pos_bias=True)
    assert layers.shared_bias.causal
    pos = torch.arange(6)[None]
    bias = layers.shared_bias(pos, pos)
    w = layers.shared_bias.embedding.weight
    # the diagonal is bucket 0 and so are all future keys (masked anyway); distance n is bucket n
    for i in range(6):
        for j in range(6):
            assert_close(bias[0, :, i, j], w[max(i - j, 0)])
