"""T5 checkpoints (interop/t5.py): converted T5ForConditionalGeneration / T5EncoderModel compute the
Hugging Face outputs within 1e-5 (v1.0 ReLU with the tied, scaled head; v1.1 gated GELU with an untied
head; transformers 5.x's tied-but-unscaled head), with padding in the encoder input; to_hf and
save_hf give models that compute the same; greedy generation gives `generate`'s tokens; options
polyformer cannot reproduce are refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from polyformer import Encoder, TransformerWrapper, XTransformer
from polyformer.interop import Unsupported, from_hf, load_hf, save_hf, to_hf

from .hf_models import hf_seq2seq_logits, max_diff, seq2seq, seq2seq_logits, source, target, transformers

TOL = 1e-5
START = 0           # decoder_start_token_id (T5's pad id)
SHAPES: dict[str, dict[str, Any]] = {
    # v1.0: ReLU, the head tied to the shared embedding, decoder output scaled by d_model ** -0.5
    "v1_0": dict(vocab_size=48, d_model=16, d_kv=4, d_ff=40, num_layers=2, num_heads=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=8),   # past 8: one bucket
    # v1.1: gated tanh-GELU, an untied head (see `t5`), heads * d_kv != d_model, a deeper decoder
    "v1_1": dict(vocab_size=40, d_model=20, d_kv=6, d_ff=28, num_layers=2, num_decoder_layers=3, num_heads=3,
                 feed_forward_proj="gated-gelu", tie_word_embeddings=False, layer_norm_epsilon=1e-5,
                 relative_attention_max_distance=40),
    # transformers 5.x: tie_word_embeddings=False only turns the scaling off, the head stays tied
    "tied_unscaled": dict(vocab_size=36, d_model=12, d_kv=8, d_ff=20, num_layers=3, num_decoder_layers=1,
                          num_heads=1, feed_forward_proj="gated-silu", tie_word_embeddings=False,
                          relative_attention_num_buckets=16, relative_attention_max_distance=16),
}


def t5(shape: str, cls: str = "T5ForConditionalGeneration", seed: int = 0, **extra: Any) -> torch.nn.Module:
    """A tiny T5 (hf_models.seq2seq); v1.1 gets a head of its own, as its checkpoints load."""
    config = transformers.T5Config(**{**SHAPES[shape], **extra}, dropout_rate=0.0, decoder_start_token_id=START)
    return seq2seq(config, cls, seed, untie=shape == "v1_1")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_conditional_generation_logits_agree(shape):
    hf = t5(shape)
    model = from_hf(hf)
    assert isinstance(model, XTransformer)
    assert (model.decoder.net.to_logits is None) == (shape != "v1_1")      # tied unless the checkpoint unties
    src, mask = source(hf.config.vocab_size)
    tgt = target(hf.config.vocab_size)
    with torch.no_grad():
        ours, theirs = seq2seq_logits(model, src, mask, tgt), hf_seq2seq_logits(hf, src, mask, tgt)
        assert theirs.abs().max() > 0.5
        assert max_diff(ours, theirs) <= TOL
        encoded = model.encoder(src, mask=mask, return_embeddings=True)
        hf_encoded = hf.encoder(input_ids=src, attention_mask=mask.long()).last_hidden_state
        assert max_diff(encoded[mask], hf_encoded[mask]) <= TOL
        # the padded keys are really left out: a row alone, unpadded, gives the same logits
        alone = seq2seq_logits(model, src[1:2, mask[1]], mask[1:2, mask[1]], tgt[1:2])
        assert max_diff(alone[0], ours[1]) <= TOL


@pytest.mark.parametrize("shape", ["v1_0", "v1_1"])
def test_encoder_model_hidden_states_agree(shape):
    hf = t5(shape, "T5EncoderModel")
    model = from_hf(hf)
    assert isinstance(model, TransformerWrapper) and isinstance(model.attn_layers, Encoder)
    src, mask = source(hf.config.vocab_size)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=mask.long()).last_hidden_state
        assert theirs.abs().max() > 0.5
        assert max_diff(model(src, mask=mask, return_embeddings=True)[mask], theirs[mask]) <= TOL
        assert max_diff(model(src, return_embeddings=True), hf(input_ids=src).last_hidden_state) <= TOL


def test_relative_bias_is_shared_and_scores_unscaled():
    """T5's one bias table (layer 0's) is the stack's single shared table, and the queries carry the
    sqrt(d_kv) that makes polyformer's 1/sqrt(d) scores T5's unscaled ones."""
    hf = t5("v1_0", "T5EncoderModel")
    model = from_hf(hf)
    table = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert [k for k in model.state_dict() if "bias" in k] == ["attn_layers.shared_bias.embedding.weight"]
    assert torch.equal(model.attn_layers.shared_bias.embedding.weight, hf.state_dict()[table])
    q = model.attn_layers.blocks[2].branch.project.to_qkv.weight[:16]
    assert torch.equal(q, 2.0 * hf.encoder.block[1].layer[0].SelfAttention.q.weight)     # sqrt(d_kv = 4)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_to_hf_gives_the_same_logits(shape):
    hf = t5(shape)
    model = from_hf(hf)
    back = to_hf(model, decoder_start_token_id=START)
    assert type(back) is type(hf)
    assert (back.lm_head.weight is back.shared.weight) == (shape != "v1_1")
    src, mask = source(hf.config.vocab_size)
    tgt = target(hf.config.vocab_size, n=6, seed=3)
    with torch.no_grad():
        assert max_diff(hf_seq2seq_logits(back, src, mask, tgt), seq2seq_logits(model, src, mask, tgt)) <= TOL
    if shape != "tied_unscaled":        # the canonical v1.0 / v1.1 layouts come back tensor for tensor
        theirs, again = hf.state_dict(), back.state_dict()
        assert list(again) == list(theirs)
        for name in theirs:
            torch.testing.assert_close(again[name], theirs[name], rtol=1e-6, atol=0, msg=name)


def test_encoder_model_round_trip_and_save(tmp_path):
    hf = t5("v1_1", "T5EncoderModel")
    model = from_hf(hf)
    back = to_hf(model)
    assert type(back).__name__ == "T5EncoderModel"
    src, mask = source(hf.config.vocab_size)
    out = save_hf(model, tmp_path / "enc")
    with torch.no_grad():
        want = model(src, mask=mask, return_embeddings=True)[mask]
        assert max_diff(back(input_ids=src, attention_mask=mask.long()).last_hidden_state[mask], want) <= TOL
        assert max_diff(load_hf(out)(src, mask=mask, return_embeddings=True)[mask], want) <= TOL


def test_save_hf_untied_head_loads_in_transformers(tmp_path):
    hf = t5("v1_1")
    model = from_hf(hf)
    out = save_hf(model, tmp_path / "t5", decoder_start_token_id=START)
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    again = load_hf(out)
    src, mask = source(hf.config.vocab_size)
    tgt = target(hf.config.vocab_size, n=5, seed=4)
    with torch.no_grad():
        want = hf_seq2seq_logits(hf, src, mask, tgt)
        assert max_diff(hf_seq2seq_logits(loaded, src, mask, tgt), want) <= TOL
        assert max_diff(seq2seq_logits(again, src, mask, tgt), want) <= TOL


@pytest.mark.parametrize("shape, seed", [("v1_0", 6), ("v1_1", 0)])
def test_greedy_generation_equals_hf_generate(shape, seed):
    hf = t5(shape, seed=seed, num_decoder_layers=2)   # transformers' generate fails on a deeper decoder
    model = from_hf(hf)
    src, mask = source(hf.config.vocab_size, b=3, n=9)
    new = 10
    start = torch.full((3, 1), START)
    ours = model.generate(src, start, new, src_mask=mask, temperature=0.0)
    theirs = hf.generate(src, attention_mask=mask.long(), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         decoder_start_token_id=START)[:, 1:]
    assert torch.equal(ours, theirs), f"\nours   {ours.tolist()}\ntheirs {theirs.tolist()}"
    assert (ours[:, 1:] != ours[:, :-1]).any() and (ours[0] != ours[1]).any()   # not one repeated token
    assert torch.equal(model.generate(src, start, new, src_mask=mask, temperature=0.0, cache_kv=False), ours)


@pytest.mark.parametrize("extra, cls, pattern", [
    (dict(feed_forward_proj="gated-tanh"), "T5ForConditionalGeneration", "feed_forward_proj='gated-tanh'"),
    (dict(feed_forward_proj="gelu_fast"), "T5EncoderModel", "feed_forward_proj='gelu_fast'"),
    (dict(is_decoder=True), "T5EncoderModel", "is_decoder=True"),
    (dict(relative_attention_max_distance=6), "T5ForConditionalGeneration", "relative_attention_max_distance=6"),
], ids=["gated-tanh", "encoder-gelu-fast", "causal-encoder", "max-distance-below-buckets"])
def test_unsupported_option_is_named(extra, cls, pattern):
    with pytest.raises(Unsupported, match=pattern):
        from_hf(t5("v1_0", cls, **extra))


def test_to_hf_refuses_a_model_t5_cannot_express():
    model = XTransformer(dim=16, tie_token_emb=True, enc_num_tokens=32, enc_max_seq_len=16, enc_depth=1, enc_heads=2,
                         enc_rel_pos_bias=True, dec_num_tokens=32, dec_max_seq_len=16, dec_depth=1, dec_heads=2,
                         dec_rel_pos_bias=True, dec_tie_embedding=True)
    with pytest.raises(Unsupported, match=r"t5 \(T5ForConditionalGeneration\).*norm is 'layer', t5 needs 'rms'"):
        to_hf(model)


def test_shared_embedding_copies_must_agree():
    hf = t5("v1_0")
    with torch.no_grad():
        hf.encoder.embed_tokens.weight = torch.nn.Parameter(hf.shared.weight + 1.0)
    with pytest.raises(ValueError, match="encoder.embed_tokens.weight differs from shared.weight"):
        from_hf(hf)


def test_converted_model_rebuilds_from_its_config_and_old_checkpoints_load(tmp_path):
    """Every option went through XTransformer keywords; the cross-attention bias table old checkpoints
    carry (never used by transformers) is dropped, and a run directory refuses an encoder-decoder."""
    from safetensors.torch import load_file, save_file

    from polyformer import build_model, model_config
    from polyformer.train.convert import from_hf_dir

    hf = t5("v1_1")
    model = from_hf(hf)
    rebuilt = build_model(model_config(model)).eval()
    rebuilt.load_state_dict(model.state_dict())
    src, mask = source(hf.config.vocab_size)
    tgt = target(hf.config.vocab_size, n=5, seed=5)
    with torch.no_grad():
        assert torch.equal(seq2seq_logits(rebuilt, src, mask, tgt), seq2seq_logits(model, src, mask, tgt))
    out = save_hf(model, tmp_path / "t5")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = torch.randn(32, 3)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        assert torch.equal(seq2seq_logits(load_hf(out), src, mask, tgt), seq2seq_logits(model, src, mask, tgt))
    with pytest.raises(SystemExit, match="encoder-decoder"):
        from_hf_dir(str(out), str(tmp_path / "run"))
