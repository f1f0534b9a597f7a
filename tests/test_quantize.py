"""Weight-only int8 quantization: the rounding bound, the kernel against the dequantized product,
whole models (cached == uncached, close to float32), and the refusals."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import polyformer.quantize as quantize
from polyformer import AutoregressiveWrapper
from polyformer.quantize import Int8Linear, quantize_int8, quantize_rows
from tests.helpers import ids, tiny_lm
from tests.options import perturb


def test_rows_round_to_within_half_a_step_and_use_the_full_range():
    w = torch.randn(16, 40) * torch.logspace(-3, 1, 16)[:, None]      # rows of very different scale
    w[3] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7 * w.abs()).all()
    nonzero = torch.arange(16) != 3
    assert (q[nonzero].abs().amax(dim=1) == 127).all()               # each row's largest |w| -> 127
    assert scale[3] == 1.0 and (q[3] == 0).all()


def test_float32_rows_get_the_dequantized_product_to_float_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(3, 5, 64)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (3, 5, 48)
    assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert_close(got, linear(x), atol=0.1, rtol=0.05)


def test_bfloat16_rows_take_the_packed_kernel():
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(nn.Linear(64, 48))
    x = torch.randn(3, 64).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), F.linear(x.float(), layer.weight, layer.bias), atol=3e-2, rtol=2e-2)


def test_fallback_is_the_exact_float_product(monkeypatch):
    monkeypatch.setattr(quantize, "_packed_kernel", lambda: False)
    monkeypatch.setattr(quantize, "_int8_kernel", lambda: None)
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(nn.Linear(32, 24, bias=False))
    x = torch.randn(4, 32)
    assert_close(layer(x), x @ layer.weight.T, atol=1e-6, rtol=1e-6)


def _model(**keywords):
    return perturb(tiny_lm(dim=64, heads=4, seed=0, **keywords), scale=0.05)


@pytest.mark.parametrize("keywords", [{}, {"rotary_pos_emb": True, "attn_kv_heads": 2, "ff_glu": True},
                                      {"position_infused_attn": True}, {"tie_embedding": True}])
def test_quantized_model_stays_close_to_float32(keywords):
    model = _model(**keywords)
    x = ids(2, 16)
    reference = model(x)
    before = sum(p.numel() for p in model.parameters())
    quantize_int8(model)
    floats = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    # an infused projection splits its weight per call: it stays in floating point, the rest is int8
    assert floats == ([f"attn_layers.blocks.{i}.branch.project.to_qkv" for i in (0, 2)]
                      if keywords.get("position_infused_attn") else [])
    assert sum(p.numel() for p in model.parameters()) < before
    got = model(x)
    assert ((got - reference).norm() / reference.norm()) < 0.03


def test_quantized_cached_decoding_equals_uncached():
    model = quantize_int8(_model(rotary_pos_emb=True))
    x = ids(2, 12)
    full = model(x)
    state = model.new_state(2, 12)
    cached = torch.cat([model(x[:, :5], state=state)] + [model(x[:, t:t + 1], state=state) for t in range(5, 12)], 1)
    assert_close(cached, full, atol=1e-5, rtol=1e-5)
    ar = AutoregressiveWrapper(model)
    prompts = ids(2, 4)
    assert torch.equal(ar.generate(prompts, 10, temperature=0.0),
                       ar.generate(prompts, 10, temperature=0.0, cache_kv=False))


def test_kernel_path_generates_and_matches_most_float_tokens():
    model = _model()
    prompts = ids(1, 8)
    reference = AutoregressiveWrapper(model).generate(prompts, 24, temperature=0.0)
    got = AutoregressiveWrapper(quantize_int8(model)).generate(prompts, 24, temperature=0.0)
    assert got.shape == reference.shape
    assert (got[:, :4] == reference[:, :4]).all()


def test_state_dict_round_trip_gives_identical_outputs():
    a = quantize_int8(_model())
    torch.manual_seed(1)
    b = quantize_int8(perturb(tiny_lm(dim=64, heads=4), scale=0.05))
    x = ids(2, 10)
    assert not torch.equal(a(x), b(x))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x), b(x))


def test_skip_leaves_named_linears_in_float():
    model = quantize_int8(_model(), skip=("to_logits",))
    assert isinstance(model.to_logits, nn.Linear)
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 2 + 2 * 2   # qkv, out, ff in, ff out


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="model: quantize_int8 is for inference"):
        quantize_int8(tiny_lm().train())
    with pytest.raises(ValueError, match=r"skip: no module named \['to_logit'\]"):
        quantize_int8(tiny_lm(), skip=("to_logit",))
    with pytest.raises(TypeError, match="linear: expected an nn.Linear"):
        Int8Linear.from_linear(nn.Conv1d(2, 2, 1))
