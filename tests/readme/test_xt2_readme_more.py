"""x-transformers 2.31.10's README, from Rotary Positional Embeddings to the end (Miscellaneous), as tests
(conventions: xt2_checks). resi_dual, attn_head_scale, scale_residual and XValTransformerWrapper /
XValAutoregressiveWrapper: test_xt2_readme_extra.py. Rotary embeddings, shifted tokens (both blocks), cross
attention and continuous embeddings are the 2021 README's blocks: test_spec_examples_positions.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyformer import (AutoregressiveWrapper, ContinuousAutoregressiveWrapper, ContinuousTransformerWrapper,
                        Decoder, TransformerWrapper)
from polyformer.interfaces import KV
from tests.readme.xt2_checks import (DEPTH, DIM, NUM, SEQ, assert_cached_generation, assert_causal,
                                     assert_relative, assert_trains, copy_weights, ids, lm)


# ------------------------------------------------------------------------------------------------
# positions

def test_rotary_xpos():
    model = lm(rotary_xpos = True)   # modified rotary to extrapolate well beyond length at which it was trained
    assert_relative(model)
    with torch.no_grad():               # xPos's decay on top of the rotation: not plain rotary
        assert not torch.allclose(model(ids()), copy_weights(model, lm(rotary_pos_emb = True), strict = False)(ids()))
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
    model = lm(
        use_abs_pos_emb = False,   # set this to False
        depth = 1,
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
    model = lm()

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
