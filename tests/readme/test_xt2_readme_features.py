"""x-transformers 2.31.10's README, section Features from Flash Attention to the sandwich
coefficient, as tests (see test_xt2_readme.py). use_simple_rmsnorm, attn_sparse_topk_straight_through and
attn_hard: test_xt2_readme_extra.py.

Each block keeps its keywords and call pattern; sizes are ours (xt2_checks: dim 32, depth 2, seq 16,
256 tokens); `.cuda()` is dropped; a block that misses its own import gets it. A block that only builds
`TransformerWrapper(num_tokens, max_seq_len, attn_layers = Decoder(dim, depth, heads, ...))` (or an
Encoder) is built by `lm(...)` (`enc(...)`) with its keywords as written. Each test asserts what the
block claims."""

from __future__ import annotations

import torch

from polyformer import Decoder, Encoder, TransformerWrapper
from polyformer.norm import RMSNorm, ScaleNorm
from tests.readme.xt2_checks import (DEPTH, DIM, NUM, SEQ, assert_bidirectional, assert_cached_generation,
                                     assert_causal, assert_trains, copy_weights, enc, ids, lm)


# ------------------------------------------------------------------------------------------------
# Features

def test_flash_attention_switch():
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_flash = True # just set this to True if you have pytorch 2.0 installed
        )
    ).eval()
    x = ids()
    with torch.no_grad():                 # the fused path computes the same attention
        torch.testing.assert_close(model(x), copy_weights(model, lm())(x), atol=1e-5, rtol=1e-5)
    assert_causal(model, x)


def test_persistent_memory_kv():
    enc = Encoder(
        dim = DIM,
        depth = DEPTH,
        heads = 8,
        attn_num_mem_kv = 16 # 16 memory key / values
    ).eval()
    x = torch.randn(1, SEQ, DIM)
    mask = torch.zeros(1, SEQ, dtype=torch.bool)
    mask[:, 0] = True                     # the memory stays visible whatever the mask hides
    with torch.no_grad():
        _, record = enc(x, mask = mask, return_attn = True)
    for weights in record.attn:
        assert weights.shape == (1, 8, SEQ, 16 + SEQ)
        torch.testing.assert_close(weights.sum(-1), torch.ones(1, 8, SEQ))
        assert (weights[..., :16] > 0).all() and (weights[..., 17:] == 0).all()


def test_memory_tokens():
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        num_memory_tokens = 20, # 20 memory tokens
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    ).eval()
    x = ids()
    with torch.no_grad():
        out = model(x)
        assert out.shape == (1, SEQ, NUM)            # the memory tokens are not in the output
        model.memory_tokens.tokens.mul_(3.0)
        assert not torch.allclose(model(x), out)     # but every position attends to them
    assert_bidirectional(model, x)


def test_scalenorm():
    model = lm(use_scalenorm = True) # set to True to use for all layers
    norms = [m for m in model.modules() if isinstance(m, ScaleNorm)]
    assert len(norms) == 2 * DEPTH + 1 and not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    h = torch.randn(2, 5, DIM)
    torch.testing.assert_close(norms[0](h), DIM ** 0.5 * h / h.norm(dim=-1, keepdim=True))
    assert_causal(model, ids())


def test_l2norm_embed():
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        l2norm_embed = True,    # set this to True for l2 normalized embedding + small init
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )
    x = ids()
    tok, pos = model.token_emb(x), model.pos_emb(torch.arange(SEQ)[None])
    torch.testing.assert_close(tok.norm(dim=-1), torch.ones(1, SEQ))
    torch.testing.assert_close(pos.norm(dim=-1), torch.ones(1, SEQ))
    assert model.token_emb.weight.std() < 1e-3                        # the small init
    assert_trains(model(x).logsumexp(-1).mean(), model)


def test_post_emb_norm():
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        post_emb_norm = True,    # set this to True to layernorm summed token + pos embeddings
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
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


def _ff_reference(ff: torch.nn.Module, h: torch.Tensor, act) -> torch.Tensor:
    value, gate = ff.proj_in(h).chunk(2, dim=-1)
    return ff.proj_out(value * act(gate))


def test_ff_glu():
    model = lm(ff_glu = True) # set to true to use for all feedforwards
    ff = model.attn_layers.blocks[1].branch
    h = torch.randn(2, 5, DIM)
    torch.testing.assert_close(ff(h), _ff_reference(ff, h, torch.nn.functional.gelu))
    assert_causal(model, ids())


def test_ff_swish_glu():
    model = lm(
        ff_swish = True, # set this to True
        ff_glu = True    # set to true to use for all feedforwards
    )
    ff = model.attn_layers.blocks[1].branch
    h = torch.randn(2, 5, DIM)
    torch.testing.assert_close(ff(h), _ff_reference(ff, h, torch.nn.functional.silu))
    assert_cached_generation(model.eval())


def test_ff_no_bias():
    model = lm(ff_no_bias = True)  # set this to True
    for block in model.attn_layers.blocks[1::2]:
        assert not torch.any(block.branch(torch.zeros(1, 3, DIM)))     # no bias: zero in, zero out
    assert_causal(model, ids())


def test_ff_relu_squared():
    model = lm(ff_relu_squared = True)
    ff = model.attn_layers.blocks[1].branch
    h = torch.randn(2, 5, DIM)
    torch.testing.assert_close(ff(h), ff.proj_out(torch.relu(ff.proj_in(h)) ** 2))
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
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_kv_heads = 2 # say you want 4 query heads to attend to 1 key / value head
        )
    ).eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), _expanded_kv(model, 2)(x), atol=1e-5, rtol=1e-5)
    assert model.new_state(2, SEQ).k.shape[2] == 2
    assert_cached_generation(model)


def test_attention_on_attention():
    model = enc(attn_on_attn = True)  # gate output of attention layer, by queries
    output = model.attn_layers.blocks[0].branch.output
    o = torch.randn(1, 8, 5, 64)
    value, gate = output.proj(o.transpose(1, 2).reshape(1, 5, 8 * 64)).chunk(2, dim=-1)
    torch.testing.assert_close(output(o, torch.randn(1, 5, DIM)), value * torch.sigmoid(gate))
    assert_bidirectional(model, ids())


def test_gate_values():
    model = enc(attn_gate_values = True).eval()  # gate aggregated values with the input
    plain = copy_weights(model, enc(), strict=False)
    with torch.no_grad():       # the gate starts at sigmoid(0 x + 1): the plain model with values scaled
        for block in plain.attn_layers.blocks[::2]:
            block.branch.output.proj.weight.mul_(torch.sigmoid(torch.tensor(1.0)))
        torch.testing.assert_close(model(ids()), plain(ids()), atol=1e-5, rtol=1e-5)
    assert_trains(model.train()(ids()).logsumexp(-1).mean(), model)


def test_sandwich_coefficient():
    model = enc(depth = 6, sandwich_coef = 6)  # interleave attention and feedforwards with sandwich coefficient of 6
    assert [b.kind for b in model.attn_layers.blocks] == ["a"] * 6 + ["f"] * 6
    assert_bidirectional(model, ids())
