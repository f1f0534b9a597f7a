"""Mixtral checkpoints convert both ways: equal logits (float32, within 1e-5) on random models of several
shapes, padded batches included, greedy generation equal, and models Mixtral cannot express refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from polyformer import AutoregressiveWrapper, Decoder, TransformerWrapper
from polyformer.interop import from_hf, to_hf
from polyformer.interop.family import Unsupported
from polyformer.losses import forward_with_losses

from .hf_models import NO_SPECIALS, ids, left_padding, spread

SHAPES = {
    "top2_of_4": dict(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "top1_of_3_tied": dict(vocab_size=40, hidden_size=24, intermediate_size=20, num_hidden_layers=1,
                           num_attention_heads=3, num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=1,
                           tie_word_embeddings=True),
    "top3_of_5_theta": dict(vocab_size=32, hidden_size=12, intermediate_size=36, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=3,
                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}


def mixtral(shape: str, seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(**{**SHAPES[shape], **extra}, **NO_SPECIALS)
    return spread(transformers.MixtralForCausalLM(config), seed)


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_agree_and_write_back(shape):
    hf = mixtral(shape)
    model = from_hf(hf)
    assert model.attn_layers.cfg.ff.moe.top_k == hf.config.num_experts_per_tok
    x = ids(hf.config.vocab_size)
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
        assert theirs.abs().max() > 0.5
        assert (ours - theirs).abs().max() <= 1e-5
        mask = left_padding()
        ours, theirs = model(x, mask=mask), hf(x, attention_mask=mask.long()).logits
        assert (ours[mask] - theirs[mask]).abs().max() <= 1e-5
        back = to_hf(model)
        assert type(back).__name__ == "MixtralForCausalLM"
        assert (back(x).logits - hf(x).logits).abs().max() <= 1e-6
        assert all(torch.equal(t, hf.state_dict()[n]) for n, t in back.state_dict().items())


@pytest.mark.parametrize("shape", ["top1_of_3_tied", "top2_of_4"])
def test_weighted_balance_loss_equals_transformers_aux_loss(shape):
    """One layer: moe_balance times its weight is router_aux_loss_coef times transformers' aux_loss, which
    sums the routed fractions over the k slots (so ff_moe_balance_loss = coefficient * k)."""
    hf = mixtral(shape, num_hidden_layers=1, router_aux_loss_coef=0.02)
    model = from_hf(hf)
    x = ids(hf.config.vocab_size)
    with torch.no_grad():
        theirs = hf(x, output_router_logits=True).aux_loss
        _, ours = forward_with_losses(model, x)
    assert theirs > 1.0 * hf.config.num_experts_per_tok     # not the uniform-routing minimum
    torch.testing.assert_close(ours.terms["moe_balance"] * ours.weights["moe_balance"], 0.02 * theirs, rtol=1e-5,
                               atol=0)


def test_greedy_generation_agrees():
    hf = mixtral("top2_of_4", seed=1)
    prompts = ids(hf.config.vocab_size, b=1, n=5)
    ours = AutoregressiveWrapper(from_hf(hf)).generate(prompts, 8, temperature=0.0)
    theirs = hf.generate(prompts, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs[:, 5:])


@pytest.mark.parametrize("extra, named", [(dict(ff_moe_capacity_factor=1.0), "capacity_factor"),
                                         (dict(ff_moe_shared_experts=1), "shared_experts"),
                                         (dict(ff_moe_renormalize=False), "renormalize")])
def test_models_mixtral_cannot_express_are_refused(extra, named):
    stack = Decoder(dim=16, depth=1, heads=4, rotary_pos_emb=True, use_rmsnorm=True, ff_glu=True, ff_swish=True,
                    ff_no_bias=True, ff_moe=True, ff_num_experts=4, **extra)
    model = TransformerWrapper(num_tokens=32, max_seq_len=64, attn_layers=stack, tie_embedding=False,
                               logits_bias=False, use_abs_pos_emb=False)
    with pytest.raises(Unsupported, match=named):
        to_hf(model)


def test_a_sliding_window_checkpoint_is_refused():
    hf = mixtral("top2_of_4", sliding_window=4)
    with pytest.raises(Unsupported, match="sliding_window"):
        from_hf(hf)
