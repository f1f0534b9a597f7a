"""Every code example of the spec README (spec/000_2775ee658e3949c1.txt, the x-transformers README),
in order, with `x_transformers` -> `polyformer` and `.cuda()` dropped: section Usage. Features:
test_spec_examples_features.py, test_spec_examples_layers.py, then test_spec_examples_positions.py (with
Miscellaneous).

Each example keeps its keywords and call pattern exactly; only sizes are reduced for CI (dim, depth,
sequence length, image size). Each test asserts the shape stated by the README's comment and one
behavioural property (causality, masking, memory use, loss going down, ...). The checks are
xt2_checks' (shared with x-transformers 2.31.10's README tests); a test named `..._both_readmes` runs a
block that 2.31.10's README has verbatim too, with the assertions of both suites.
"""

from __future__ import annotations

import pytest
import torch

from polyformer import Decoder, Encoder, TransformerWrapper, ViTransformerWrapper, XTransformer
from tests.readme.xt2_checks import assert_bidirectional, assert_causal, assert_finite, assert_trains

DIM = 64        # README: 512
DEPTH = 2       # README: 6 or 12
SEQ = 64        # README: 1024 (512 for the Transformer-XL examples)
IMAGE = 64      # README: 256
PATCH = 16      # README: 32


# ------------------------------------------------------------------------------------------------
# Usage

def test_full_encoder_decoder():
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
        tie_token_emb = True      # tie embeddings of encoder and decoder
    )

    src = torch.randint(0, 256, (1, SEQ))
    src_mask = torch.ones_like(src).bool()
    tgt = torch.randint(0, 256, (1, SEQ))
    tgt_mask = torch.ones_like(tgt).bool()

    loss = model(src, tgt, src_mask = src_mask, tgt_mask = tgt_mask) # (1, 1024, 512)
    loss.backward()

    # The README's comment "(1, 1024, 512)" is a leftover: x-transformers' XTransformer returns the
    # decoder's scalar next-token loss, which is what `loss.backward()` needs.
    assert loss.shape == ()
    assert_finite(loss)
    assert model.decoder.net.token_emb is model.encoder.token_emb      # tie_token_emb
    assert model.encoder.token_emb.weight.grad is not None

    # one optimizer step on this batch lowers the loss
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        after = model(src, tgt, src_mask = src_mask, tgt_mask = tgt_mask)
    assert after < loss.detach()


def test_decoder_only_gpt_like_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    x = torch.randint(0, 256, (1, SEQ))

    out = model(x) # (1, 1024, 20000)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert_causal(model, x)


@pytest.mark.slow
def test_decoder_only_gpt_like_full_readme_sizes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 512,
            depth = 12,
            heads = 8
        )
    ).eval()

    x = torch.randint(0, 256, (1, 1024))

    with torch.no_grad():
        out = model(x) # (1, 1024, 20000)
    assert out.shape == (1, 1024, 20000)
    assert_finite(out)


def _gpt_param_count(V: int, n: int, d: int, L: int, h: int, dh: int) -> int:
    """Parameters of a TransformerWrapper(Decoder) with learned positions and an untied head."""
    attn = d * 3 * h * dh + h * dh * d               # fused qkv (no bias) + out projection (no bias)
    ff = d * 4 * d + 4 * d + 4 * d * d + d           # two Linear layers with bias
    norms = 2 * 2 * d                                # two pre-norm LayerNorms per layer
    return V * d + n * d + L * (attn + ff + norms) + 2 * d + d * V + V


def test_gpt3_reduced_both_readmes():
    # The README's GPT-3 (num_tokens 50000, seq 2048, dim 12288, depth 96, heads 96, dim_head 128)
    # is never allocated: the same keywords at reduced sizes, with heads * attn_dim_head == dim as
    # in GPT-3, and the parameter count formula checked here and evaluated at the real sizes.
    gpt3 = TransformerWrapper(
        num_tokens = 500,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 4,
            attn_dim_head = 16
        )
    )
    assert gpt3.attn_layers.cfg.attention.dim_head == 16
    n_params = sum(p.numel() for p in gpt3.parameters())
    assert n_params == _gpt_param_count(500, SEQ, DIM, DEPTH, 4, 16)
    assert 170e9 < _gpt_param_count(50000, 2048, 12288, 96, 96, 128) < 180e9     # "175B"

    x = torch.randint(0, 500, (2, SEQ))
    out = gpt3(x)
    assert out.shape == (2, SEQ, 500)
    assert_finite(out)
    assert_causal(gpt3, x)


def test_encoder_only_bert_like_both_readmes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    x = torch.randint(0, 256, (1, SEQ))
    mask = torch.ones_like(x).bool()

    out = model(x, mask = mask) # (1, 1024, 20000)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert_bidirectional(model, x, mask = mask)

    # a masked-out token is invisible to every other position
    model.eval()
    mask[:, -1] = False
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(x, mask = mask)[:, :-1], model(y, mask = mask)[:, :-1])


def test_image_classification_both_readmes():
    model = ViTransformerWrapper(
        image_size = IMAGE,
        patch_size = PATCH,
        num_classes = 1000,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
        )
    )

    img = torch.randn(1, 3, IMAGE, IMAGE)
    out = model(img) # (1, 1000)
    assert out.shape == (1, 1000)
    assert_finite(out)

    # the class logits depend on the image; a batch gives each image its own result
    model.eval()
    other = torch.randn(1, 3, IMAGE, IMAGE)
    with torch.no_grad():
        both = model(torch.cat((img, other)))
        torch.testing.assert_close(both[:1], model(img), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(both[0], both[1])
        emb = model(img, return_embeddings = True)
    assert emb.shape == (1, 1 + (IMAGE // PATCH) ** 2, DIM)


def test_image_to_caption_both_readmes():
    encoder = ViTransformerWrapper(
        image_size = IMAGE,
        patch_size = PATCH,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    decoder = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            cross_attend = True
        )
    )

    img = torch.randn(1, 3, IMAGE, IMAGE)
    caption = torch.randint(0, 20000, (1, SEQ))

    encoded = encoder(img, return_embeddings = True)
    out = decoder(caption, context = encoded) # (1, 1024, 20000)
    assert encoded.shape == (1, 1 + (IMAGE // PATCH) ** 2, DIM)
    assert out.shape == (1, SEQ, 20000)
    assert_trains(out.logsumexp(-1).mean(), encoder, decoder)      # the loss reaches the image encoder

    # the caption logits depend on the image, and stay causal in the caption
    with torch.no_grad():
        other = encoder(torch.randn(1, 3, IMAGE, IMAGE), return_embeddings = True)
        assert not torch.allclose(decoder(caption, context = encoded), decoder(caption, context = other))
    assert_causal(decoder, caption, context = encoded.detach())


def test_dropouts():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        emb_dropout = 0.1,         # dropout after embedding
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_dropout = 0.1,    # dropout post-attention
            ff_dropout = 0.1       # feedforward dropout
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)

    cfg = model.attn_layers.cfg
    assert (cfg.attention.dropout, cfg.ff.dropout) == (0.1, 0.1)
    # dropout is active in training (two passes differ) and off in eval (two passes agree)
    assert not torch.allclose(model(x), model(x))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x))
