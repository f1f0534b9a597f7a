"""Switch Transformers checkpoints (interop/switch.py): converted SwitchTransformersForConditionalGeneration /
SwitchTransformersEncoderModel compute the Hugging Face outputs within 1e-5 at every position (padding
included) for several shapes (tied and scaled or untied head, sparse layers at transformers' i % step == 1,
every layer, or none), also when the capacity drops tokens; to_hf / save_hf give models that compute the same;
the router losses equal transformers' where both define them; options polyformer cannot reproduce are refused
by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from polyformer import Encoder, TransformerWrapper, XTransformer
from polyformer.interop import Unsupported, from_hf, load_hf, save_hf, to_hf
from polyformer.losses import forward_with_losses

from .hf_models import hf_seq2seq_logits, max_diff, seq2seq, seq2seq_logits, source, target, transformers

TOL = 1e-5
START = 0
SHAPES: dict[str, dict[str, Any]] = {
    # encoder step 3 (layer 1 of 3: ff_moe_every=3, ff_moe_offset=1), decoder step 2; ReLU, tied head scaled
    "relu_tied": dict(vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=3, num_decoder_layers=2, num_heads=4,
                      num_experts=3, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16),
    # every encoder layer sparse (step 1), decoder step 3; tanh GELU, an untied head, heads * d_kv != d_model
    "gelu_untied": dict(vocab_size=36, d_model=12, d_kv=6, d_ff=20, num_layers=2, num_decoder_layers=3, num_heads=3,
                        num_experts=4, num_sparse_encoder_layers=2, num_sparse_decoder_layers=1,
                        dense_act_fn="gelu_new", tie_word_embeddings=False, relative_attention_max_distance=40),
    # encoder step 2 (layers 1, 3); a dense decoder (step 0: more sparse layers asked than it has)
    "silu_dense_decoder": dict(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=4, num_decoder_layers=2,
                               num_heads=2, num_experts=2, num_sparse_encoder_layers=2, num_sparse_decoder_layers=3,
                               dense_act_fn="silu", relative_attention_num_buckets=16,
                               relative_attention_max_distance=16),
}


def switch(shape: str, cls: str = "SwitchTransformersForConditionalGeneration", seed: int = 0, **extra: Any
           ) -> torch.nn.Module:
    """A tiny Switch model (hf_models.seq2seq); untied, a head of its own."""
    config = transformers.SwitchTransformersConfig(**{**SHAPES[shape], **extra}, dropout_rate=0.0,
                                                   decoder_start_token_id=START)
    return seq2seq(config, cls, seed, untie=not config.tie_word_embeddings)


def dropped(hf: torch.nn.Module, run: Any) -> dict[str, int]:
    """Tokens that transformers' routers left without an expert during run(), per stack."""
    counts = {"encoder": 0, "decoder": 0}
    hooks = []
    for name, module in hf.named_modules():
        if type(module).__name__ == "SwitchTransformersTop1Router":
            side = name.split(".")[0]

            def count(module: Any, args: Any, out: Any, side: str = side) -> None:
                counts[side] += int((out[0].sum(dim=-1) == 0).sum())
            hooks.append(module.register_forward_hook(count))
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return counts


@pytest.mark.parametrize("shape", list(SHAPES))
def test_conditional_generation_logits_agree(shape):
    hf = switch(shape)
    model = from_hf(hf)
    assert isinstance(model, XTransformer)
    assert (model.decoder.net.to_logits is None) == (shape != "gelu_untied")
    src, mask = source(hf.config.vocab_size)
    tgt = target(hf.config.vocab_size)
    with torch.no_grad():
        theirs = hf_seq2seq_logits(hf, src, mask, tgt)
        assert theirs.abs().max() > 0.5
        assert max_diff(seq2seq_logits(model, src, mask, tgt), theirs) <= TOL
        # padding is routed as transformers routes it, so even the padded positions agree
        encoded = model.encoder(src, mask=mask, return_embeddings=True)
        assert max_diff(encoded, hf.encoder(input_ids=src, attention_mask=mask.long()).last_hidden_state) <= TOL


@pytest.mark.parametrize("shape", ["relu_tied", "gelu_untied"])
def test_tokens_dropped_by_capacity_agree(shape):
    """expert_capacity=2: more tokens per row than experts * 2, so both stacks drop tokens (counted at
    transformers' routers), and the logits still agree; the dropping matters (no limit gives others)."""
    hf = switch(shape, expert_capacity=2)
    model = from_hf(hf)
    assert model.encoder.attn_layers.cfg.ff.moe.capacity == 2
    src, mask = source(hf.config.vocab_size)
    tgt = target(hf.config.vocab_size)
    out: dict[str, torch.Tensor] = {}
    counts = dropped(hf, lambda: out.update(theirs=hf_seq2seq_logits(hf, src, mask, tgt)))
    assert counts["encoder"] > 0 and counts["decoder"] > 0, counts
    with torch.no_grad():
        ours = seq2seq_logits(model, src, mask, tgt)
        assert max_diff(ours, out["theirs"]) <= TOL
        unlimited = from_hf(switch(shape, expert_capacity=64))
        assert max_diff(seq2seq_logits(unlimited, src, mask, tgt), ours) > 1e-3


def test_encoder_model_agrees_with_drops_and_padding():
    hf = switch("silu_dense_decoder", "SwitchTransformersEncoderModel", expert_capacity=3)
    model = from_hf(hf)
    assert isinstance(model, TransformerWrapper) and isinstance(model.attn_layers, Encoder)
    src, mask = source(hf.config.vocab_size)
    out: dict[str, torch.Tensor] = {}
    counts = dropped(hf, lambda: out.update(theirs=hf(input_ids=src, attention_mask=mask.long()).last_hidden_state))
    assert counts["encoder"] > 0
    with torch.no_grad():
        assert out["theirs"].abs().max() > 0.5
        assert max_diff(model(src, mask=mask, return_embeddings=True), out["theirs"]) <= TOL


@pytest.mark.parametrize("shape", list(SHAPES))
def test_to_hf_gives_the_same_model(shape):
    hf = switch(shape, expert_capacity=2)
    model = from_hf(hf)
    back = to_hf(model, decoder_start_token_id=START)
    assert type(back) is type(hf)
    theirs, again = hf.state_dict(), back.state_dict()
    assert list(again) == list(theirs)
    for name in theirs:
        if name == "shared.weight" and not hf.config.tie_word_embeddings:
            continue        # built but never read by an untied transformers model: not carried over
        torch.testing.assert_close(again[name], theirs[name], rtol=1e-6, atol=0, msg=name)
    src, mask = source(hf.config.vocab_size)
    tgt = target(hf.config.vocab_size, seed=3)
    with torch.no_grad():
        assert max_diff(hf_seq2seq_logits(back, src, mask, tgt), hf_seq2seq_logits(hf, src, mask, tgt)) <= TOL


def test_save_hf_loads_in_transformers_and_back(tmp_path):
    hf = switch("relu_tied", "SwitchTransformersEncoderModel", expert_capacity=2)
    model = from_hf(hf)
    out = save_hf(model, tmp_path / "enc")
    loaded = transformers.SwitchTransformersEncoderModel.from_pretrained(out).eval()
    src, mask = source(hf.config.vocab_size)
    with torch.no_grad():
        want = hf(input_ids=src, attention_mask=mask.long()).last_hidden_state
        assert max_diff(loaded(input_ids=src, attention_mask=mask.long()).last_hidden_state, want) <= TOL
        assert max_diff(load_hf(out)(src, mask=mask, return_embeddings=True), want) <= TOL


def test_router_losses_equal_transformers_with_one_sparse_layer_and_row():
    """One sparse layer per stack and one row: moe_z is transformers' *_z_loss and moe_balance its
    *_aux_loss (E * sum_i f_i P_i, without the coefficient), weighted by router_z/aux_loss_coef."""
    hf = switch("relu_tied", router_z_loss_coef=0.002, router_aux_loss_coef=0.03)
    model = from_hf(hf)
    src = torch.randint(1, hf.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    tgt = target(hf.config.vocab_size, b=1)
    with torch.no_grad():
        theirs = hf(input_ids=src, decoder_input_ids=tgt, output_router_logits=True)
        encoded, enc = forward_with_losses(model.encoder, src, return_embeddings=True)
        _, dec = forward_with_losses(model.decoder.net, tgt, context=encoded)
    for side, ours in (("encoder", enc), ("decoder", dec)):
        assert ours.weights["moe_z"] == 0.002 and ours.weights["moe_balance"] == 0.03
        torch.testing.assert_close(ours.terms["moe_z"], getattr(theirs, f"{side}_z_loss"), rtol=1e-5, atol=0)
        torch.testing.assert_close(ours.terms["moe_balance"], getattr(theirs, f"{side}_aux_loss"), rtol=1e-5, atol=0)
    assert ours.terms["moe_balance"] > 1.0      # not the uniform-routing minimum


def test_greedy_generation_equals_hf_generate_and_cached_keeps_capacity():
    hf = switch("relu_tied", seed=1)
    model = from_hf(hf)
    src, mask = source(hf.config.vocab_size, n=9)
    start = torch.full((3, 1), START)
    ours = model.generate(src, start, 8, src_mask=mask, temperature=0.0)
    theirs = hf.generate(src, attention_mask=mask.long(), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         decoder_start_token_id=START)[:, 1:]
    assert torch.equal(ours, theirs), f"\nours   {ours.tolist()}\ntheirs {theirs.tolist()}"
    assert (ours[:, 1:] != ours[:, :-1]).any()
    # transformers routes one new token at a time (its capacity never binds while generating); polyformer keeps
    # the running per-row counts, so cached equals uncached with a capacity that drops tokens
    tight = from_hf(switch("relu_tied", seed=1, expert_capacity=1))
    cached = tight.generate(src, start, 8, src_mask=mask, temperature=0.0)
    assert torch.equal(tight.generate(src, start, 8, src_mask=mask, temperature=0.0, cache_kv=False), cached)


@pytest.mark.parametrize("extra, cls, pattern", [
    (dict(router_bias=True), "SwitchTransformersForConditionalGeneration", "router_bias=True"),
    (dict(dense_act_fn="gelu_fast"), "SwitchTransformersEncoderModel", "dense_act_fn='gelu_fast'"),
    (dict(router_ignore_padding_tokens=True), "SwitchTransformersEncoderModel", "router_ignore_padding_tokens"),
    (dict(relative_attention_max_distance=6), "SwitchTransformersForConditionalGeneration",
     "switch_transformers: .*relative_attention_max_distance=6"),
], ids=["router-bias", "gelu-fast", "ignore-padding", "max-distance-below-buckets"])
def test_unsupported_option_is_named(extra, cls, pattern):
    with pytest.raises(Unsupported, match=pattern):
        from_hf(switch("relu_tied", cls, **extra))


def switch_like(**extra: Any) -> TransformerWrapper:
    """A polyformer encoder Switch expresses exactly, changed by `extra`."""
    moe = {**dict(ff_moe=True, ff_num_experts=2, ff_moe_top_k=1, ff_moe_capacity=4, ff_moe_route_padding=True), **extra}
    return TransformerWrapper(num_tokens=32, max_seq_len=16, use_abs_pos_emb=False, tie_embedding=True,
                              attn_layers=Encoder(dim=8, depth=2, heads=2, attn_dim_head=4, use_rmsnorm=True,
                                                  rel_pos_bias=True, rel_pos_num_buckets=8, rel_pos_max_distance=16,
                                                  ff_relu=True, ff_no_bias=True, ff_mult=2, **moe))


@pytest.mark.parametrize("extra, named", [
    (dict(ff_moe_top_k=2), "ff.moe.top_k is 2, switch_transformers needs 1"),
    (dict(ff_moe_capacity=None, ff_moe_capacity_factor=1.0), "ff.moe.capacity is None, switch_transformers needs 16"),
    (dict(ff_moe_every=2, ff_moe_offset=0), "ff.moe.offset is 0, switch_transformers needs None"),
    (dict(ff_glu=True), "ff.glu is True, switch_transformers needs False")])
def test_to_hf_refuses_experts_switch_cannot_express(extra, named):
    assert type(to_hf(switch_like())).__name__ == "SwitchTransformersEncoderModel"
    with pytest.raises(Unsupported, match=named):
        to_hf(switch_like(**extra))


def test_offset_outside_every_is_refused_by_name():
    with pytest.raises(ValueError, match="ff_moe_offset must be below ff_moe_every=2"):
        Encoder(dim=8, depth=2, heads=2, ff_moe=True, ff_num_experts=2, ff_moe_every=2, ff_moe_offset=2)
    with pytest.raises(ValueError, match="ff_moe_offset"):
        Encoder(dim=8, depth=2, heads=2, ff_moe_offset=1)       # without ff_moe
