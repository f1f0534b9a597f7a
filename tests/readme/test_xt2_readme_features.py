"""x-transformers 2.31.10's README, section Features from Flash Attention to gated values, as tests
(conventions: xt2_checks). use_simple_rmsnorm, attn_sparse_topk_straight_through and attn_hard:
test_xt2_readme_extra.py. Persistent memory, memory tokens, ff_glu, ReLU², attention on attention and the
sandwich coefficient are the 2021 README's blocks: test_spec_examples_features.py."""

from __future__ import annotations

import torch

from polyformer import TransformerWrapper
from polyformer.norm import RMSNorm, ScaleNorm
from tests.readme.xt2_checks import (DEPTH, DIM, SEQ, assert_cached_generation, assert_causal, assert_trains,
                                     copy_weights, enc, glu_reference, ids, lm)


# ------------------------------------------------------------------------------------------------
# Features

def test_flash_attention_switch():
    model = lm(
        attn_flash = True # just set this to True if you have pytorch 2.0 installed
    ).eval()
    x = ids()
    with torch.no_grad():                 # the fused path computes the same attention
        torch.testing.assert_close(model(x), copy_weights(model, lm())(x), atol=1e-5, rtol=1e-5)
    assert_causal(model, x)


def test_scalenorm():
    model = lm(use_scalenorm = True) # set to True to use for all layers
    norms = [m for m in model.modules() if isinstance(m, ScaleNorm)]
    assert len(norms) == 2 * DEPTH + 1 and not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    h = torch.randn(2, 5, DIM)
    torch.testing.assert_close(norms[0](h), DIM ** 0.5 * h / h.norm(dim=-1, keepdim=True))
    assert_causal(model, ids())


def test_l2norm_embed():
    model = lm(
        l2norm_embed = True,    # set this to True for l2 normalized embedding + small init
    )
    x = ids()
    tok, pos = model.token_emb(x), model.pos_emb(torch.arange(SEQ)[None])
    torch.testing.assert_close(tok.norm(dim=-1), torch.ones(1, SEQ))
    torch.testing.assert_close(pos.norm(dim=-1), torch.ones(1, SEQ))
    assert model.token_emb.weight.std() < 1e-3                        # the small init
    assert_trains(model(x).logsumexp(-1).mean(), model)


def test_post_emb_norm():
    model = lm(
        post_emb_norm = True,    # set this to True to layernorm summed token + pos embeddings
    ).eval()
    x = ids()
    with torch.no_grad():               # the layers see the layernormed sum: scaling both tables is invisible
        for factor in (100.0, 10.0):    # (once the sum is well above LayerNorm's eps)
            before = model(x)
            model.token_emb.weight.mul_(factor), model.pos_emb.emb.weight.mul_(factor)
        torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)
    assert_causal(model, x)


def test_rmsnorm():
    model = lm(use_rmsnorm = True) # set to true to use for all layers
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * DEPTH + 1 and not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    h = torch.randn(2, 5, DIM)               # no mean centring, no bias
    torch.testing.assert_close(norms[0](h), h / h.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt())
    assert_causal(model, ids())


def test_ff_swish_glu():
    model = lm(
        ff_swish = True, # set this to True
        ff_glu = True    # set to true to use for all feedforwards
    )
    ff = model.attn_layers.blocks[1].branch
    h = torch.randn(2, 5, DIM)
    torch.testing.assert_close(ff(h), glu_reference(ff, h, torch.nn.functional.silu))
    assert_cached_generation(model.eval())


def test_ff_no_bias():
    model = lm(ff_no_bias = True)  # set this to True
    for block in model.attn_layers.blocks[1::2]:
        assert not torch.any(block.branch(torch.zeros(1, 3, DIM)))     # no bias: zero in, zero out
    assert_causal(model, ids())


def test_pre_and_post_talking_heads():
    model = lm(
        attn_pre_talking_heads = True,  # linear combination across pre-softmax attn logits across heads
        attn_post_talking_heads = True  # linear combination across post-softmax attn across heads
    ).eval()
    x = ids()
    plain = copy_weights(model, lm(), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))              # both mixes start as the identity
        model.attn_layers.blocks[0].branch.kernel.normalize.post_mix.weight.copy_(torch.eye(8).roll(1, 0))
        assert not torch.allclose(model(x), plain(x))               # and do exchange heads once learned
    assert_causal(model, x)


def _expanded_kv(gqa: TransformerWrapper, kv_heads: int) -> TransformerWrapper:
    """An 8-kv-head model computing what `gqa` computes: each kv head's projection repeated for the
    query heads it serves."""
    mha = lm()
    state = gqa.state_dict()
    for key in [k for k in state if k.endswith("to_qkv.weight")]:
        q, k, v = state[key].split((8 * 64, kv_heads * 64, kv_heads * 64))
        k, v = (t.reshape(kv_heads, 64, DIM).repeat_interleave(8 // kv_heads, 0).reshape(8 * 64, DIM) for t in (k, v))
        state[key] = torch.cat((q, k, v))
    mha.load_state_dict(state)
    return mha.eval()


def test_one_kv_head():
    model = lm(attn_one_kv_head = True).eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), _expanded_kv(model, 1)(x), atol=1e-5, rtol=1e-5)
    assert model.new_state(2, SEQ).k.shape[2] == 1           # the decode state keeps one key head
    assert_cached_generation(model)


def test_grouped_query_attention():
    model = lm(
        attn_kv_heads = 2 # say you want 4 query heads to attend to 1 key / value head
    ).eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), _expanded_kv(model, 2)(x), atol=1e-5, rtol=1e-5)
    assert model.new_state(2, SEQ).k.shape[2] == 2
    assert_cached_generation(model)


def test_gate_values():
    model = enc(attn_gate_values = True).eval()  # gate aggregated values with the input
    plain = copy_weights(model, enc(), strict=False)
    with torch.no_grad():       # the gate starts at sigmoid(0 x + 1): the plain model with values scaled
        for block in plain.attn_layers.blocks[::2]:
            block.branch.output.proj.weight.mul_(torch.sigmoid(torch.tensor(1.0)))
        torch.testing.assert_close(model(ids()), plain(ids()), atol=1e-5, rtol=1e-5)
    assert_trains(model.train()(ids()).logsumexp(-1).mean(), model)
