"""The default decode plan's block loop in C++ (generate/native.py): the same rows as the Python loop bit for
bit, taken for the blocks it knows and not for the others, rebound when an input-major copy goes stale; and
the default step's trimmed prelude (embedding lookups, checks once per state) failing as the module path does."""

import pytest
import torch

from polyformer.generate import native
from polyformer.generate.fast import FastStep, fast_step
from tests.generate.test_fast import COVERED, model_with, prefilled, steps_match
from tests.helpers import ids

pytestmark = pytest.mark.skipif(native.extension() is None, reason="the native decode loop could not be built")

NATIVE = ["default", "alibi_pos_emb", "attn_kv_heads", "attn_one_kv_head", "num_memory_tokens", "use_rmsnorm",
          "sandwich_coef", "tie_embedding", "no_abs_pos_emb"]
PYTHON_LOOP = ["rotary_pos_emb", "ff_glu", "gpt2_like"]      # a position stage, a gated or another activation


def run(model, python_loop, steps=6):
    """Logits of `steps` default steps from left-padded prompts (batch 3), and the state they leave."""
    x, mask = ids(3, 7), torch.ones(3, 7, dtype=torch.bool)
    mask[1, :2] = mask[2, :5] = False
    state, step = prefilled(model, x, mask), FastStep(model, tuned=True)
    out = []
    with torch.no_grad():
        for t, token in enumerate(ids(3, steps, seed=5).unbind(1)):
            if python_loop and t == 0:
                step.rows._buffers(model.token_emb.weight.new_empty(3, 1, model.token_emb.weight.shape[1]))
                step.rows.native = None
            out.append(step(token[:, None], state=state))
            assert (step.rows.native is not None) == (not python_loop)
    return torch.cat(out, 1), state


@pytest.mark.parametrize("name", NATIVE)
def test_native_loop_equals_the_python_loop_bit_for_bit(name):
    model = model_with(name)
    (logits, state), (expected, expected_state) = run(model, False), run(model, True)
    assert torch.equal(logits, expected)
    assert torch.equal(state.k, expected_state.k) and torch.equal(state.v, expected_state.v)
    assert state.length == expected_state.length and torch.equal(state.pos, expected_state.pos)


@pytest.mark.parametrize("name", PYTHON_LOOP)
def test_blocks_it_does_not_know_keep_the_python_loop(name):
    assert name in COVERED
    step = FastStep(model_with(name), tuned=True)
    assert step.rows is not None
    step.rows._buffers(torch.zeros(2, 1, model_with(name).token_emb.weight.shape[1]))
    assert step.rows.native is None


def test_a_stale_copy_rebinds_and_steps_on_the_new_weights():
    model = model_with("default")
    qkv = model.attn_layers.blocks[0].branch.project.to_qkv.weight
    step = fast_step(model)
    state = prefilled(model, ids(2, 5), torch.ones(2, 5, dtype=torch.bool))
    slow = prefilled(model, ids(2, 5), torch.ones(2, 5, dtype=torch.bool))
    token = ids(2, 1, seed=3)
    with torch.no_grad():
        step(token, state=state)
        model(token, state=slow)
        first = step.rows.native
        qkv.mul_(1.5)                       # an optimizer step's in-place write: the version counter moves
        got, expected = step(token, state=state), model(token, state=slow)
    assert step.rows.native is not None and step.rows.native is not first
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [256, -1])
def test_a_token_outside_the_vocabulary_is_named_as_on_the_module_path(bad):
    model = model_with("default")
    step = fast_step(model)
    assert step.lookup is not None
    state = prefilled(model, ids(1, 4), torch.ones(1, 4, dtype=torch.bool))
    with torch.no_grad(), pytest.raises(ValueError, match=f"token id {bad}, outside"):
        step(torch.tensor([[bad]]), state=state)
    assert state.length == 4


def test_a_state_of_another_batch_or_a_full_one_is_refused_after_the_first_step():
    model = model_with("default")
    step = fast_step(model)
    state = prefilled(model, ids(2, 4), torch.ones(2, 4, dtype=torch.bool))
    with torch.no_grad():
        step(ids(2, 1), state=state)
        with pytest.raises(ValueError, match="batch size 2"):
            step(ids(3, 1), state=state)
        full = model.new_state(1, 5)
        model(ids(1, 5), state=full)
        with pytest.raises(ValueError, match="room for 5"):
            step(ids(1, 1), state=full)


def test_default_step_with_the_native_loop_equals_the_module_path_to_rounding():
    model = model_with("default")
    step = fast_step(model)
    steps_match(model, step, atol=2e-5, rtol=1e-5)
    assert step.rows.native is not None
