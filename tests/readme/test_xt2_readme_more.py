"""x-transformers 2.31.10's README, from Rotary Positional Embeddings to the end (Miscellaneous), as
tests (see test_xt2_readme.py). resi_dual, attn_head_scale, scale_residual and
XValTransformerWrapper / XValAutoregressiveWrapper: test_xt2_readme_extra.py.

Each block keeps its keywords and call pattern; sizes are ours (xt2_checks: dim 32, depth 2, seq 16,
256 tokens); `.cuda()` is dropped; a block that misses its own import gets it. A block that only builds
`TransformerWrapper(num_tokens, max_seq_len, attn_layers = Decoder(dim, depth, heads, ...))` (or an
Encoder) is built by `lm(...)` (`enc(...)`) with its keywords as written. Each test asserts what the
block claims."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyformer import (AutoregressiveWrapper, ContinuousAutoregressiveWrapper, ContinuousTransformerWrapper,
                        CrossAttender, Decoder, Encoder, TransformerWrapper)
from polyformer.interfaces import KV
from tests.readme.xt2_checks import (DEPTH, DIM, NUM, SEQ, assert_cached_generation, assert_causal,
                                     assert_finite, assert_trains, ids, lm)


@torch.no_grad()
def assert_relative(model: TransformerWrapper, offset: int = 5) -> None:
    """Relative positions only: moving the whole sequence by `offset` positions changes nothing."""
    x = ids()
    pos = torch.arange(SEQ)[None]
    torch.testing.assert_close(model.eval()(x, pos = pos + offset), model(x, pos = pos), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# positions

def test_rotary_positional_embeddings():
    model = lm(rotary_pos_emb = True)  # turns on rotary positional embeddings
    assert model.pos_emb is None
    assert_relative(model)
    assert_causal(model, ids())
    assert_cached_generation(model)


def test_rotary_xpos():
    model = lm(rotary_xpos = True)   # modified rotary to extrapolate well beyond length at which it was trained
    assert_relative(model)
    assert model(ids(3 * SEQ)).shape == (1, 3 * SEQ, NUM)      # beyond max_seq_len
    assert_cached_generation(model)


def test_dynamic_position_bias():
    model = lm(
        dynamic_pos_bias = True,                # set this to True
        dynamic_pos_bias_log_distance = False   # whether to use log distance, as in SwinV2
    ).eval()
    pos = torch.arange(3 * SEQ)[None]           # a bias for any distance, also beyond max_seq_len
    bias = model.attn_layers.shared_bias(pos, pos)[0]
    torch.testing.assert_close(bias[:, 1:, 1:], bias[:, :-1, :-1])
    assert_relative(model)
    assert_cached_generation(model)


def test_alibi_on_some_heads():
    model = lm(
        alibi_pos_bias = True, # turns on ALiBi positional embedding
        alibi_num_heads = 4    # only use ALiBi for 4 out of the 8 heads, so other 4 heads can still attend far distances
    )
    pos = torch.arange(SEQ)[None]
    bias = model.attn_layers.shared_bias(pos, pos).reshape(-1, 8, SEQ, SEQ)[0]
    distance = (pos[0, None, :] - pos[0, :, None]).abs().float()
    slopes = -bias[:4, 1, 0]                    # a linear penalty per head on the first 4, none on the rest
    assert (slopes > 0).all()
    torch.testing.assert_close(bias[:4], -slopes[:, None, None] * distance)
    assert (bias[4:] == 0).all()
    assert_cached_generation(model)


# ------------------------------------------------------------------------------------------------
# shifted tokens, norms

def test_shift_tokens():
    model = lm(shift_tokens = 1)
    shift = model.attn_layers.blocks[0].shift
    h = torch.randn(1, 5, DIM)
    out = shift(h)              # half the features come from the previous position
    torch.testing.assert_close(out[..., :DIM // 2], h[..., :DIM // 2])
    torch.testing.assert_close(out[:, 1:, DIM // 2:], h[:, :-1, DIM // 2:])
    assert not out[:, 0, DIM // 2:].any()
    assert all(b.shift is not None for b in model.attn_layers.blocks)
    assert_cached_generation(model)


def test_shift_tokens_per_block():
    model = lm(
        depth = 6,
        shift_tokens = (1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0) # 12 blocks, attention and feedforward alternating, with progressively less shifting
    )
    assert [b.shift is not None for b in model.attn_layers.blocks] == [True] * 6 + [False] * 6
    assert_causal(model, ids())


def test_sandwich_norm():
    model = lm(sandwich_norm = True) # set this to True
    x = torch.randint(0, NUM, (1, SEQ))
    out = model(x)
    with torch.no_grad():       # each branch's output is layernormed before it joins the residual stream
        _, record = model.eval()(x, return_intermediates = True)
    for before, after in zip(record.hiddens[:-2], record.hiddens[1:-1]):
        update = after - before
        torch.testing.assert_close(update.mean(-1), torch.zeros(1, SEQ), atol=1e-5, rtol=0)
        torch.testing.assert_close(update.var(-1, unbiased=False), torch.ones(1, SEQ), atol=1e-2, rtol=0)
    assert_trains(out.logsumexp(-1).mean(), model)


def test_normformer_ff_post_act_ln():
    model = lm(ff_post_act_ln = True) # set this to True
    ff = model.attn_layers.blocks[1].branch
    h = torch.randn(2, 5, DIM)
    inner = F.gelu(ff.proj_in(h))
    normed = F.layer_norm(inner, inner.shape[-1:], ff.post_act.weight, ff.post_act.bias)
    torch.testing.assert_close(ff(h), ff.proj_out(normed))
    assert_causal(model, ids())


def _normed_scores(model: TransformerWrapper, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The first attention block's qk-normed scores (the kernel's d ** -0.5 included)."""
    attn = model.attn_layers.blocks[0].branch
    q_n, kv = attn.qk_norm(q, KV(k=k, v=k, pos=None, mask=None))
    return q_n @ kv.k.transpose(-1, -2) * q.shape[-1] ** -0.5


def test_cosine_sim_grouped():
    model = lm(
        attn_qk_norm = True,       # set this to True
        attn_qk_norm_groups = 8    # number of groups in the feature dimension for l2norm, similarity scores will be bounded between [-group, group]. determines how sharp the attention can be
    )
    q, k = torch.randn(1, 8, 5, 64), torch.randn(1, 8, 5, 64)
    scores = _normed_scores(model, q, k)
    cos = F.cosine_similarity(q.view(1, 8, 5, 1, 8, 8), k.view(1, 8, 1, 5, 8, 8), dim=-1).sum(-1)
    torch.testing.assert_close(scores, 10 * cos)       # scale 10 on a sum of 8 group cosines
    assert_causal(model, ids())


def test_cosine_sim_scale():
    model = lm(
        attn_qk_norm = True,       # set to True
        attn_qk_norm_scale = 10    # new scale on the similarity, with groups of 1
    )
    q, k = torch.randn(1, 8, 5, 64), torch.randn(1, 8, 5, 64)
    scores = _normed_scores(model, q, k)
    torch.testing.assert_close(scores, 10 * F.cosine_similarity(q[..., :, None, :], k[..., None, :, :], dim=-1))
    assert scores.abs().max() <= 10
    assert_cached_generation(model)


def test_qk_rmsnorm_dim_scale():
    model = lm(
        attn_qk_norm = True,
        attn_qk_norm_dim_scale = True # set this to True, in addition to `attn_qk_norm = True`
    )
    q, k = torch.randn(1, 8, 5, 64), torch.randn(1, 8, 5, 64)
    # learned per-feature scales, which start where the scores are the plain cosine similarity
    cos = F.cosine_similarity(q[..., :, None, :], k[..., None, :, :], dim=-1)
    torch.testing.assert_close(_normed_scores(model, q, k), cos)
    assert_trains(model(ids()).logsumexp(-1).mean(), model)


def test_no_absolute_positions():
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        use_abs_pos_emb = False,   # set this to False
        attn_layers = Decoder(
            dim = DIM,
            depth = 1,
            heads = 8,
        )
    ).eval()
    assert model.pos_emb is None
    x = ids()
    shuffled = x.clone()
    shuffled[:, :-1] = x[:, :-1].flip(1)
    with torch.no_grad():       # one layer, no positions: the last token reads its past as a set
        torch.testing.assert_close(model(shuffled)[:, -1], model(x)[:, -1], atol=1e-5, rtol=1e-5)
    assert_causal(model, x)


def test_forgetful_causal_mask():
    torch.manual_seed(0)
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    model = AutoregressiveWrapper(
        model,
        mask_prob = 0.15  # in paper, they use 15%, same as BERT
    )

    x = torch.randint(0, NUM, (1, SEQ))

    loss = model(x)
    assert loss != model(x)                     # a new random set of keys is hidden at every step
    assert_trains(loss, model)
    with torch.no_grad():                       # and none outside training
        torch.testing.assert_close(model.eval()(x), AutoregressiveWrapper(model.net).eval()(x))


# ------------------------------------------------------------------------------------------------
# Miscellaneous

def test_cross_attention():
    enc = Encoder(dim = DIM, depth = DEPTH)
    model = CrossAttender(dim = DIM, depth = DEPTH)

    nodes = torch.randn(1, 1, DIM)
    node_masks = torch.ones(1, 1).bool()

    neighbors = torch.randn(1, 5, DIM)
    neighbor_masks = torch.ones(1, 5).bool()

    encoded_neighbors = enc(neighbors, mask = neighbor_masks)
    out = model(nodes, context = encoded_neighbors, mask = node_masks, context_mask = neighbor_masks) # (1, 1, 512)
    assert out.shape == (1, 1, DIM)
    assert_trains(out.square().mean(), enc, model)
    enc.eval(), model.eval()
    neighbor_masks[:, -1] = False               # a masked neighbour is not read
    changed = neighbors.clone()
    changed[:, -1] += 1.0
    with torch.no_grad():
        a, b = (model(nodes, context = enc(n, mask = neighbor_masks), mask = node_masks,
                      context_mask = neighbor_masks) for n in (neighbors, changed))
        torch.testing.assert_close(a, b)
        assert not torch.allclose(a, model(nodes, context = enc(changed)))


def test_continuous_embeddings():
    model = ContinuousTransformerWrapper(
        dim_in = 8,
        dim_out = 12,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    x = torch.randn((1, SEQ, 8))
    mask = torch.ones(1, SEQ).bool()

    out = model(x, mask = mask) # (1, 1024, 100)
    assert out.shape == (1, SEQ, 12)
    assert_finite(out)
    assert_causal(model, x, mask = mask)


def test_continuous_autoregressive():
    model = ContinuousTransformerWrapper(
        dim_in = 8,
        dim_out = 8,
        max_seq_len = 2 * SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    # wrap it with the continuous autoregressive wrapper

    model = ContinuousAutoregressiveWrapper(model)

    # mock data

    x = torch.randn((1, SEQ, 8))
    mask = torch.ones(1, SEQ).bool()

    # train on a lot of data above

    loss = model(x, mask = mask)
    with torch.no_grad():                       # the mean squared error of the next vector
        expected = (model.net(x[:, :-1]) - x[:, 1:]).pow(2).mean()
    torch.testing.assert_close(loss.detach(), expected)
    assert_trains(loss, model)

    # then generate

    start_emb = torch.randn(1, 8)
    generated = model.generate(start_emb, 17) # (17, 777)
    assert generated.shape == (17, 8)           # one unbatched sequence in, one out
    torch.testing.assert_close(generated, model.generate(start_emb, 17, cache_kv = False), atol=1e-5, rtol=1e-5)
