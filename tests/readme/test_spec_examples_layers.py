"""The spec README's examples, section Features from the T5 relative position bias to the gated residual
(residual attention, Transformer-XL recurrence); rotary embeddings to the end: test_spec_examples_positions.py
(conventions: test_spec_examples.py)."""

from __future__ import annotations

import torch

from polyformer import Decoder, Encoder, TransformerWrapper, XTransformer
from polyformer.residual import GRUGate
from tests.readme.xt2_checks import assert_bidirectional, assert_causal, assert_finite, assert_trains, copy_weights

DIM = 64        # README: 512
DEPTH = 2       # README: 6 or 12
SEQ = 64        # README: 1024 (512 for the Transformer-XL examples)


# ------------------------------------------------------------------------------------------------
# Features (continued)

def test_t5_relative_position_bias_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            rel_pos_bias = True  # adds relative positional bias to all attention layers, a la T5
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.shared_bias is not None
    assert model.pos_emb is None                  # the bias carries the positions
    pos = torch.arange(10)[None]
    bias = model.attn_layers.shared_bias(pos, pos)[0]            # (h, i, j), one per distance
    torch.testing.assert_close(bias[:, 1:, 1:], bias[:, :-1, :-1])
    assert_causal(model, x)
    # relative positions: longer than max_seq_len is fine
    assert model(torch.randint(0, 20000, (1, 2 * SEQ))).shape == (1, 2 * SEQ, 20000)


def test_position_infused_attention():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            position_infused_attn = True  # turns on position infused attention
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.attention.position == "infused"
    assert model.attn_layers.blocks[0].branch.project.infusion is not None
    assert_causal(model, x)


def test_residual_attention_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            pre_norm = False,       # in the paper, residual attention had best results with post-layernorm
            residual_attn = True    # add residual attention
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    cfg = model.attn_layers.cfg
    assert cfg.placement == "post" and cfg.residual_attn
    assert all(b.post_norm is not None and b.norm_in is None for b in model.attn_layers.blocks)
    assert_bidirectional(model, x)
    with torch.no_grad():
        h = model.eval()(x, return_embeddings = True)    # post-norm: every position leaves a LayerNorm
        torch.testing.assert_close(h.mean(-1), torch.zeros(1, SEQ), atol=1e-5, rtol=0)
        _, record = model(x, return_intermediates = True, return_attn = True)
        blocks, hiddens = model.attn_layers.blocks, record.hiddens
        # the second layer's softmax reads its own scores plus the first layer's
        first, second = _scores(blocks[0], hiddens[0]), _scores(blocks[2], hiddens[2])
    torch.testing.assert_close(record.attn[0], first.softmax(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(record.attn[1], (first + second).softmax(-1), atol=1e-5, rtol=1e-5)


def _scores(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A post-norm attention block's own pre-softmax scores (1, 8, n, n) for its input h (1, n, dim)."""
    q, k, _ = block.branch.project.to_qkv(h).split(8 * 64, dim=-1)
    q, k = (t.view(1, -1, 8, 64).transpose(1, 2) for t in (q, k))
    return q @ k.transpose(-1, -2) * 64 ** -0.5


def test_cross_residual_attention_both_readmes():
    model = XTransformer(
        dim = DIM,
        enc_num_tokens = 256,
        enc_depth = DEPTH,
        enc_heads = 8,
        enc_max_seq_len = SEQ,
        dec_num_tokens = 256,
        dec_depth = DEPTH,
        dec_heads = 8,
        dec_max_seq_len = SEQ,
        dec_cross_residual_attn = True     # residualize cross attention
    )

    src = torch.randint(0, 256, (1, SEQ))
    tgt = torch.randint(0, 256, (1, SEQ))
    loss = model(src, tgt)
    assert_trains(loss, model)
    assert model.decoder.net.attn_layers.cfg.cross_residual_attn
    plain = copy_weights(model, XTransformer(dim = DIM, enc_num_tokens = 256, enc_depth = DEPTH, enc_heads = 8,
                                             enc_max_seq_len = SEQ, dec_num_tokens = 256, dec_depth = DEPTH,
                                             dec_heads = 8, dec_max_seq_len = SEQ))
    with torch.no_grad():
        assert model.eval()(src, tgt) != plain(src, tgt)      # the cross-attention scores carry over
    # without tie_token_emb the two sides have their own embeddings
    assert model.decoder.net.token_emb is not model.encoder.token_emb


def test_transformer_xl_recurrence_both_readmes():
    MEM = 2 * SEQ       # README: max_seq_len 512, max_mem_len 2048
    model_xl = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        max_mem_len = MEM,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            rel_pos_bias = True
        )
    ).eval()

    seg1 = torch.randint(0, 20000, (1, SEQ))
    seg2 = torch.randint(0, 20000, (1, SEQ))
    seg3 = torch.randint(0, 20000, (1, SEQ))

    with torch.no_grad():
        logits1, mems1  = model_xl(seg1, return_mems = True)
        logits2, mems2  = model_xl(seg2, mems = mems1, return_mems = True)
        logits3, mems3  = model_xl(seg3, mems = mems2, return_mems = True)

    for logits in (logits1, logits2, logits3):
        assert logits.shape == (1, SEQ, 20000)
        assert_finite(logits)
    for mems, length in ((mems1, SEQ), (mems2, 2 * SEQ), (mems3, MEM)):    # mems3 is cut to MEM
        assert len(mems) == DEPTH
        assert all(m.shape == (1, length, DIM) and not m.requires_grad for m in mems)

    # with the whole history in memory, a segment's logits equal those of one long causal pass
    with torch.no_grad():
        full = model_xl(torch.cat((seg1, seg2, seg3), dim=1))
    torch.testing.assert_close(logits1, full[:, :SEQ], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits2, full[:, SEQ:2 * SEQ], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits3, full[:, 2 * SEQ:], atol=1e-4, rtol=1e-4)


def test_enhanced_recurrence_shift_mem_down():
    model_xl = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        max_mem_len = 4 * SEQ,
        shift_mem_down = 1,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            rotary_pos_emb = True
        )
    ).eval()

    seg1 = torch.randint(0, 20000, (1, SEQ))
    seg2 = torch.randint(0, 20000, (1, SEQ))
    seg3 = torch.randint(0, 20000, (1, SEQ))

    with torch.no_grad():
        logits1, mems1  = model_xl(seg1, return_mems = True)
        logits2, mems2  = model_xl(seg2, mems = mems1, return_mems = True) # mems1 of layer N are automatically routed to the layer N-1

    assert logits1.shape == logits2.shape == (1, SEQ, 20000)
    assert_finite(logits2)
    assert len(mems2) == DEPTH and all(m.shape == (1, 2 * SEQ, DIM) for m in mems2)

    # the same weights without shift_mem_down: the first segment agrees, the second does not
    plain = TransformerWrapper(num_tokens = 20000, max_seq_len = SEQ, max_mem_len = 4 * SEQ,
                               attn_layers = Decoder(dim = DIM, depth = DEPTH, heads = 8,
                                                     rotary_pos_emb = True)).eval()
    plain.load_state_dict(model_xl.state_dict())
    with torch.no_grad():
        p1, pm1 = plain(seg1, return_mems = True)
        p2 = plain(seg2, mems = pm1)
        # routing layer l+1's memory to layer l == passing the rolled list to the plain model
        rolled = plain(seg2, mems = mems1[1:] + mems1[:1])
    torch.testing.assert_close(p1, logits1)
    assert not torch.allclose(p2, logits2, atol=1e-4)
    torch.testing.assert_close(rolled, logits2, atol=1e-5, rtol=1e-5)


def test_gated_residual_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        max_mem_len = 4 * SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 16,
            gate_residual = True
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert sum(isinstance(m, GRUGate) for m in model.modules()) == 2 * DEPTH
    logits, mems = model(x, return_mems = True)
    assert len(mems) == DEPTH
    with torch.no_grad():
        assert not torch.allclose(model(x, mems = mems), model(x))     # the memories are read
    assert_causal(model, x)
