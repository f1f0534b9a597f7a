"""The spec README's examples, section Features from persistent memory to macaron (conventions:
test_spec_examples.py)."""

from __future__ import annotations

import torch

from polyformer import Decoder, Encoder, TransformerWrapper
from polyformer.norm import ScaleNorm
from polyformer.residual import ReZero
from tests.readme.xt2_checks import assert_bidirectional, assert_causal, assert_finite, copy_weights, glu_reference

DIM = 64        # README: 512
DEPTH = 2       # README: 6 or 12
SEQ = 64        # README: 1024 (512 for the Transformer-XL examples)


# ------------------------------------------------------------------------------------------------
# Features

def test_persistent_memory_both_readmes():
    enc = Encoder(
        dim = DIM,
        depth = DEPTH,
        heads = 8,
        attn_num_mem_kv = 16 # 16 memory key / values
    )

    x = torch.randn(1, SEQ, DIM)
    out = enc(x)
    assert out.shape == (1, SEQ, DIM)
    assert_finite(out)
    # every attention map has 16 extra (memory) keys in front of the sequence's keys
    _, record = enc(x, return_attn = True)
    assert len(record.attn) == DEPTH
    for weights in record.attn:
        assert weights.shape == (1, 8, SEQ, 16 + SEQ)
        torch.testing.assert_close(weights.sum(-1), torch.ones(1, 8, SEQ))
        assert (weights[..., :16] > 0).all()
    mask = torch.zeros(1, SEQ, dtype=torch.bool)
    mask[:, 0] = True                     # the memory stays visible whatever the mask hides
    with torch.no_grad():
        _, record = enc(x, mask = mask, return_attn = True)
    for weights in record.attn:
        assert (weights[..., :16] > 0).all() and (weights[..., 17:] == 0).all()


def test_memory_tokens_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        num_memory_tokens = 20, # 20 memory tokens
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    ).eval()

    x = torch.randint(0, 20000, (1, SEQ))
    with torch.no_grad():
        out = model(x)
        # memory tokens pass through the layers but are dropped from the output
        assert out.shape == (1, SEQ, 20000)
        assert_finite(out)
        model.memory_tokens.tokens.mul_(10.0)
        assert not torch.allclose(model(x), out)       # and they do take part in attention
    assert_bidirectional(model, x)


def test_scalenorm():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            use_scalenorm = True # set to true to use for all layers
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.norm == "scale"
    norms = [m for m in model.modules() if isinstance(m, ScaleNorm)]
    assert len(norms) == 2 * DEPTH + 1          # one per block, plus the final norm
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert_causal(model, x)


def test_ff_glu_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            ff_glu = True # set to true to use for all feedforwards
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.ff.glu
    ff = model.attn_layers.blocks[1].branch
    assert ff.proj_in.out_features == 2 * 4 * DIM        # value and gate halves
    h = torch.randn(2, 5, DIM)
    torch.testing.assert_close(ff(h), glu_reference(ff, h, torch.nn.functional.gelu))
    assert_causal(model, x)


def test_ff_relu_squared_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            ff_relu_squared = True
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.ff.activation == "relu_squared"
    act = model.attn_layers.blocks[1].branch.act
    t = torch.tensor([-2.0, 0.0, 3.0])
    torch.testing.assert_close(act(t), torch.tensor([0.0, 0.0, 9.0]))
    ff = model.attn_layers.blocks[1].branch
    h = torch.randn(2, 5, DIM)
    torch.testing.assert_close(ff(h), ff.proj_out(torch.relu(ff.proj_in(h)) ** 2))
    assert_causal(model, x)


def test_rezero():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            use_rezero = True # set to true to use for all layers
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert sum(isinstance(m, ReZero) for m in model.modules()) == 2 * DEPTH
    # every gate starts at zero, so the stack starts as the identity: logits = head(emb + pos)
    with torch.no_grad():
        h = model.token_emb(x) + model.pos_emb(torch.arange(SEQ)[None])
        torch.testing.assert_close(model.eval()(x), model.to_logits(h))


def test_sparse_topk():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_sparse_topk = 8 # keep only the top 8 values before attention (softmax)
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    # each query keeps at most 8 keys (fewer while fewer are visible), weights sum to one
    with torch.no_grad():
        _, attn = model(x, return_attn = True)
    for weights in attn:
        nonzero = (weights > 0).sum(-1)
        visible = torch.arange(1, SEQ + 1)
        assert (nonzero <= 8).all()
        assert (nonzero == visible.clamp(max=8)).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))


def test_entmax15():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_use_entmax15 = True  # use entmax15 for attention step
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.attention.normalize == "entmax15"
    with torch.no_grad():
        _, attn = model(x, return_attn = True)
    future = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    for weights in attn:
        assert (weights >= 0).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
        assert (weights[..., future] == 0).all()                # still causal
    # the normaliser in use is entmax15, which (unlike softmax) gives exact zeros
    normalize = model.attn_layers.blocks[0].branch.kernel.normalize
    sharp = normalize(torch.tensor([[3.0, 1.0, -2.0]]), None)
    assert sharp[0, 2] == 0 and sharp[0, 0] > 0
    assert_causal(model, x)


def test_talking_heads():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_talking_heads = True  # turn on information exchange between attention heads
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    kernel = model.attn_layers.blocks[0].branch.kernel
    assert kernel.pre_mix is not None and kernel.post_mix is not None
    assert kernel.pre_mix.weight.shape == (8, 8)
    assert_causal(model, x)


def test_collaborative_heads():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_collab_heads = True,
            attn_collab_compression = .3,
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    # collaborative heads share the query / key projections: fewer parameters than vanilla
    vanilla = Decoder(dim = DIM, depth = DEPTH, heads = 8)
    count = lambda m: sum(p.numel() for p in m.parameters())   # noqa: E731
    assert count(model.attn_layers) < count(vanilla)
    assert_causal(model, x)


def test_attention_on_attention_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_on_attn = True  # gate output of attention layer, by queries
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.blocks[0].branch.output.on_attn
    assert model.attn_layers.blocks[0].branch.output.proj.out_features == 2 * DIM   # value and gate
    output = model.attn_layers.blocks[0].branch.output
    o = torch.randn(1, 8, 5, 64)                  # the output gated by a sigmoid of its own projection
    value, gate = output.proj(o.transpose(1, 2).reshape(1, 5, 8 * 64)).chunk(2, dim=-1)
    torch.testing.assert_close(output(o, torch.randn(1, 5, DIM)), value * torch.sigmoid(gate))
    assert_bidirectional(model, x)


def test_gate_values():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            gate_values = True  # gate aggregated values with the input
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.attention.gate_values
    assert model.attn_layers.blocks[0].branch.output.gate is not None
    assert_bidirectional(model, x)


def test_sandwich_coef_both_readmes():
    # depth 6 is kept here: sandwich_coef = 6 must not exceed the depth
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = 6,
            heads = 8,
            sandwich_coef = 6  # interleave attention and feedforwards with sandwich coefficient of 6
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.layout == ("a",) * 6 + ("f",) * 6
    assert [b.kind for b in model.attn_layers.blocks] == ["a"] * 6 + ["f"] * 6


def test_macaron_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            macaron = True  # use macaron configuration
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.layout == ("f", "a", "f") * DEPTH
    assert all(b.scale == 0.5 for b in model.attn_layers.blocks if b.kind == "f")   # half-step FFNs
    plain = copy_weights(model, TransformerWrapper(num_tokens = 20000, max_seq_len = SEQ, attn_layers = Encoder(
        dim = DIM, depth = DEPTH, heads = 8, custom_layers = ("f", "a", "f") * DEPTH)))
    with torch.no_grad():               # each feedforward is a half step
        for block in plain.attn_layers.blocks:
            if block.kind == "f":
                block.branch.proj_out.weight.mul_(0.5), block.branch.proj_out.bias.mul_(0.5)
        torch.testing.assert_close(model.eval()(x), plain(x), atol=1e-5, rtol=1e-5)
