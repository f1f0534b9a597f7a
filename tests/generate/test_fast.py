"""The fast decode step (`generate.fast.FastStep`): bit-identical to the module path's cached step
for every option it accepts, refused (with the reason) for the others, used by `generate`."""

import pytest
import torch

from polyformer import AutoregressiveWrapper, quantize_int8
from polyformer.generate.decode import left_padded_positions
from polyformer.generate.fast import FastStep, fast_step
from tests.helpers import ids, tiny_lm
from tests.options import DECODER_OPTIONS, perturb

EXTRA = {
    "gqa_rotary_rms_swiglu": dict(attn_kv_heads=2, rotary_pos_emb=True, use_rmsnorm=True, ff_glu=True,
                                  ff_swish=True, ff_no_bias=True, logits_bias=False),
    "gpt2_like": dict(attn_qkv_bias=True, attn_out_bias=True, ff_gelu_tanh=True, tie_embedding=True),
    "post_emb_norm": dict(post_emb_norm=True, pre_norm=False),
    "rotary_xpos_free_interleaved": dict(rotary_pos_emb=True, rotary_interleaved=True, attn_kv_heads=1),
    "alibi_gqa_shift_memory_tokens": dict(alibi_pos_emb=True, attn_kv_heads=2, shift_tokens=1,
                                          num_memory_tokens=2),
    "t5_rotary_sandwich": dict(rel_pos_bias=True, rotary_pos_emb=True, sandwich_norm=True),
    "alibi_memory_kv_gqa": dict(alibi_pos_emb=True, attn_num_mem_kv=3, attn_kv_heads=2),
    "token_types_emb_dim": dict(embed_num_tokens={"token_type": 2}, emb_dim=24, rotary_pos_emb=True),
    "residual_attn_alibi_memory_kv": dict(residual_attn=True, alibi_pos_emb=True, attn_num_mem_kv=2,
                                          attn_kv_heads=2),
    "talking_heads_topk_t5_padding": dict(attn_talking_heads=True, attn_sparse_topk=3, rel_pos_bias=True),
}
OPTIONS = {**DECODER_OPTIONS, **EXTRA}

# the options the fast step leaves to the module path (heads built differently; the universal stack's
# shared blocks); every other option set, including ones added later, must be covered
NOT_COVERED = {"attn_collab_heads", "position_infused_attn", "universal", "act",
               "rel_pos_shaw", "rel_pos_shaw_keys_only", "rel_pos_xl", "rel_pos_xl_shared_uv"}   # relative terms
NOT_COVERED |= {"ff_moe", "ff_moe_capacity"}     # experts: the module path (FastStep.unsupported names them)
NOT_COVERED |= {"mixture_of_softmax"}            # a head of its own (wrap/outputs.py): the module path
COVERED = set(OPTIONS) - NOT_COVERED


def model_with(name, **extra):
    return perturb(tiny_lm(seed=0, **{**OPTIONS[name], **extra}), scale=0.05)


def prefilled(model, x, mask):
    """A decode state holding the left-padded prompts x."""
    state = model.new_state(x.shape[0], 24)
    with torch.no_grad():
        model(x, mask=mask, pos=left_padded_positions(mask), state=state)
    return state


def steps_match(model, step, batch=3, steps=9, atol=0.0, rtol=0.0, grad=False, autocast=False):
    """Feeds `steps` tokens to `step` and to the module path, each from a state holding the same prompts
    (batch, 7), rows 1 and 2 left-padded by 2 and 5 (the key mask path); asserts their logits equal, bit
    for bit unless given a tolerance. Returns the module path's state and the step's."""
    x, mask = ids(batch, 7), torch.ones(batch, 7, dtype=torch.bool)
    for row, pad in zip(range(1, batch), (2, 5)):
        mask[row, :pad] = False
    slow, fast = prefilled(model, x, mask), prefilled(model, x, mask)
    tokens = ids(batch, steps, seed=5)
    for t in range(steps):
        token = tokens[:, t:t + 1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                expected = model(token, state=slow)
            with torch.set_grad_enabled(grad):
                got = step(token, state=fast)
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m: f"step {t}: {m}")
    return slow, fast


@pytest.mark.parametrize("name", OPTIONS)
def test_fast_step_is_bit_identical_to_the_module_path_or_names_why_not(name):
    model = model_with(name)
    reason = FastStep.unsupported(model)
    if name in COVERED:
        assert reason is None, f"{name}: {reason}"
    if reason is not None:
        assert isinstance(reason, str) and reason
        with pytest.raises(ValueError, match="fast decode step does not cover"):
            FastStep(model)
        return
    slow, fast = steps_match(model, FastStep(model))
    for a, b in ((slow.k, fast.k), (slow.v, fast.v), (slow.pos, fast.pos), (slow.mask, fast.mask)):
        assert torch.equal(a, b)
    assert slow.shift.keys() == fast.shift.keys()                    # token-shift histories
    assert all(torch.equal(slow.shift[i], fast.shift[i]) for i in slow.shift)
    assert slow.length == fast.length == model.num_memory_tokens + 7 + 9


def test_int8_and_unpadded_batches_are_identical_too():
    model = quantize_int8(model_with("gqa_rotary_rms_swiglu"))
    slow, fast = steps_match(model, FastStep(model), batch=1, steps=6)
    assert not fast.padded


@pytest.mark.parametrize("name, reason", [
    ("attn_collab_heads", "collaborative"),
    ("position_infused_attn", "infused"),
])
def test_unsupported_options_name_the_reason(name, reason):
    assert reason in FastStep.unsupported(model_with(name))


def test_training_mode_hooks_and_cross_attention_keep_the_module_path():
    model = model_with("default")
    model.train()
    assert "training" in FastStep.unsupported(model)
    model.eval()
    seen = []
    handle = model.attn_layers.blocks[0].register_forward_hook(lambda *a: seen.append(1))
    assert "hook" in FastStep.unsupported(model)
    AutoregressiveWrapper(model).generate(ids(1, 4), 3, temperature=0.0)
    assert len(seen) == 3                      # the prompt and the two later steps ran the module
    handle.remove()
    assert fast_step(model) is not None
    assert "cross" in FastStep.unsupported(tiny_lm(cross_attend=True))


def test_generate_takes_the_fast_step_and_gives_the_same_tokens(monkeypatch):
    model = model_with("gqa_rotary_rms_swiglu")
    ar = AutoregressiveWrapper(model)
    prompts = ids(2, 6)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :3] = False
    calls = []
    original = FastStep.__call__
    monkeypatch.setattr(FastStep, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    fast = ar.generate(prompts, 10, temperature=0.0, mask=mask)
    assert len(calls) == 9                     # every step after the prompt
    monkeypatch.setattr("polyformer.generate.decode.fast_step", lambda net: None)
    slow = ar.generate(prompts, 10, temperature=0.0, mask=mask)
    assert torch.equal(fast, slow)
    assert torch.equal(fast, ar.generate(prompts, 10, temperature=0.0, mask=mask, cache_kv=False))


def test_bad_calls_are_refused():
    model = model_with("default")
    step = FastStep(model)
    empty = model.new_state(1, 8)
    with pytest.raises(ValueError, match="holding the prompt"):
        step(ids(1, 1), state=empty)
    state = prefilled(model, ids(1, 4), torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="context"):
        step(ids(1, 1), state=state, context=torch.zeros(1, 2, 32))
    with pytest.raises(ValueError, match=r"\[0, 64\)|num_tokens|range"):
        step(torch.tensor([[64]]), state=state)
    full = model.new_state(1, 4)
    with torch.no_grad():
        model(ids(1, 4), state=full)
    with pytest.raises(ValueError, match="room for 4"):
        step(ids(1, 1), state=full)
    bounded = model_with("default")
    long_state = bounded.new_state(1, 40)
    with torch.no_grad():
        bounded(ids(1, 32), state=long_state)                 # max_seq_len 32 positions used up
    with pytest.raises(ValueError, match="max_seq_len=32"):
        FastStep(bounded)(ids(1, 1), state=long_state)


def test_speculative_drafts_and_beam_steps_take_the_fast_step_with_the_same_results(monkeypatch):
    from polyformer import beam_search, speculative_generate

    target, draft = model_with("gqa_rotary_rms_swiglu"), model_with("rotary_pos_emb", depth=1)
    prompts = ids(2, 5)
    calls = []
    original = FastStep.__call__
    monkeypatch.setattr(FastStep, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    spec = speculative_generate(target, draft, prompts, 12, gamma=3, temperature=0.0)
    assert len(calls) > 0                      # the draft's one-token steps
    before_beams = len(calls)
    beams = beam_search(target, prompts, 6, num_beams=3)
    assert len(calls) > before_beams           # beam search's steps too
    used = len(calls)
    monkeypatch.setattr("polyformer.generate.speculative.fast_step", lambda net: None)
    monkeypatch.setattr("polyformer.generate.beam.fast_step", lambda net: None)
    assert len(calls) == used > 0
    assert torch.equal(spec.tokens, speculative_generate(target, draft, prompts, 12, gamma=3, temperature=0.0).tokens)
    slow = beam_search(target, prompts, 6, num_beams=3)
    assert len(calls) == used                  # the module path ran the second time
    assert torch.equal(beams.tokens, slow.tokens) and torch.equal(beams.scores, slow.scores)
    assert torch.equal(spec.tokens, AutoregressiveWrapper(target).generate(prompts, 12, temperature=0.0))


@pytest.mark.parametrize("name", ["default", "gqa_rotary_rms_swiglu", "alibi_gqa_shift_memory_tokens"])
def test_bfloat16_weights_and_autocast_are_identical_too(name):
    for model, autocast in ((model_with(name).to(torch.bfloat16), False), (model_with(name), True)):
        steps_match(model, FastStep(model), batch=2, steps=5, autocast=autocast)
