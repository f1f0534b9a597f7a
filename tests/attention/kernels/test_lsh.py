"""LSH attention (kernels/lsh.py, lsh_sort.py): angular hashing is blind to scale; one bucket and one
chunk make it dense shared-QK attention with the self rule; more hash rounds bring it closer to dense
attention; the causal form leaks no future under random rotations (the global sort does); cached
decoding equals the full forward across many chunks; rotations are fixed by a seed or in eval and
redrawn in training; the global sort equals Hugging Face's LSHSelfAttention; the weights it shows are
the ones it uses; bad options are refused by name."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.attention.kernels.lsh import Lsh, LshOptions, lsh_buckets
from polyformer.attention.projection import shared_keys
from polyformer.interfaces import KV, KernelSpec
from tests.helpers import ids, tiny_lm
from tests.options import perturb


def kernel(causal: bool, heads: int = 2, d: int = 8, **options) -> Lsh:
    options.setdefault("shared_qk", True)
    k = Lsh(KernelSpec(heads=heads, kv_heads=heads, dim_qk=d, dim_v=d, causal=causal, layer=0, scale=d ** -0.5,
                       options=LshOptions(**options))).eval()
    k.causal = causal
    return k


def inputs(b=2, h=2, n=12, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, v = torch.randn(b, h, n, d, generator=g, dtype=dtype), torch.randn(b, h, n, d, generator=g, dtype=dtype)
    return q, shared_keys(q), v


def run(k: Lsh, q, keys, v, mask=None, need_weights=False):
    pos = torch.arange(keys.shape[2])[None]
    return k(q, KV(keys, v, pos, mask), q_pos=pos[:, -q.shape[2]:], causal=k.causal, memory=None,
             need_weights=need_weights)


def dense_shared_qk(q, keys, v, causal, mask=None):
    """softmax(q kᵀ / sqrt(d)) v over the kept (earlier) keys, a query's own key only when it sees no other."""
    n, d = q.shape[2], q.shape[3]
    scores = q @ keys.transpose(-1, -2) * d ** -0.5
    keep = torch.ones(n, n, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    keep = keep & (mask[:, None, None, :] if mask is not None else True)
    eye = torch.eye(n, dtype=torch.bool)
    others = keep & ~eye
    use = torch.where(others.any(-1, keepdim=True), others, keep & eye)
    return torch.softmax(scores.masked_fill(~use, float("-inf")), -1) @ v


def padding():
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, 9:] = False
    mask[1, 2:4] = False
    return mask


def test_scaled_vectors_hash_to_the_same_buckets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 50, 8, generator=g)
    rotations = torch.randn(3, 8, 4, 8, generator=g)
    buckets = lsh_buckets(x, rotations)
    assert buckets.shape == (2, 3, 4, 50) and buckets.unique().numel() == 16      # every bucket is used
    for c in (1e-3, 0.5, 7.0, 1e4):
        assert torch.equal(lsh_buckets(c * x, rotations), buckets)
    assert not torch.equal(lsh_buckets(-x, rotations), buckets)           # opposite directions part


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("global_sort", [False, True])
@pytest.mark.parametrize("n_hashes", [1, 3])
def test_one_bucket_and_one_chunk_is_dense_shared_qk_attention(causal, global_sort, n_hashes, monkeypatch):
    """Zero rotations put every vector in bucket 0; a chunk of >= n keys then holds the whole sequence.
    The global sort needs no such help: one chunk holds every position whatever the buckets."""
    if not global_sort:
        monkeypatch.setattr(Lsh, "rotations", lambda self, n_buckets, device: torch.zeros(2, 8, n_hashes, 2))
    k = kernel(causal, bucket_size=12 if not global_sort else 16, n_hashes=n_hashes, n_buckets=4,
             global_sort=global_sort, seed=1)
    q, keys, v = inputs()
    for mask in (None, padding()):
        out = run(k, q, keys, v, mask).out
        ref = dense_shared_qk(q, keys, v, causal, mask)
        rows = mask[:, None, :, None].expand_as(out) if mask is not None else torch.ones_like(out, dtype=torch.bool)
        assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("global_sort", [False, True])
def test_more_hash_rounds_come_closer_to_dense_attention(global_sort):
    """Mean error against dense shared-QK attention over seeds (rotations), for 1, 2, 4, 8 rounds."""
    q, keys, v = inputs(b=4, h=2, n=64, d=16, seed=3)
    ref = dense_shared_qk(q, keys, v, causal=False)
    errors = []
    for rounds in (1, 2, 4, 8):
        err = [(run(kernel(False, d=16, bucket_size=8, n_buckets=8, n_hashes=rounds, seed=s, global_sort=global_sort),
                    q, keys, v).out - ref).abs().mean() for s in range(6)]
        errors.append(float(torch.stack(err).mean()))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors


def test_causal_form_leaks_no_future_under_random_rotations_and_the_global_sort_does():
    torch.manual_seed(0)
    x = ids(2, 32)
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 7) % 64
    leaks = 0
    for seed in range(4):
        for global_sort in (False, True):
            torch.manual_seed(seed)
            model = perturb(tiny_lm(attn_lsh=True, attn_shared_qk=True, attn_lsh_bucket_size=2, attn_lsh_n_buckets=4,
                                    attn_lsh_n_hashes=2, attn_lsh_global_sort=global_sort), seed=seed).train()
            outs = []
            for tokens in (x, y):
                torch.manual_seed(100 + seed)          # the same random rotations for both inputs
                outs.append(model(tokens))
            if global_sort:
                leaks += not torch.allclose(outs[0][:, :20], outs[1][:, :20])
            else:
                assert_close(outs[0][:, :20], outs[1][:, :20])
                assert not torch.allclose(outs[0][:, 20:], outs[1][:, 20:])
    assert leaks > 0, "the global sort's chunk boundaries depend on later tokens"


@pytest.mark.parametrize("shared", [True, False])
def test_cached_decoding_equals_the_full_forward_across_many_chunks(shared):
    """40 tokens, chunks of 2 keys in 4 buckets: about five chunks per bucket, crossed while decoding."""
    keywords = dict(attn_shared_qk=True) if shared else dict(attn_kv_heads=2)
    model = perturb(tiny_lm(max_seq_len=48, attn_lsh=True, attn_lsh_bucket_size=2, attn_lsh_n_buckets=4,
                            attn_lsh_n_hashes=3, rotary_pos_emb=True, seed=0, **keywords), scale=0.05)
    x = ids(2, 40)
    full = model(x)
    state = model.new_state(2, 40)
    steps = [model(x[:, :9], state=state)] + [model(x[:, t:t + 1], state=state) for t in range(9, 33)]
    steps.append(model(x[:, 33:], state=state))
    assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_rotations_fixed_by_seed_or_eval_and_redrawn_in_training():
    k = kernel(False, seed=5, n_hashes=3, n_buckets=6)
    expected = torch.randn((2, 8, 3, 3), generator=torch.Generator().manual_seed(5))
    assert torch.equal(k.rotations(6, torch.device("cpu")), expected)        # Hugging Face's hash_seed draw
    assert torch.equal(k.train().rotations(6, torch.device("cpu")), expected)
    free = kernel(False, n_hashes=3, n_buckets=6)
    assert torch.equal(free.rotations(6, torch.device("cpu")), free.rotations(6, torch.device("cpu")))
    free.train()
    assert not torch.equal(free.rotations(6, torch.device("cpu")), free.rotations(6, torch.device("cpu")))

    model = tiny_lm(Encoder, attn_lsh=True, attn_shared_qk=True, attn_lsh_bucket_size=2, attn_lsh_n_hashes=2, seed=0)
    x = ids(2, 24)
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.allclose(model(x), model(x))


@pytest.mark.parametrize("causal", [True, False])
def test_global_sort_equals_hugging_face_lsh_self_attention(causal):
    transformers = pytest.importorskip("transformers")
    from transformers.models.reformer.modeling_reformer import LSHSelfAttention

    config = transformers.ReformerConfig(hidden_size=16, num_attention_heads=2, attention_head_size=8, num_hashes=3,
                                         num_buckets=4, lsh_attn_chunk_length=4, lsh_num_chunks_before=1,
                                         lsh_num_chunks_after=0, hash_seed=7, is_decoder=causal,
                                         lsh_attention_probs_dropout_prob=0.0, attn_layers=["lsh"])
    with torch.random.fork_rng():                     # Hugging Face reseeds the global generator
        torch.manual_seed(0)
        hf = LSHSelfAttention(config).eval()
        x = torch.randn(2, 16, 16)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 13:] = 0
        theirs = [hf(x).hidden_states, hf(x, attention_mask=mask).hidden_states]
    ours = kernel(causal, n_hashes=3, n_buckets=4, bucket_size=4, seed=7, global_sort=True)
    q = hf.query_key(x).view(2, 16, 2, 8).transpose(1, 2)
    v = hf.value(x).view(2, 16, 2, 8).transpose(1, 2)
    for got_mask, want in zip((None, mask.bool()), theirs):
        found = run(ours, q, shared_keys(q), v, got_mask, need_weights=True)
        out = found.out.transpose(1, 2).reshape(2, 16, 16)
        keep = got_mask if got_mask is not None else torch.ones(2, 16, dtype=torch.bool)
        # a token that sees only itself in every round (the first, causal) takes its own value; Hugging Face
        # gets it through scores of -1e5 in float32, whose rounding leaves the rounds' weights summing to ~0.997
        alone = (found.weights.diagonal(dim1=-2, dim2=-1) == 1).transpose(1, 2).repeat_interleave(8, -1)
        assert alone[:, 0].all() == causal
        assert_close(out[alone], v.transpose(1, 2).reshape(2, 16, 16)[alone])
        assert_close(want[alone], out[alone], atol=0, rtol=1e-2)
        keep = keep[..., None] & ~alone
        assert_close(out[keep], want[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("global_sort", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_weights_shown_are_the_weights_used(global_sort, causal):
    k = kernel(causal, bucket_size=3, n_hashes=3, n_buckets=4, seed=2, global_sort=global_sort)
    q, keys, v = inputs(n=13)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :3] = False
    found = run(k, q, keys, v, mask, need_weights=True)
    assert_close(found.out, found.weights @ v)
    assert_close(found.weights[1, :, 3:].sum(-1), torch.ones(2, 10, dtype=q.dtype))
    assert (found.weights[1, :, :, :3] == 0).all()                     # padded keys get nothing
    if causal:
        assert (found.weights.triu(1) == 0).all()
    assert (found.weights > 0).sum() < 2 * 2 * 13 * 13 * 0.8            # sparse: not every pair


def test_lengths_not_divisible_by_the_bucket_are_padded_exactly():
    k = kernel(False, bucket_size=4, n_hashes=2, n_buckets=4, seed=0, global_sort=True)
    q, keys, v = inputs(n=16)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[:, 13:] = False
    short = run(k, q[:, :, :13], keys[:, :, :13], v[:, :, :13]).out
    assert_close(short, run(k, q, keys, v, mask).out[:, :, :13])


def test_bfloat16_follows_float32():
    k = kernel(True, bucket_size=4, n_hashes=2, n_buckets=4, seed=0)
    q, keys, v = inputs(dtype=torch.float32)
    out = run(k, q.bfloat16(), keys.bfloat16(), v.bfloat16()).out
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), run(k, q, keys, v).out, atol=0.05, rtol=0.05)


def test_shared_qk_keys_are_the_normalised_queries_and_have_no_weights():
    plain = tiny_lm(attn_lsh=True, attn_lsh_n_buckets=4, seed=0)
    shared = tiny_lm(attn_lsh=True, attn_shared_qk=True, attn_lsh_n_buckets=4, seed=0)
    project = shared.attn_layers.blocks[0].branch.project
    assert project.to_qkv.out_features == 2 * 4 * 64 < plain.attn_layers.blocks[0].branch.project.to_qkv.out_features
    from polyformer.attention.keys import self_source
    from polyformer.interfaces import Context

    x = torch.randn(2, 5, 32)
    ctx = Context(pos=torch.arange(5)[None])
    q, kv = project(x, self_source(x, ctx, 0), ctx.pos)
    assert_close(kv.k, q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert_close(kv.k.norm(dim=-1), torch.full((2, 4, 5), 8.0), atol=1e-4, rtol=1e-4)   # length sqrt(64)


@pytest.mark.parametrize("keywords, named", [
    (dict(attn_lsh_n_hashes=0), "attn_lsh_n_hashes"),
    (dict(attn_lsh_bucket_size=0), "attn_lsh_bucket_size"),
    (dict(attn_lsh_n_buckets=3), "attn_lsh_n_buckets must be even"),
    (dict(attn_lsh_n_buckets=None), "needs attn_lsh_n_buckets"),
    (dict(attn_lsh_global_sort=True, attn_shared_qk=False), "needs attn_shared_qk=True"),
    (dict(attn_shared_qk=True, attn_kv_heads=2), "attn_kv_heads"),
    (dict(attn_shared_qk=True, attn_collab_heads=True), "attn_collab_heads"),
    (dict(attn_num_mem_kv=2), "attn_num_mem_kv"),
    (dict(attn_dropout=0.1), "attn_dropout"),
    (dict(alibi_pos_emb=True), "alibi_pos_emb"),
    (dict(rel_pos_bias=True), "rel_pos_bias"),
    (dict(attn_lsh_seed=1.5), "attn_lsh_seed"),
])
def test_bad_options_are_named(keywords, named):
    with pytest.raises(ValueError, match=named):
        Decoder(**{**dict(dim=32, depth=1, heads=4, attn_lsh=True, attn_lsh_n_buckets=4), **keywords})


def test_shared_qk_needs_lsh_and_the_global_sort_cannot_decode():
    with pytest.raises(ValueError, match="attn_shared_qk need.* attn_lsh"):
        Decoder(dim=32, depth=1, attn_shared_qk=True)
    model = tiny_lm(attn_lsh=True, attn_shared_qk=True, attn_lsh_global_sort=True, attn_lsh_n_buckets=4, seed=0)
    state = model.new_state(1, 8)
    model(ids(1, 4), state=state)                       # the prompt: the queries' own sequence
    with pytest.raises(ValueError, match="attn_lsh_global_sort=True .* cannot read cached keys"):
        model(ids(1, 1), state=state)
