"""The default decode path (`fast_step`: a tuned FastStep over `plan.DecodeLayout`'s input-major weight
copies and `plan.PlainBlock`s): logits equal the module path's to float rounding, greedy tokens
identical, the copies never stale after training / loading / replacing weights, the model's parameters
and state dict untouched, and unknown block branches sent to the module path."""

import pytest
import torch
from torch import nn

from polyformer import AutoregressiveWrapper, quantize_int8
from polyformer.generate import plan
from polyformer.generate.fast import FastStep, fast_step
from polyformer.layout import is_input_major
from tests.generate.test_fast import COVERED, model_with, steps_match
from tests.helpers import ids


def module_path(monkeypatch):
    monkeypatch.setattr("polyformer.generate.decode.fast_step", lambda net: None)


def expanding(model):
    return [m for m in model.modules() if type(m) is nn.Linear and m.out_features > m.in_features]


@pytest.mark.parametrize("name", sorted(COVERED))
def test_tuned_step_equals_the_module_path_to_rounding(name):
    model = model_with(name)
    slow, fast = steps_match(model, FastStep(model, tuned=True), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(fast.k, slow.k, atol=2e-5, rtol=1e-5)
    assert fast.length == slow.length and torch.equal(fast.pos, slow.pos)


def test_plain_blocks_and_copies_are_what_the_default_model_runs():
    model = model_with("default")
    step = fast_step(model)
    assert all(isinstance(b, plan.PlainBlock) for b in step.blocks)
    layout = plan.layout_for(model)
    wanted = expanding(model)
    assert wanted and len(layout.copies) == len(wanted)          # q|k|v and the feedforward's first layer
    assert layout.nbytes() == sum(m.weight.nbytes for m in wanted)
    for m in wanted:
        copy = layout.weight(m.weight)
        assert is_input_major(copy) and torch.equal(copy, m.weight) and copy.data_ptr() != m.weight.data_ptr()
    plan.forget(model)
    assert plan.layout_for(model).nbytes() == 0


@pytest.mark.parametrize("name", ["default", "gqa_rotary_rms_swiglu", "alibi_gqa_shift_memory_tokens", "gpt2_like"])
def test_greedy_tokens_equal_the_module_path_and_the_model_is_untouched(name, monkeypatch):
    model = model_with(name)
    ar = AutoregressiveWrapper(model)
    prompts, mask = ids(2, 6), torch.ones(2, 6, dtype=torch.bool)
    mask[0, :3] = False
    params = [(n, p, p.data_ptr(), p.stride()) for n, p in model.named_parameters()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = ar.generate(prompts, 12, temperature=0.0, mask=mask)
    assert [(n, p, p.data_ptr(), p.stride()) for n, p in model.named_parameters()] == params
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert len(list(model.buffers())) == len(list(model.buffers(recurse=True)))
    module_path(monkeypatch)
    assert torch.equal(fast, ar.generate(prompts, 12, temperature=0.0, mask=mask))


def logits_after(model, prompt):
    """The default step's next-token logits after `prompt`, and the module path's."""
    state, ref = model.new_state(1, 16), model.new_state(1, 16)
    with torch.no_grad():
        model(prompt, state=state)
        model(prompt, state=ref)
        token = ids(1, 1, seed=9)
        return fast_step(model)(token, state=state), model(token, state=ref)


@pytest.mark.parametrize("change", ["optimizer", "load_state_dict", "replace", "data_write"])
def test_weights_changed_after_a_generate_call_are_never_read_stale(change):
    model = model_with("default")
    prompt = ids(1, 5)
    AutoregressiveWrapper(model).generate(prompt, 3, temperature=0.0)     # the copies exist now
    qkv = model.attn_layers.blocks[0].branch.project.to_qkv
    old = plan.layout_for(model).weight(qkv.weight).clone()
    if change == "optimizer":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        AutoregressiveWrapper(model)(ids(2, 8)).backward()
        opt.step()
        model.eval()
    elif change == "load_state_dict":
        model.load_state_dict(model_with("default", ).state_dict() | {"attn_layers.blocks.0.branch.project.to_qkv.weight":
                                                                       torch.randn_like(qkv.weight)})
    elif change == "replace":
        qkv.weight.data = torch.randn_like(qkv.weight)
    else:
        qkv.weight.data.mul_(2.0)                 # bypasses the version counter; the value sample sees it
    got, expected = logits_after(model, prompt)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert not torch.equal(plan.layout_for(model).weight(qkv.weight), old)


def test_weights_changed_in_place_during_a_stream_are_seen_at_the_next_step(monkeypatch):
    model = model_with("default")
    prompt = ids(1, 4)
    ff_in = model.attn_layers.blocks[1].branch.proj_in

    def run() -> list[int]:
        tokens = []
        for i, token in enumerate(AutoregressiveWrapper(model).stream(prompt, 8, temperature=0.0)):
            tokens.append(int(token))
            if i == 3:
                with torch.no_grad():
                    ff_in.weight.mul_(-3.0)       # in place, between two steps of one call
        with torch.no_grad():
            ff_in.weight.div_(-3.0)
        return tokens

    fast = run()
    module_path(monkeypatch)
    assert fast == run()


class OtherFeedForward(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 2 * self.inner(x)


def test_unknown_branches_and_stages_keep_the_module_path(monkeypatch):
    model = model_with("default")
    block = model.attn_layers.blocks[1]
    block.branch = OtherFeedForward(block.branch)              # e.g. a mixture-of-experts feedforward
    assert "OtherFeedForward" in FastStep.unsupported(model)
    assert fast_step(model) is None
    ar, prompt = AutoregressiveWrapper(model), ids(1, 5)
    tokens = ar.generate(prompt, 6, temperature=0.0)
    assert torch.equal(tokens, ar.generate(prompt, 6, temperature=0.0, cache_kv=False))

    model = model_with("default")
    model.attn_layers.blocks[0].branch.extra_stage = nn.Identity()   # a stage added to attention later
    assert "extra_stage" in FastStep.unsupported(model)
    model = model_with("default")
    model.attn_layers.blocks[1].branch.gate = nn.Linear(32, 32)      # one added to the feedforward
    assert "gate" in FastStep.unsupported(model)


def test_int8_and_bfloat16_models_take_the_tuned_step_without_copies():
    for model in (quantize_int8(model_with("gqa_rotary_rms_swiglu")), model_with("default").to(torch.bfloat16)):
        plan.forget(model)
        step = FastStep(model, tuned=True)
        assert plan.layout_for(model).nbytes() == 0                  # copies are for float32 weights only
        tol = 1e-5 if next(model.parameters()).dtype == torch.float32 else 2e-2
        steps_match(model, step, batch=2, steps=4, atol=tol, rtol=tol)


def test_one_plan_serves_other_batch_sizes_and_autograd_and_autocast_modes():
    """The row buffers are remade for a new batch size; with autograd recording or autocast on the step
    keeps the blocks' own calls (buffers written in place take no gradient, no autocast): the same
    logits either way."""
    model = model_with("gqa_rotary_rms_swiglu")
    step = fast_step(model)
    assert step.rows is not None
    for batch in (2, 3, 2):
        steps_match(model, step, batch, steps=4, atol=2e-5, rtol=1e-5)
    steps_match(model, step, 2, steps=4, atol=2e-5, rtol=1e-5, grad=True)
    steps_match(model, step, 2, steps=4, atol=2e-2, rtol=2e-2, autocast=True)


@pytest.mark.parametrize("where, how", [("proj_out", "replace"), ("out", "replace"), ("proj_in", "in_place"),
                                        ("proj_in", "replace")])
def test_weights_changed_during_a_stream_reach_the_row_plan(where, how, monkeypatch):
    """A weight replaced (`.data =`) or changed in place between two steps of one call is read at the
    next step, whether the plan reads it as it is (the shrinking products) or as an input-major copy."""
    model = model_with("default")
    block = model.attn_layers.blocks[1 if where != "out" else 0].branch
    linear = block.output.proj if where == "out" else getattr(block, where)
    original = linear.weight.detach().clone()
    prompt = ids(1, 4)

    def run() -> list[int]:
        linear.weight.data = original.clone()
        tokens = []
        for i, token in enumerate(AutoregressiveWrapper(model).stream(prompt, 8, temperature=0.0)):
            tokens.append(int(token))
            if i == 3:
                with torch.no_grad():
                    if how == "replace":
                        linear.weight.data = -3.0 * original
                    else:
                        linear.weight.mul_(-3.0)
        return tokens

    fast = run()
    module_path(monkeypatch)
    slow = run()
    assert fast == slow
    linear.weight.data = original
    unchanged = AutoregressiveWrapper(model).generate(prompt, 8, temperature=0.0)[0].tolist()
    assert unchanged[:4] == fast[:4] and unchanged != fast          # the change did alter the later tokens
