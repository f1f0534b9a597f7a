"""int8 weights on the native decode path (issue 26): the extension's int8 kernel against the explicit
dequantized product at every instruction set the CPU runs, int8 blocks in the native loop bit for bit
with the Python loop, and the default int8 generate against the module path (logits to float rounding,
greedy tokens identical)."""

import pytest
import torch
from torch.testing import assert_close

import polyformer.quantize as quantize
from polyformer import AutoregressiveWrapper, quantize_int8
from polyformer.generate import native
from polyformer.generate.fast import fast_step
from tests.generate.test_default_layout import module_path
from tests.generate.test_fast import OPTIONS, model_with, steps_match
from tests.generate.test_native_rows import run
from tests.helpers import ids, tiny_lm
from tests.options import perturb

pytestmark = pytest.mark.skipif(native.extension() is None, reason="the native decode loop could not be built")


def reference(x, q, scale, bias):
    """x @ (q * scale).T + bias in float64: the product the kernel rounds."""
    y = x.double() @ (q.double() * scale.double()[:, None]).T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("level", range(native.extension().int8_level() + 1) if native.extension() else [])
@pytest.mark.parametrize("out_features, in_features, batch", [(48, 64, 1), (7, 37, 3), (21, 100, 2), (5, 1, 1)])
def test_kernel_is_the_dequantized_product_to_float_rounding(level, out_features, in_features, batch):
    """Row counts that are no multiple of 4 and sizes that are no multiple of a vector (the tails), strided
    rows, with and without bias, written and accumulated."""
    torch.manual_seed(level)
    q, scale = quantize.quantize_rows(torch.randn(out_features, in_features) * torch.rand(out_features, 1))
    x = torch.randn(batch, in_features + 3)[:, 1:in_features + 1]           # a row stride of its own
    kernel = native.extension().int8_linear
    for bias in (None, torch.randn(out_features)):
        expected = reference(x, q, scale, bias)
        out = torch.full((batch, out_features + 2), float("nan"))[:, :out_features]
        kernel(x, q, scale, bias, out, False, level)
        tol = 1e-6 * (x.abs().double() @ (q.abs().double() * scale.double()[:, None]).T) + 1e-6
        assert ((out.double() - expected).abs() <= tol).all()
        res = torch.randn(batch, out_features)
        start = res.clone()
        kernel(x, q, scale, bias, res, True, level)
        assert ((res.double() - start.double() - expected).abs() <= tol + 1e-6 * start.abs()).all()


def test_a_level_above_the_cpu_is_refused():
    ext = native.extension()
    with pytest.raises(RuntimeError, match="instruction set level"):
        ext.int8_linear(torch.randn(1, 8), torch.ones(4, 8, dtype=torch.int8), torch.ones(4), None,
                        torch.empty(1, 4), False, ext.int8_level() + 1)


def test_module_forward_is_the_dequantized_product_for_few_and_many_rows():
    torch.manual_seed(0)
    layer = quantize.Int8Linear.from_linear(torch.nn.Linear(40, 24))
    for rows in (1, quantize.ROWS, quantize.ROWS + 1):                  # the kernel, then the dequantized weight
        x = torch.randn(rows, 40)
        assert_close(layer(x).double(), reference(x, layer.qweight, layer.scale, layer.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["default", "use_rmsnorm", "attn_kv_heads"])
def test_int8_blocks_run_natively_and_equal_the_python_loop_bit_for_bit(name):
    model = quantize_int8(model_with(name))
    (logits, state), (expected, expected_state) = run(model, False), run(model, True)
    assert torch.equal(logits, expected)
    assert torch.equal(state.k, expected_state.k) and torch.equal(state.v, expected_state.v)


def test_int8_default_step_equals_the_module_path_to_rounding():
    model = quantize_int8(model_with("default"))
    step = fast_step(model)
    steps_match(model, step, atol=2e-5, rtol=1e-5)
    assert step.rows.native is not None


def test_int8_greedy_tokens_equal_the_module_path(monkeypatch):
    model = quantize_int8(model_with("default"))
    ar = AutoregressiveWrapper(model)
    prompts, mask = ids(2, 6), torch.ones(2, 6, dtype=torch.bool)
    mask[0, :3] = False
    fast = ar.generate(prompts, 16, temperature=0.0, mask=mask)
    module_path(monkeypatch)
    assert torch.equal(fast, ar.generate(prompts, 16, temperature=0.0, mask=mask))


def test_a_state_dict_loaded_between_calls_is_decoded_from():
    """The native loop holds the int8 buffers themselves: weights loaded in place reach the next call."""
    model = quantize_int8(model_with("default"))
    other = quantize_int8(perturb(tiny_lm(seed=1, **OPTIONS["default"]), scale=0.05))
    ar, prompts = AutoregressiveWrapper(model), ids(1, 5)
    before = ar.generate(prompts, 12, temperature=0.0)
    model.load_state_dict(other.state_dict())
    got = ar.generate(prompts, 12, temperature=0.0)
    assert torch.equal(got, AutoregressiveWrapper(other).generate(prompts, 12, temperature=0.0))
    assert not torch.equal(got, before)
