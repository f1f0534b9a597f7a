"""x-transformers 2.31.10's README (its package description), sections Usage and Dropouts, as tests:
its python blocks in order, with `x_transformers` -> `polyformer`. The sections after them:
test_xt2_readme_features.py, test_xt2_readme_layers.py, test_xt2_readme_more.py.

Each block keeps its keywords and call pattern; sizes are ours (xt2_checks: dim 32, depth 2, seq 16,
256 tokens); `.cuda()` is dropped; a block that misses its own import gets it. A block that only builds
`TransformerWrapper(num_tokens, max_seq_len, attn_layers = Decoder(dim, depth, heads, ...))` (or an
Encoder) is built by `lm(...)` (`enc(...)`) with its keywords as written. Each test asserts what the
block claims."""

from __future__ import annotations

import itertools

import torch

from polyformer import Decoder, Encoder, TransformerWrapper, ViTransformerWrapper, XTransformer
from tests.readme.xt2_checks import (DEPTH, DIM, NUM, SEQ, assert_bidirectional, assert_causal, assert_finite,
                                     assert_trains, copy_weights, ids, lm)

IMAGE, PATCH = 32, 8     # README: 256, 32


# ------------------------------------------------------------------------------------------------
# Usage

def test_full_encoder_decoder_with_mask():
    torch.manual_seed(0)
    model = XTransformer(
        dim = DIM,
        enc_num_tokens = NUM,
        enc_depth = DEPTH,
        enc_heads = 8,
        enc_max_seq_len = SEQ,
        dec_num_tokens = NUM,
        dec_depth = DEPTH,
        dec_heads = 8,
        dec_max_seq_len = SEQ,
        tie_token_emb = True      # tie embeddings of encoder and decoder
    )

    src = torch.randint(0, NUM, (1, SEQ))
    src_mask = torch.ones_like(src).bool()
    tgt = torch.randint(0, NUM, (1, SEQ))

    loss = model(src, tgt, mask = src_mask) # (1, 1024, 512)
    assert_trains(loss, model)
    assert model.decoder.net.token_emb is model.encoder.token_emb

    # `mask` is the source's: a hidden source token does not reach the loss, a visible one does
    model.eval()
    src_mask[:, -1] = False
    changed = src.clone()
    changed[:, -1] = (changed[:, -1] + 1) % NUM
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt, mask = src_mask), model(changed, tgt, mask = src_mask))
        assert model(src, tgt) != model(changed, tgt)


def test_decoder_only_gpt_like():
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    x = torch.randint(0, NUM, (1, SEQ))

    out = model(x) # (1, 1024, 20000)
    assert out.shape == (1, SEQ, NUM)
    assert_finite(out)
    assert_causal(model, x)


def test_gpt3_shape_reduced():
    # the block's own imports were missing; GPT-3's heads * attn_dim_head == dim is kept (4 * 8 == 32)
    gpt3 = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 4,
            attn_dim_head = 8
        )
    )
    d, h, dh, n, L = DIM, 4, 8, SEQ, DEPTH
    per_layer = 3 * d * h * dh + h * dh * d + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    assert sum(p.numel() for p in gpt3.parameters()) == NUM * d + n * d + L * per_layer + 2 * d + d * NUM + NUM
    assert_causal(gpt3, ids())


def test_encoder_only_bert_like():
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    x = torch.randint(0, NUM, (1, SEQ))
    mask = torch.ones_like(x).bool()

    out = model(x, mask = mask) # (1, 1024, 20000)
    assert out.shape == (1, SEQ, NUM)
    assert_bidirectional(model, x, mask = mask)
    mask[:, 3] = False                  # a masked token is invisible to every other position
    y = x.clone()
    y[:, 3] = (y[:, 3] + 1) % NUM
    with torch.no_grad():
        a, b = model(x, mask = mask), model(y, mask = mask)
    keep = torch.arange(SEQ) != 3
    torch.testing.assert_close(a[:, keep], b[:, keep])


def test_simple_vit_classification():
    model = ViTransformerWrapper(
        image_size = IMAGE,
        patch_size = PATCH,
        num_classes = 1000,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
        )
    ).eval()

    img = torch.randn(1, 3, IMAGE, IMAGE)
    out = model(img) # (1, 1000)
    assert out.shape == (1, 1000)
    with torch.no_grad():                 # each image of a batch is classified on its own
        other = torch.randn(1, 3, IMAGE, IMAGE)
        both = model(torch.cat((img, other)))
    torch.testing.assert_close(both[:1], out, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(both[0], both[1])


def test_image_to_caption():
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
        num_tokens = NUM,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            cross_attend = True
        )
    )

    img = torch.randn(1, 3, IMAGE, IMAGE)
    caption = torch.randint(0, NUM, (1, SEQ))

    encoded = encoder(img, return_embeddings = True)
    out = decoder(caption, context = encoded) # (1, 1024, 20000)
    assert out.shape == (1, SEQ, NUM) and encoded.shape[::2] == (1, DIM)
    assert_trains(out.logsumexp(-1).mean(), encoder, decoder)
    with torch.no_grad():                 # the caption reads the image
        other = encoder(torch.randn(1, 3, IMAGE, IMAGE), return_embeddings = True)
        assert not torch.allclose(decoder.eval()(caption, context = encoded), decoder(caption, context = other))
    assert_causal(decoder, caption, context = encoded.detach())


def test_pali_prepends_image_embeddings():
    vit = ViTransformerWrapper(
        image_size = IMAGE,
        patch_size = PATCH,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    pali = XTransformer(
        dim = DIM,
        enc_num_tokens = NUM,
        enc_depth = DEPTH,
        enc_heads = 8,
        enc_max_seq_len = SEQ,
        dec_num_tokens = NUM,
        dec_depth = DEPTH,
        dec_heads = 8,
        dec_max_seq_len = SEQ
    )

    img = torch.randn(1, 3, IMAGE, IMAGE)             # images
    prompt = torch.randint(0, NUM, (1, SEQ))          # prompt
    prompt_mask = torch.ones(1, SEQ).bool()           # prompt text mask
    output_text = torch.randint(0, NUM, (1, SEQ))     # target output text

    img_embeds = vit(
        img,
        return_embeddings = True
    )

    loss = pali(
        prompt,
        output_text,
        mask = prompt_mask,
        src_prepend_embeds = img_embeds             # will preprend image embeddings to encoder text embeddings before attention
    )

    assert_trains(loss, vit, pali)    # the loss reaches the vision transformer too
    with torch.no_grad():
        pali.eval()
        other = torch.randn_like(img_embeds)
        assert pali(prompt, output_text, mask = prompt_mask, src_prepend_embeds = other) != loss


# ------------------------------------------------------------------------------------------------
# Dropouts

def test_dropouts_with_layer_dropout():
    torch.manual_seed(0)
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        emb_dropout = 0.1,         # dropout after embedding
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            layer_dropout = 0.1,   # stochastic depth - dropout entire layer
            attn_dropout = 0.1,    # dropout post-attention
            ff_dropout = 0.1       # feedforward dropout
        )
    )

    x = torch.randint(0, NUM, (1, SEQ))
    out = model(x)
    assert not torch.allclose(out, model(x))                     # stochastic in training
    with torch.no_grad():                                        # and the plain model in eval
        torch.testing.assert_close(model.eval()(x), copy_weights(model, lm())(x))

    # layer_dropout skips whole blocks: each training pass is the model with some blocks made identities
    torch.manual_seed(1)
    drop = TransformerWrapper(num_tokens=NUM, max_seq_len=SEQ,
                              attn_layers=Decoder(dim=DIM, depth=1, heads=8, layer_dropout=0.5))
    outcomes = []
    with torch.no_grad():
        for skipped in itertools.product((False, True), repeat=2):
            m = copy_weights(drop, TransformerWrapper(num_tokens=NUM, max_seq_len=SEQ,
                                                      attn_layers=Decoder(dim=DIM, depth=1, heads=8)))
            for block, off in zip(m.attn_layers.blocks, skipped):
                last = block.branch.output.proj if block.kind == "a" else block.branch.proj_out
                for p in last.parameters():
                    p.zero_() if off else None
            outcomes.append(m(x))
        seen = set()
        for _ in range(12):
            y = drop.train()(x)
            match = [i for i, o in enumerate(outcomes) if torch.allclose(y, o, atol=1e-5)]
            assert len(match) == 1, "a training pass is not the model with a set of blocks skipped"
            seen.add(match[0])
    assert len(seen) > 1
