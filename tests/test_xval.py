"""xVal (polyformer/xval.py, polyformer/generate/xval.py; arXiv:2310.02989): the [NUM] embedding scaled by the
number, the number head, the loss (cross-entropy plus the squared error at [NUM] targets) against the formula and
x-transformers' wrappers with the same weights, generation emitting the number head's values at [NUM], cached ==
uncached generation, causality, and the named errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from polyformer import Decoder, Encoder, XValAutoregressiveWrapper, XValTransformerWrapper

V, NUM, D = 12, 3, 16


def xval(seed: int = 0, stack=Decoder, layers: dict | None = None, **wrap) -> XValTransformerWrapper:
    torch.manual_seed(seed)
    attn = stack(dim=D, depth=2, heads=2, **(layers or {}))
    return XValTransformerWrapper(num_tokens=V, max_seq_len=24, numerical_token_id=NUM, attn_layers=attn,
                                  **wrap).eval()


def data(b: int = 2, n: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """ids with [NUM] at every third position, numbers there, NaN elsewhere (never read)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (b, n), generator=g)
    x[:, ::3] = NUM
    nums = torch.randn(b, n, generator=g) * 3
    return x, nums.masked_fill(x != NUM, float("nan"))


@pytest.mark.parametrize("emb_dim", [None, 8])
def test_num_embedding_is_the_value_times_the_num_embedding(emb_dim):
    model = xval(emb_dim=emb_dim).double()
    x, nums = data()
    h = model.embed(x, nums.double())
    ones = model.embed(x, torch.ones_like(nums, dtype=torch.float64))
    is_num = x == NUM
    assert_close(h[is_num], nums.double()[is_num][:, None] * ones[is_num])
    assert_close(h[~is_num], ones[~is_num])              # other tokens ignore x_num (NaN there)
    if emb_dim is None:
        assert_close(ones[is_num], model.token_emb.weight[NUM].expand(int(is_num.sum()), -1))


def test_the_scale_is_applied_before_the_absolute_positions():
    """With one value v at every [NUM]: the model equals a twin whose [NUM] embedding row is v times its own,
    given the value 1 — the positions are added to v * e_NUM, not scaled with it."""
    model = xval(use_abs_pos_emb=True)
    twin = xval(use_abs_pos_emb=True)
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        twin.token_emb.weight[NUM] *= 2.5
    x, _ = data()
    logits, numbers = model(x, torch.full(x.shape, 2.5))
    twin_logits, twin_numbers = twin(x, torch.ones(x.shape))
    assert_close(logits, twin_logits)
    assert_close(numbers, twin_numbers)
    assert not torch.allclose(model(x, torch.ones(x.shape))[1], numbers)


class TheirStack(nn.Module):
    """Our stack, called as x-transformers' wrappers call theirs (returning hiddens), without positions."""

    def __init__(self, stack: nn.Module):
        super().__init__()
        self.stack, self.dim, self.disable_abs_pos_emb = stack, stack.dim, True

    def forward(self, x, mask=None, mems=None, return_hiddens=False, **kwargs):
        return self.stack(x, mask=mask), SimpleNamespace()


@pytest.mark.parametrize("tie", [False, True])
def test_forward_and_loss_equal_x_transformers_xval(tie):
    theirs_mod = pytest.importorskip("x_transformers.xval")
    ours = xval(use_abs_pos_emb=False, tie_embedding=tie)
    theirs = theirs_mod.XValTransformerWrapper(num_tokens=V, max_seq_len=24, numerical_token_id=NUM,
                                               attn_layers=TheirStack(ours.attn_layers), tie_embedding=tie)
    with torch.no_grad():
        theirs.token_emb.emb.weight.copy_(ours.token_emb.weight)
        theirs.to_numerical_output[0].load_state_dict(ours.to_number.state_dict())
        if not tie:
            theirs.to_logits.load_state_dict(ours.to_logits.state_dict())
    x, nums = data()
    for a, b in zip(ours(x, nums), theirs(x, nums)):
        assert_close(a, b)
    x[0, -1] = -100                                   # an ignored target
    mask = torch.ones(x.shape, dtype=torch.bool)
    mask[1, -2:] = False
    ours_ar = XValAutoregressiveWrapper(ours, numerical_loss_weight=0.7)
    theirs_ar = theirs_mod.XValAutoregressiveWrapper(theirs, numerical_loss_weight=0.7)
    loss, parts = ours_ar(x, nums, return_loss_breakdown=True, mask=mask)
    their_loss, their_parts = theirs_ar(x, nums, return_loss_breakdown=True, mask=mask)
    assert_close(loss, their_loss)
    assert_close(parts.numerical_mse_loss, their_parts.numerical_mse_loss)
    assert_close(parts.cross_entropy_loss, their_parts.cross_entropy_loss)


def test_loss_is_cross_entropy_plus_weighted_squared_error_at_num_targets():
    model = xval().double()
    wrapper = XValAutoregressiveWrapper(model, numerical_loss_weight=0.3)
    x, nums = data(n=12)
    x[0, -1] = -100
    loss = wrapper(x, nums)
    logits, numbers = model(x[:, :-1], nums[:, :-1].double())
    target, value = x[:, 1:], nums[:, 1:].double()
    total, count = 0.0, 0
    for b in range(x.shape[0]):
        for t in range(x.shape[1] - 1):
            if target[b, t] == -100:
                continue
            term = -logits[b, t].log_softmax(-1)[target[b, t]]
            if target[b, t] == NUM:
                term = term + 0.3 * (numbers[b, t] - value[b, t]) ** 2
            total, count = total + term, count + 1
    assert_close(loss, total / count)
    loss.backward()
    assert model.to_number.weight.grad.abs().sum() > 0
    model.zero_grad()
    y = x.masked_fill(x == NUM, 0)                     # no [NUM] target: the number head gets no gradient
    wrapper(y, nums).backward()
    assert model.to_number.weight.grad.abs().sum() == 0


def test_loss_adds_the_blocks_auxiliary_losses():
    model, plain = xval(layers=dict(attn_z_loss_weight=0.5)), xval()
    plain.load_state_dict(model.state_dict())
    x, nums = data()
    _, record = model(x[:, :-1], nums[:, :-1], return_intermediates=True)
    extra = XValAutoregressiveWrapper(model)(x, nums) - XValAutoregressiveWrapper(plain)(x, nums)
    assert_close(extra, 0.5 * record.losses.terms["attn_z_loss"])


@pytest.mark.parametrize("layers,wrap", [({}, {}), (dict(rotary_pos_emb=True), dict(num_memory_tokens=2)),
                                         ({}, dict(scaled_sinu_pos_emb=True, emb_dim=8))])
def test_stepped_forward_equals_the_whole_forward(layers, wrap):
    model, (x, nums) = xval(layers=layers, **wrap), data()
    logits, numbers = model(x, nums)
    state = model.new_state(2, x.shape[1])
    parts = [model(x[:, :4], nums[:, :4], state=state)]
    parts += [model(x[:, t:t + 1], nums[:, t:t + 1], state=state) for t in range(4, x.shape[1])]
    assert_close(torch.cat([p[0] for p in parts], 1), logits, atol=1e-5, rtol=1e-5)
    assert_close(torch.cat([p[1] for p in parts], 1), numbers, atol=1e-5, rtol=1e-5)


def test_decoder_is_causal_in_tokens_and_numbers():
    model, (x, nums) = xval(), data()
    nums = nums.nan_to_num(0.5)                       # later tokens may become [NUM]
    logits, numbers = model(x, nums)
    y, other = x.clone(), nums.clone()
    y[:, 7:] = (y[:, 7:] + 1) % V
    other[:, 6] = 10.0                                # position 6 is [NUM]
    later_logits, later_numbers = model(y, other)
    assert_close(later_logits[:, :6], logits[:, :6])
    assert_close(later_numbers[:, :6], numbers[:, :6])
    assert not torch.allclose(later_numbers[:, 6], numbers[:, 6])


def test_generation_emits_the_number_head_value_at_num_tokens():
    model = xval()
    with torch.no_grad():
        model.to_logits.bias[NUM] += 100.0            # always [NUM]
    wrapper = XValAutoregressiveWrapper(model)
    x, nums = data(n=4)
    ids, values, is_number = wrapper.generate(x, nums, 6, temperature=0.0)
    assert bool((ids == NUM).all()) and bool(is_number.all()) and bool(values.isfinite().all())
    whole, whole_nums = torch.cat((x, ids), 1), torch.cat((nums, values), 1)
    _, numbers = model(whole[:, :-1], whole_nums[:, :-1])
    assert_close(values, numbers[:, x.shape[1] - 1:])  # each value is the head's output before it, fed back


@pytest.mark.parametrize("layers,wrap", [({}, {}), (dict(rotary_pos_emb=True), dict(num_memory_tokens=2)),
                                         (dict(attn_kv_heads=1), dict(scaled_sinu_pos_emb=True))])
def test_cached_generation_equals_uncached(layers, wrap):
    model = xval(layers=layers, **wrap)
    with torch.no_grad():
        model.to_logits.bias[NUM] += 2.0              # [NUM] about as likely as the rest together
    wrapper = XValAutoregressiveWrapper(model)
    x, nums = data(n=5)
    runs = [wrapper.generate(x, nums, 8, filter_logits_fn=None, cache_kv=cache,
                             generator=torch.Generator().manual_seed(3)) for cache in (True, False)]
    (ids, values, is_number), (ids2, values2, is_number2) = runs
    assert torch.equal(ids, ids2) and torch.equal(is_number, is_number2)
    assert bool(is_number.any()) and not bool(is_number.all())
    assert_close(values, values2, equal_nan=True, atol=1e-5, rtol=1e-5)
    assert bool(values[~is_number].isnan().all())


def test_generation_past_max_seq_len_keeps_the_last_positions():
    wrapper = XValAutoregressiveWrapper(xval())
    x, nums = data(b=1, n=20)
    ids, values, _ = wrapper.generate(x, nums, 8, temperature=0.0)
    assert ids.shape == (1, 8)
    whole = torch.cat((x, ids), 1)
    whole_nums = torch.cat((nums, values.nan_to_num()), 1)
    logits, _ = wrapper.net(whole[:, -25:-1], whole_nums[:, -25:-1])   # the last step saw 24 = max_seq_len
    assert logits[0, -1].argmax() == ids[0, -1]


def test_readme_block_rewritten():
    """The x-transformers README's xVal block, our sizes: train a step, then generate 5 tokens and numbers."""
    model = XValTransformerWrapper(num_tokens=4, numerical_token_id=3, max_seq_len=32,
                                   attn_layers=Decoder(dim=16, depth=1, heads=2))
    model = XValAutoregressiveWrapper(model)
    ids, nums = torch.randint(0, 4, (1, 20)), torch.randn(1, 20)
    loss = model(ids, nums)
    loss.backward()
    assert loss.isfinite() and all(p.grad is not None for p in model.parameters())
    ids_out, num_out, is_number_mask = model.generate(torch.randint(0, 4, (1, 1)), torch.randn(1, 1), 5)
    assert ids_out.shape == num_out.shape == is_number_mask.shape == (1, 5)
    assert torch.equal(is_number_mask, ids_out == 3) and torch.equal(num_out.isnan(), ~is_number_mask)


@pytest.mark.parametrize("wrap,match", [
    (dict(numerical_token_id=V), "numerical_token_id"), (dict(numerical_token_id=True), "numerical_token_id"),
    (dict(tie_embedding=True, emb_dim=8), "tie_embedding"), (dict(logits_dim=0), "logits_dim"),
    (dict(emb_dropout=1.5), "emb_dropout"), (dict(numerical_token_idx=1), "numerical_token_id")])
def test_bad_options_fail_at_build(wrap, match):
    args = dict(num_tokens=V, max_seq_len=16, numerical_token_id=NUM, attn_layers=Decoder(dim=D, depth=1, heads=2))
    with pytest.raises((ValueError, TypeError), match=match):
        XValTransformerWrapper(**{**args, **wrap})


def test_bad_calls_are_named():
    model, (x, nums) = xval(), data()
    with pytest.raises(ValueError, match="x_num must have the shape"):
        model(x, nums[:, :-1])
    with pytest.raises(TypeError, match="x_num must be a floating"):
        model(x, x)
    with pytest.raises(ValueError, match=r"x_num holds NaN .* \[NUM\]"):
        model(x, torch.full(x.shape, float("nan")))
    with pytest.raises(TypeError, match="XValTransformerWrapper"):
        XValAutoregressiveWrapper(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="causal"):
        XValAutoregressiveWrapper(xval(stack=Encoder))
    with pytest.raises(ValueError, match="numerical_loss_weight"):
        XValAutoregressiveWrapper(model, numerical_loss_weight=-1.0)
    wrapper = XValAutoregressiveWrapper(model)
    with pytest.raises(ValueError, match="seq_len"):
        wrapper.generate(x, nums, 0)
    with pytest.raises(ValueError, match="start_numbers must have the shape"):
        wrapper.generate(x, nums[:, :2], 3)
    with pytest.raises(ValueError, match="mask must have shape"):
        wrapper(x, nums, mask=torch.ones(2, 3, dtype=torch.bool))


def test_config_round_trip_rebuilds_the_same_model():
    from polyformer import build_model, model_config

    torch.manual_seed(0)
    model = XValTransformerWrapper(num_tokens=12, max_seq_len=16, numerical_token_id=3,
                                   attn_layers=Decoder(dim=16, depth=1, heads=2)).eval()
    rebuilt = build_model(json.loads(json.dumps(model_config(model)))).eval()
    rebuilt.load_state_dict(model.state_dict())
    x, nums = torch.randint(0, 12, (2, 6)), torch.randn(2, 6)
    for a, b in zip(model(x, nums), rebuilt(x, nums)):
        torch.testing.assert_close(a, b)
