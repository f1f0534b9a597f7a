"""Export: `torch.export` of a TransformerWrapper + Decoder forward (dynamic batch and sequence
length) and of one cached decode step equal eager; ONNX export run by onnxruntime gives the eager
logits. The ONNX tests skip only when onnx / onnxscript / onnxruntime are not installed (the
`test` extra installs them)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder, TransformerWrapper
from polyformer.export import (DecodeStep, FunctionalDecodeStep, export_decode_step, export_decoder, export_onnx,
                               export_onnx_decode_step)
from tests.helpers import ids, tiny_encoder, tiny_lm
from tests.options import DECODER_OPTIONS, perturb

SHAPES = [(2, 12), (1, 5), (3, 32), (4, 1)]        # batch and length both vary; 32 = max_seq_len


def gpt(**keywords) -> TransformerWrapper:
    """The README's GPT-style model, scaled down: `tiny_lm` with seed 0."""
    return tiny_lm(seed=0, **keywords)


def test_plain_torch_export_works_on_the_model_itself():
    model = gpt()
    x = ids(2, 12)
    assert_close(torch.export.export(model, (x,)).module()(x), model(x))


@pytest.mark.parametrize("name", ["default", "rotary_pos_emb", "alibi_pos_emb", "attn_kv_heads",
                                  "num_memory_tokens", "combined"])
def test_exported_forward_with_dynamic_batch_and_length_equals_eager(name):
    torch.manual_seed(0)
    model = perturb(tiny_lm(**dict(DECODER_OPTIONS[name])), scale=0.05)
    program = export_decoder(model).module()
    for b, n in SHAPES:
        x = ids(b, n, seed=n)
        assert_close(program(x), model(x), atol=1e-5, rtol=1e-5)


def test_exported_forward_with_a_padding_mask_equals_eager_on_kept_positions():
    model = gpt(rotary_pos_emb=True)
    program = export_decoder(model, mask=True).module()
    x = ids(3, 9)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :4] = False
    keep = mask[..., None].expand(-1, -1, model.num_tokens)
    assert_close(program(x, mask)[keep], model(x, mask=mask)[keep], atol=1e-5, rtol=1e-5)


def test_exported_encoder_forward_equals_eager():
    torch.manual_seed(0)
    model = tiny_encoder(max_seq_len=16)
    program = export_decoder(model).module()
    for b, n in [(2, 16), (3, 4)]:
        x = ids(b, n)
        assert_close(program(x), model(x), atol=1e-5, rtol=1e-5)


def test_export_keeps_the_models_mode_and_bounds_the_length():
    model = gpt().train()
    program = export_decoder(model)
    assert model.training                                   # exported in eval mode, mode restored
    assert_close(program.module()(ids(2, 6)), model.eval()(ids(2, 6)))
    with pytest.raises(AssertionError, match="32"):         # learned positions stop at max_seq_len
        program.module()(ids(1, 33))


@pytest.mark.parametrize("name", ["default", "combined_without_shift"])
def test_exported_decode_steps_equal_cached_eager_steps(name):
    options = dict(DECODER_OPTIONS["combined"], shift_tokens=0) if name != "default" else {}
    torch.manual_seed(0)
    model = perturb(tiny_lm(max_seq_len=64, **options), scale=0.05)
    prompt_program = export_decode_step(model, prompt=True).module()
    step_program = export_decode_step(model).module()
    eager_state, state = model.new_state(3, 30), model.new_state(3, 30)   # batch and max_len differ from the trace
    prompt = ids(3, 5)
    want = model(prompt, state=eager_state)
    got = prompt_program(prompt, state.k, state.v, state.pos, state.mask, 0)
    state.length += prompt.shape[1] + model.num_memory_tokens
    assert_close(got, want, atol=1e-5, rtol=1e-5)
    for _ in range(20):
        token = want[:, -1:].argmax(-1)
        want = model(token, state=eager_state)
        got = step_program(token, state.k, state.v, state.pos, state.mask, state.length)
        state.length += 1                                    # the program wrote the step in place
        assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert state.length == eager_state.length
    assert_close(state.k[:, :, :, :state.length], eager_state.k[:, :, :, :state.length])


def test_decode_step_refuses_attention_patterns_by_name():
    """A windowed (or otherwise patterned) model's step selects cached keys by their positions: traced, that is a
    data-dependent shape, so the export refuses it by name instead of failing inside torch.export."""
    model = tiny_lm(max_seq_len=64, attn_window=4, attn_sink_tokens=1)
    with pytest.raises(ValueError, match="attn_window"):
        export_decode_step(model)


def test_decode_step_module_refuses_state_it_cannot_carry_and_full_states():
    with pytest.raises(ValueError, match="recurrent summary"):
        DecodeStep(tiny_lm(attn_performer=True))
    with pytest.raises(ValueError, match="shift_tokens"):
        DecodeStep(tiny_lm(shift_tokens=1))
    with pytest.raises(ValueError, match="causal"):
        DecodeStep(tiny_lm(Encoder))
    with pytest.raises(TypeError, match="TransformerWrapper"):
        DecodeStep(Decoder(dim=32, depth=1))
    model = gpt()
    step = export_decode_step(model).module()
    state = model.new_state(2, 8)
    with pytest.raises(AssertionError, match="length"):     # no room left: the program's guard
        step(ids(2, 1), state.k, state.v, state.pos, state.mask, 8)


@pytest.fixture
def onnx_session():
    """Opens a saved ONNX file in onnxruntime; skips when the ONNX packages are not installed."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    return lambda path: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_onnx_export_runs_in_onnxruntime_with_the_eager_logits(tmp_path, onnx_session):
    model = perturb(gpt(), scale=0.05)
    path = tmp_path / "gpt.onnx"
    export_onnx(model, path)
    session = onnx_session(path)
    assert [i.name for i in session.get_inputs()] == ["ids"]
    for b, n in SHAPES:
        x = ids(b, n, seed=n)
        (logits,) = session.run(["logits"], {"ids": x.numpy()})
        assert_close(torch.from_numpy(logits), model(x), atol=1e-4, rtol=1e-4)


def test_onnx_export_with_mask_and_rotary(tmp_path, onnx_session):
    model = perturb(gpt(rotary_pos_emb=True, attn_kv_heads=2), scale=0.05)
    path = tmp_path / "gpt_mask.onnx"
    export_onnx(model, path, mask=True)
    session = onnx_session(path)
    x = ids(3, 9)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[2, :5] = False
    (logits,) = session.run(["logits"], {"ids": x.numpy(), "mask": mask.numpy()})
    # a padded query sees no key: eager gives it a zero attention output, ONNX Runtime another
    # value; only the kept positions' logits mean anything
    keep = mask[..., None].expand(-1, -1, model.num_tokens)
    assert_close(torch.from_numpy(logits)[keep], model(x, mask=mask)[keep], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["default", "rotary_pos_emb", "alibi_pos_emb", "attn_kv_heads",
                                  "num_memory_tokens"])
def test_onnx_decode_loop_in_onnxruntime_equals_cached_eager_decoding(tmp_path, onnx_session, name):
    torch.manual_seed(0)
    model = perturb(tiny_lm(**dict(DECODER_OPTIONS[name])), scale=0.05)
    export_onnx_decode_step(model, tmp_path / "prompt.onnx", prompt=True)
    export_onnx_decode_step(model, tmp_path / "step.onnx")
    prompt_session, step_session = onnx_session(tmp_path / "prompt.onnx"), onnx_session(tmp_path / "step.onnx")
    assert [o.name for o in step_session.get_outputs()] == ["logits", "k_out", "v_out", "pos_out", "mask_out"]
    assert [i.name for i in prompt_session.get_inputs()] == ["x", "k", "v", "pos", "mask"]   # length is 0
    eager_state, start = model.new_state(3, 24), model.new_state(3, 24)   # a longer state than traced
    names = ["k", "v", "pos", "mask"]

    def run(session, x, state, length):
        feed = {"x": x.numpy(), **state, "length": torch.tensor(length).numpy()}
        logits, *new = session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})
        return torch.from_numpy(logits), dict(zip(names, new))

    prompt = ids(3, 5)
    state = {n: getattr(start, n).numpy() for n in names}
    got, state = run(prompt_session, prompt, state, 0)
    want = model(prompt, state=eager_state)
    assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not start.k.any()                                  # the inputs are left as they were
    length = prompt.shape[1] + model.num_memory_tokens
    tokens, eager_tokens = [], []
    for _ in range(12):
        token = got[:, -1:].argmax(-1)
        eager_token = want[:, -1:].argmax(-1)
        got, state = run(step_session, token, state, length)
        want = model(eager_token, state=eager_state)
        length += 1
        tokens.append(token), eager_tokens.append(eager_token)
        assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat(tokens, 1), torch.cat(eager_tokens, 1))     # greedy decoding agrees
    assert length == eager_state.length
    assert_close(torch.from_numpy(state["k"])[:, :, :, :length], eager_state.k[:, :, :, :length])


def test_functional_decode_step_returns_the_state_the_in_place_step_writes():
    model = perturb(gpt(rotary_pos_emb=True), scale=0.05)
    in_place, functional = model.new_state(2, 8), model.new_state(2, 8)
    with torch.no_grad():
        model(ids(2, 3), state=in_place), model(ids(2, 3), state=functional)
        step, token = FunctionalDecodeStep(model), ids(2, 1, seed=5)
        want = DecodeStep(model)(token, in_place.k, in_place.v, in_place.pos, in_place.mask, 3)
        before = functional.k.clone()
        got, *new = step(token, functional.k, functional.v, functional.pos, functional.mask, 3)
    assert torch.equal(got, want) and torch.equal(functional.k, before)
    for tensor, name in zip(new, ("k", "v", "pos", "mask")):
        assert torch.equal(tensor, getattr(in_place, name)), name


@pytest.mark.slow
def test_onnx_export_of_the_readme_gpt_at_full_size(tmp_path, onnx_session):
    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=20000, max_seq_len=1024,
                               attn_layers=Decoder(dim=512, depth=12, heads=8)).eval()
    path = tmp_path / "gpt_full.onnx"
    export_onnx(model, path)
    session = onnx_session(path)
    x = torch.randint(0, 20000, (1, 48))
    (logits,) = session.run(["logits"], {"ids": x.numpy()})
    with torch.no_grad():
        assert_close(torch.from_numpy(logits), model(x), atol=1e-4, rtol=1e-4)
