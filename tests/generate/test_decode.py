"""Generation over the decode state: cached == uncached for every decoder option, per-row positions
for left-padded batches, state carried across calls, in-place storage, rollback / reorder."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import (AutoregressiveWrapper, ContinuousAutoregressiveWrapper, ContinuousTransformerWrapper,
                        Decoder, TransformerWrapper, XLAutoregressiveWrapper, XTransformer)
from tests.helpers import ids, tiny_lm
from tests.options import DECODER_KERNELS, DECODER_OPTIONS, DECODER_PATTERNS, perturb

OPTIONS = {**DECODER_OPTIONS, **DECODER_PATTERNS, **DECODER_KERNELS}


def model_with(name):
    torch.manual_seed(0)
    return perturb(tiny_lm(**dict(OPTIONS[name])), scale=0.05)


@pytest.mark.parametrize("name", OPTIONS)
def test_cached_steps_equal_uncached_forward(name):
    model = model_with(name)
    x = ids(2, 14)
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[1, :4] = False                                    # row 1: a shorter, left-padded prompt
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    full = model(x, mask=mask, pos=pos)
    state = model.new_state(2, 14)
    chunks = [model(x[:, :6], mask=mask[:, :6], pos=pos[:, :6], state=state)]
    chunks += [model(x[:, t:t + 1], state=state) for t in range(6, 10)]
    chunks.append(model(x[:, 10:], state=state))           # several new positions at once
    cached = torch.cat(chunks, dim=1)
    keep = mask[:, :, None].expand_as(full)
    assert_close(cached[keep], full[keep], atol=1e-5, rtol=1e-5)
    if model.landmarks is None and model.interspersed is None:   # landmarks / interspersed memory tokens: in it too
        assert state.length == 14 + model.num_memory_tokens


@pytest.mark.parametrize("name", OPTIONS)
def test_greedy_generation_cached_equals_uncached_with_mixed_prompt_lengths(name):
    ar = AutoregressiveWrapper(model_with(name))
    prompts = ids(3, 7)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, :3] = False
    mask[2, :5] = False
    cached = ar.generate(prompts, 8, temperature=0.0, mask=mask)
    uncached = ar.generate(prompts, 8, temperature=0.0, mask=mask, cache_kv=False)
    assert torch.equal(cached, uncached)
    for row, start in ((0, 0), (1, 3), (2, 5)):            # each row equals its prompt alone
        alone = ar.generate(prompts[row:row + 1, start:], 8, temperature=0.0)
        assert torch.equal(cached[row], alone[0])


def test_two_calls_carrying_the_state_equal_one_longer_call():
    ar = AutoregressiveWrapper(model_with("rotary_pos_emb"))
    prompts = ids(2, 5)
    whole = ar.generate(prompts, 12, temperature=0.0)
    state = ar.new_state(2, 5 + 12)
    first = ar.generate(prompts, 5, temperature=0.0, state=state)
    second = ar.generate(first[:, -1:], 7, temperature=0.0, state=state)
    assert torch.equal(torch.cat((first, second), dim=1), whole)


def test_streaming_yields_the_same_tokens_one_at_a_time():
    ar = AutoregressiveWrapper(model_with("default"))
    prompts = ids(2, 4)
    streamed = list(ar.stream(prompts, 6, temperature=0.0))
    assert len(streamed) == 6 and all(t.shape == (2,) for t in streamed)
    assert torch.equal(torch.stack(streamed, 1), ar.generate(prompts, 6, temperature=0.0))


def test_state_is_preallocated_and_written_in_place_with_fewer_kv_heads():
    model = model_with("attn_kv_heads")
    state = model.new_state(2, 10)
    ptr_k, ptr_v = state.k.data_ptr(), state.v.data_ptr()
    assert state.k.shape == (2, 2, 2, 10, 64)              # (layers, b, kv_heads=2, max_len, dim_head)
    x = ids(2, 10)
    for t in range(10):
        model(x[:, t:t + 1], state=state)
    assert (state.k.data_ptr(), state.v.data_ptr()) == (ptr_k, ptr_v)
    with pytest.raises(ValueError, match="room for 10 positions"):
        model(x[:, :1], state=state)


def test_rollback_then_continue_equals_the_shorter_prefix():
    model = model_with("combined")
    x = ids(2, 10)
    state = model.new_state(2, 12)
    model(x[:, :8], state=state)
    state.rollback(3)                                       # forget positions 5, 6, 7
    resumed = model(x[:, 8:10], state=state)
    fresh = model(torch.cat((x[:, :5], x[:, 8:10]), dim=1))[:, -2:]
    assert_close(resumed, fresh, atol=1e-5, rtol=1e-5)


def test_reorder_then_continue_equals_the_reordered_batch():
    model = model_with("shift_tokens")
    x = ids(3, 9)
    state = model.new_state(3, 9)
    model(x[:, :6], state=state)
    order = torch.tensor([2, 0, 0])
    state.reorder(order)
    resumed = model(x[order, 6:], state=state)
    assert_close(resumed, model(x[order])[:, 6:], atol=1e-5, rtol=1e-5)


def test_cross_attention_context_keys_are_computed_once():
    torch.manual_seed(0)
    xt = XTransformer(dim=32, enc_num_tokens=64, enc_depth=1, enc_heads=4, enc_max_seq_len=16,
                      dec_num_tokens=64, dec_depth=2, dec_heads=4, dec_max_seq_len=32).eval()
    src, start = ids(2, 10), ids(2, 3)
    src_mask = torch.ones(2, 10, dtype=torch.bool)
    src_mask[0, 7:] = False
    calls = []
    for block in xt.decoder.net.attn_layers.blocks:
        if block.kind == "c":
            proj = block.branch.project
            original = proj.keys_values
            proj.keys_values = lambda src, original=original: calls.append(1) or original(src)
    cached = xt.generate(src, start, 9, src_mask=src_mask, temperature=0.0)
    assert len(calls) == 2                                  # once per cross-attention block
    uncached = xt.generate(src, start, 9, src_mask=src_mask, temperature=0.0, cache_kv=False)
    assert torch.equal(cached, uncached)


def test_sliding_window_runs_past_max_seq_len_without_absolute_positions():
    torch.manual_seed(0)
    model = tiny_lm(rotary_pos_emb=True, max_seq_len=16)
    ar = AutoregressiveWrapper(model)
    prompts = ids(1, 4)
    long = ar.generate(prompts, 40, temperature=0.0)
    assert long.shape == (1, 40)
    # inside the window nothing slid yet: the same tokens as the exact computation
    assert torch.equal(long[:, :12], ar.generate(prompts, 12, temperature=0.0, cache_kv=False))
    learned = AutoregressiveWrapper(tiny_lm(max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len=16"):
        learned.generate(ids(1, 17), 2)


def test_autoregressive_loss_is_shift_plus_cross_entropy_and_warns_on_disagreeing_mask():
    ar = AutoregressiveWrapper(model_with("default"), ignore_index=-1)
    x = ids(2, 10)
    manual = F.cross_entropy(ar.net(x[:, :-1]).transpose(1, 2), x[:, 1:])
    assert_close(ar(x), manual)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 7:] = False
    with pytest.warns(UserWarning, match="ignore_index"):
        ar(x, mask=mask)
    target_ignored = x.clone()
    target_ignored[0, 7:] = -1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ar(torch.where(target_ignored < 0, 0, target_ignored), mask=None)


def test_xl_wrapper_loss_and_generation_equal_one_long_context():
    torch.manual_seed(0)
    net = TransformerWrapper(num_tokens=64, max_seq_len=8, max_mem_len=64,
                             attn_layers=Decoder(dim=32, depth=2, heads=4, rel_pos_bias=True)).eval()
    xl = XLAutoregressiveWrapper(net)
    x = ids(2, 27)
    full = F.cross_entropy(net(x[:, :-1]).transpose(1, 2), x[:, 1:])
    assert_close(xl(x), full, atol=1e-5, rtol=1e-5)
    prompts = ids(2, 13)
    exact = AutoregressiveWrapper(net).generate(prompts, 10, temperature=0.0, cache_kv=False)
    assert torch.equal(xl.generate(prompts, 10, temperature=0.0), exact)


def test_continuous_wrapper_loss_and_cached_generation():
    torch.manual_seed(0)
    net = ContinuousTransformerWrapper(dim_in=4, dim_out=4, max_seq_len=32,
                                       attn_layers=Decoder(dim=32, depth=2, heads=4, rotary_pos_emb=True))
    wrapper = ContinuousAutoregressiveWrapper(net)
    x = torch.randn(2, 9, 4)
    assert_close(wrapper(x), F.mse_loss(net(x[:, :-1]), x[:, 1:]))
    start = torch.randn(2, 5, 4)
    assert_close(wrapper.generate(start, 6), wrapper.generate(start, 6, cache_kv=False), atol=1e-5, rtol=1e-5)
    one = wrapper.generate(start[1], 6)                  # x-transformers' unbatched start: (seq, dim) -> (6, dim)
    assert_close(one, wrapper.generate(start[1:], 6)[0])
    with pytest.raises(ValueError, match="dim_out"):
        ContinuousAutoregressiveWrapper(ContinuousTransformerWrapper(dim_in=4, dim_out=3, max_seq_len=8,
                                                                     attn_layers=Decoder(dim=16, depth=1)))


def test_eos_pads_finished_rows():
    ar = AutoregressiveWrapper(model_with("default"), pad_value=0)
    prompts = ids(2, 4)
    free = ar.generate(prompts, 8, temperature=0.0)
    eos = int(free[0, 2])
    out = ar.generate(prompts, 8, temperature=0.0, eos_token=eos)
    first = (free[0] == eos).nonzero()[0].item()
    assert torch.equal(out[0, :first + 1], free[0, :first + 1])
    assert (out[0, first + 1:] == 0).all()


@pytest.mark.parametrize("call, match", [
    (lambda ar: ar.generate(torch.zeros(2, 0, dtype=torch.long), 3), "prompts"),
    (lambda ar: ar.generate(ids(2, 3), 0), "seq_len"),
    (lambda ar: ar.generate(ids(2, 3), 2, temperature=-1.0), "temperature"),
    (lambda ar: ar.generate(ids(2, 3), 2, state=ar.new_state(3, 8)), "batch size 3"),
    (lambda ar: ar.generate(ids(2, 3), 2, state=tiny_lm(depth=3).new_state(2, 8)), "another model"),
    (lambda ar: ar.generate(ids(2, 3), 2, repetition_penalty=0.0), "repetition_penalty"),
    (lambda ar: ar.generate(ids(2, 3), 2, state=ar.new_state(2, 8), cache_kv=False), "cache_kv"),
])
def test_bad_generation_input_is_refused(call, match):
    ar = AutoregressiveWrapper(model_with("default"))
    with pytest.raises(ValueError, match=match):
        call(ar)
