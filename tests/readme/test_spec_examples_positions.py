"""The spec README's examples, section Features from rotary embeddings to shifted tokens, and
Miscellaneous (conventions: test_spec_examples.py)."""

from __future__ import annotations

import torch

from polyformer import ContinuousTransformerWrapper, CrossAttender, Decoder, Encoder, TransformerWrapper
from tests.readme.xt2_checks import assert_cached_generation, assert_causal, assert_finite, assert_relative, assert_trains

DIM = 64        # README: 512
DEPTH = 2       # README: 6 or 12
SEQ = 64        # README: 1024


# ------------------------------------------------------------------------------------------------
# Features (continued)

def test_rotary_positional_embeddings_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            rotary_pos_emb = True  # turns on rotary positional embeddings
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.attention.position == "rotary"
    assert model.pos_emb is None
    assert_causal(model, x)
    # relative: no learned absolute positions, so longer sequences run
    assert model(torch.randint(0, 20000, (1, 2 * SEQ))).shape == (1, 2 * SEQ, 20000)
    assert_relative(model)
    assert_cached_generation(model)


def test_alibi_positional_embedding():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            alibi_pos_emb = True,  # turns on ALiBi positional embedding
            alibi_num_heads = 4    # only use ALiBi for 4 out of the 8 heads, so other 4 heads can still attend far distances
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    a = model.attn_layers.cfg.attention
    assert (a.bias, a.alibi_num_heads) == ("alibi", 4)
    # ALiBi on 4 of the 8 heads: the bias is zero on the other 4
    pos = torch.arange(8)[None]
    bias = model.attn_layers.shared_bias(pos, pos)
    bias = bias.reshape(-1, 8, 8, 8)[0]
    assert (bias[4:] == 0).all() and (bias[:4] != 0).any()
    assert_causal(model, x)
    assert model(torch.randint(0, 20000, (1, 2 * SEQ))).shape == (1, 2 * SEQ, 20000)


def test_shift_tokens_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            shift_tokens = 1
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert all(b.shift is not None and b.shift.shifts == (0, 1) for b in model.attn_layers.blocks)
    assert_causal(model, x)         # in a decoder tokens are shifted from the past only
    h = torch.randn(1, 5, DIM)
    shifted = model.attn_layers.blocks[0].shift(h)     # half the features come from the previous position
    torch.testing.assert_close(shifted[..., :DIM // 2], h[..., :DIM // 2])
    torch.testing.assert_close(shifted[:, 1:, DIM // 2:], h[:, :-1, DIM // 2:])
    assert not shifted[:, 0, DIM // 2:].any()
    assert_cached_generation(model)


def test_shift_tokens_per_block_both_readmes():
    # depth 6 is kept: the tuple has one entry per block (12 blocks)
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = 6,
            heads = 8,
            shift_tokens = (1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0) # 12 blocks, attention and feedforward alternating, with progressively less shifting
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    blocks = model.attn_layers.blocks
    assert len(blocks) == 12
    assert [b.shift is not None for b in blocks] == [True] * 6 + [False] * 6
    assert_causal(model, x)


# ------------------------------------------------------------------------------------------------
# Miscellaneous

def test_cross_attention_both_readmes():
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
    assert set(model.layout) == {"c", "f"}

    # a neighbour masked out (in the encoder and as context) does not change the result
    enc.eval(), model.eval()
    neighbor_masks[:, -1] = False
    changed = neighbors.clone()
    changed[:, -1] = torch.randn(DIM)
    with torch.no_grad():
        a = model(nodes, context = enc(neighbors, mask = neighbor_masks), mask = node_masks,
                  context_mask = neighbor_masks)
        b = model(nodes, context = enc(changed, mask = neighbor_masks), mask = node_masks,
                  context_mask = neighbor_masks)
        c = model(nodes, context = enc(changed), mask = node_masks)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_continuous_values_both_readmes():
    model = ContinuousTransformerWrapper(
        dim_in = 32,
        dim_out = 100,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    x = torch.randn((1, SEQ, 32))
    mask = torch.ones(1, SEQ).bool()

    out = model(x, mask = mask) # (1, 1024, 100)
    assert out.shape == (1, SEQ, 100)
    assert_finite(out)
    assert_causal(model, x, mask = mask)
