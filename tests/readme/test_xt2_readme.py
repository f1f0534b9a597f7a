"""x-transformers 2.31.10's README, sections Usage and Dropouts, as tests (conventions: xt2_checks). The
sections after them: test_xt2_readme_features.py, test_xt2_readme_layers.py, test_xt2_readme_more.py,
test_xt2_readme_extra.py. Decoder-only, GPT-3, BERT-like, ViT and image-to-caption are the 2021 README's
blocks: test_spec_examples.py."""

from __future__ import annotations

import itertools

import torch

from polyformer import Encoder, ViTransformerWrapper
from tests.readme.xt2_checks import DEPTH, DIM, NUM, SEQ, assert_trains, copy_weights, lm, xt

IMAGE, PATCH = 32, 8     # README: 256, 32


# ------------------------------------------------------------------------------------------------
# Usage

def test_full_encoder_decoder_with_mask():
    torch.manual_seed(0)
    model = xt(
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

    pali = xt()

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
    model = lm(
        emb_dropout = 0.1,         # dropout after embedding
        layer_dropout = 0.1,       # stochastic depth - dropout entire layer
        attn_dropout = 0.1,        # dropout post-attention
        ff_dropout = 0.1           # feedforward dropout
    )

    x = torch.randint(0, NUM, (1, SEQ))
    out = model(x)
    assert not torch.allclose(out, model(x))                     # stochastic in training
    with torch.no_grad():                                        # and the plain model in eval
        torch.testing.assert_close(model.eval()(x), copy_weights(model, lm())(x))

    # layer_dropout skips whole blocks: each training pass is the model with some blocks made identities
    torch.manual_seed(1)
    drop = lm(depth=1, layer_dropout=0.5)
    outcomes = []
    with torch.no_grad():
        for skipped in itertools.product((False, True), repeat=2):
            m = copy_weights(drop, lm(depth=1))
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
