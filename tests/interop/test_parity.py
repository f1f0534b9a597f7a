"""Converted models compute what the Hugging Face models compute: logits (GPT-2, Llama) and last
hidden states (BERT) agree within 1e-5 in float32, with and without padding."""

from __future__ import annotations

import pytest
import torch

from polyformer import TransformerWrapper
from polyformer.generate.decode import left_padded_positions
from polyformer.interop import from_hf

from .hf_models import (BERT_SHAPES, GPT2_SHAPES, LLAMA_SHAPES, bert, gpt2, ids, left_padding, llama, max_diff,
                        right_padding)

TOL = 1e-5
DECODERS = [pytest.param(gpt2, s, id=f"gpt2-{s}") for s in GPT2_SHAPES] + \
           [pytest.param(llama, s, id=f"llama-{s}") for s in LLAMA_SHAPES]


@pytest.mark.parametrize("make, shape", DECODERS)
def test_decoder_logits_agree(make, shape):
    hf = make(shape)
    model = from_hf(hf)
    assert isinstance(model, TransformerWrapper) and model.attn_layers.causal
    x = ids(hf.config.vocab_size)
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert ours.shape == theirs.shape
    assert theirs.abs().max() > 0.5                  # a real signal, not init-sized numbers
    assert max_diff(ours, theirs) <= TOL


@pytest.mark.parametrize("make, shape", DECODERS)
def test_decoder_left_padding_agrees(make, shape):
    hf = make(shape)
    model = from_hf(hf)
    x, mask = ids(hf.config.vocab_size), left_padding()
    with torch.no_grad():
        # the same positions on both sides: 0..n-1 (each library's default), then per-row positions
        ours, theirs = model(x, mask=mask), hf(x, attention_mask=mask.long()).logits
        assert max_diff(ours[mask], theirs[mask]) <= TOL
        pos = left_padded_positions(mask)
        ours, theirs = model(x, mask=mask, pos=pos), hf(x, attention_mask=mask.long(), position_ids=pos).logits
        assert max_diff(ours[mask], theirs[mask]) <= TOL
        # each row alone, unpadded, gives what the padded batch gives for it
        row = x[2:, mask[2]]
        assert max_diff(model(row)[0], ours[2, mask[2]]) <= TOL


@pytest.mark.parametrize("shape", BERT_SHAPES)
def test_bert_hidden_states_agree(shape):
    hf = bert(shape)
    model = from_hf(hf)
    assert isinstance(model, TransformerWrapper) and not model.attn_layers.causal
    x, mask = ids(hf.config.vocab_size), right_padding()
    types = torch.randint(0, hf.config.type_vocab_size, x.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(x).last_hidden_state
        assert theirs.abs().max() > 0.5
        assert max_diff(model(x, return_embeddings=True), theirs) <= TOL
        ours = model(x, mask=mask, return_embeddings=True)
        theirs = hf(x, attention_mask=mask.long()).last_hidden_state
        assert max_diff(ours[mask], theirs[mask]) <= TOL
        ours = model(x, mask=mask, embed_ids={"token_type": types}, return_embeddings=True)
        theirs = hf(x, attention_mask=mask.long(), token_type_ids=types).last_hidden_state
        assert max_diff(ours[mask], theirs[mask]) <= TOL
        # padding changes nothing at the kept positions
        plain = model(x, mask=mask, return_embeddings=True)
        assert max_diff(model(x[2:, mask[2]], return_embeddings=True)[0], plain[2, mask[2]]) <= TOL


def test_converted_model_is_plain_polyformer_config():
    """Every option went through keywords: the model rebuilds from its JSON config."""
    from polyformer import build_model, model_config

    for hf in (gpt2("heads5_untied_exact_gelu"), bert("heads5_types3"), llama("gqa_tied_theta")):
        model = from_hf(hf)
        rebuilt = build_model(model_config(model)).eval()
        rebuilt.load_state_dict(model.state_dict())
        x = ids(hf.config.vocab_size)
        with torch.no_grad():
            torch.testing.assert_close(rebuilt(x), model(x), atol=0, rtol=0)


def test_gpt2_base_model_gives_the_final_hidden_states():
    hf = gpt2("heads3_tied")
    model = from_hf(hf.transformer)
    x = ids(hf.config.vocab_size)
    with torch.no_grad():
        assert max_diff(model(x, return_embeddings=True), hf.transformer(x).last_hidden_state) <= TOL
        assert max_diff(model(x), hf(x).logits) <= TOL          # GPT-2's head is the tied embedding
