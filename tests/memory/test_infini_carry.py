"""Infini-attention's memory across forward calls (memory/infini_carry.py): two forwards with the memory carried
equal one over both (linear and delta rule), the memory keeps its size, gradients stop at the forward boundary,
rows stay independent and padding out, XLAutoregressiveWrapper trains and generates over it, a decode state
continues it, bfloat16 follows float32, and records from another model are refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, XLAutoregressiveWrapper
from polyformer.memory.infini_carry import resume
from polyformer.memory.memories import Memories
from tests.helpers import ids, tiny_lm

TIGHT = dict(rtol=0, atol=1e-10)


def infini_lm(delta: bool = False, segment: int = 4, **keywords) -> torch.nn.Module:
    """A float64 model on Infini-attention without positions (nothing tells two forwards from one)."""
    keywords = {"use_abs_pos_emb": False, "attn_kv_heads": 2, "attn_dim_head": 8, **keywords}
    return tiny_lm(seed=0, attn_infini=True, attn_infini_segment=segment, attn_infini_delta=delta,
                   **keywords).double()


@pytest.mark.parametrize("delta", [False, True])
def test_two_forwards_with_the_memory_carried_equal_one_over_both(delta):
    net = infini_lm(delta)
    x = ids(2, 22)
    full = net(x)
    first, record = net(x[:, :8], return_intermediates=True)        # two whole segments
    second = net(x[:, 8:], mems=record.mems)                         # a partial last one: nothing follows it
    assert_close(torch.cat((first, second), 1), full, **TIGHT)
    _, record = net(x[:, :12], return_mems=True)                     # return_mems hands the same record
    assert_close(net(x[:, 12:], mems=record), full[:, 12:], **TIGHT)
    assert not torch.allclose(net(x[:, 12:]), full[:, 12:])          # without the memory the past is lost


def test_with_rotary_positions_continued_by_pos_too():
    net = infini_lm(True, rotary_pos_emb=True)
    x = ids(2, 16)
    _, record = net(x[:, :8], return_mems=True)
    second = net(x[:, 8:], mems=record, pos=torch.arange(8, 16)[None])
    assert_close(second, net(x)[:, 8:], **TIGHT)


@pytest.mark.parametrize("delta", [False, True])
def test_the_memory_keeps_its_size_over_many_forwards(delta):
    net = infini_lm(delta)
    x = ids(2, 48)
    mems, shapes = None, []
    for start in range(0, 48, 8):
        _, mems = net(x[:, start:start + 8], mems=mems, return_mems=True)
        assert isinstance(mems, Memories) and mems.mems == [] and mems.cmems is None
        shapes.append([(tuple(m["M"].shape), tuple(m["z"].shape)) for m in mems.infini])
    assert shapes == [[((2, 2, 8, 8), (2, 2, 8))] * 2] * 6
    assert_close(net(x[:, 40:], mems=_mems_after(net, x[:, :40])), net(x)[:, 40:], **TIGHT)


def _mems_after(net, x):
    mems = None
    for start in range(0, x.shape[1], 8):
        _, mems = net(x[:, start:start + 8], mems=mems, return_mems=True)
    return mems


def test_gradients_stop_at_the_forward_boundary():
    net = infini_lm(True).train()
    x = ids(2, 16)
    params = [p for p in net.parameters() if p.requires_grad]
    _, record = net(x[:, :8], return_intermediates=True)
    assert all(not t.requires_grad for m in record.mems.infini for t in m.values())
    with_graph = torch.autograd.grad(net(x[:, 8:], mems=record.mems).square().sum(), params, allow_unused=True)
    with torch.no_grad():
        _, plain = net(x[:, :8], return_intermediates=True)
    without = torch.autograd.grad(net(x[:, 8:], mems=plain.mems).square().sum(), params, allow_unused=True)
    for a, b in zip(with_graph, without):
        assert (a is None and b is None) or torch.equal(a, b)


def test_rows_are_independent_and_padding_stays_out():
    net = infini_lm(False)
    x = ids(2, 16)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False                                              # row 1 ends early in the first forward
    mask[1, 1] = False
    _, record = net(x[:, :8], mask=mask, return_mems=True)
    y = x.clone()
    y[1, [1, 5, 6, 7]] = (y[1, [1, 5, 6, 7]] + 1) % 64              # other tokens where it is padded
    _, changed = net(y[:, :8], mask=mask, return_mems=True)
    alone = net(x[1:, :8], mask=mask[1:], return_mems=True)[1]
    for m, c, a in zip(record.infini, changed.infini, alone.infini):
        for name in ("M", "z"):
            assert_close(c[name], m[name], **TIGHT)
            assert_close(a[name], m[name][1:], **TIGHT)
    out = net(x[:, 8:], mems=record)
    assert_close(net(x[1:, 8:], mems=alone), out[1:], **TIGHT)
    assert_close(net(x[:1, 8:], mems=Memories([], infini=[{k: t[:1] for k, t in m.items()} for m in record.infini])),
                 out[:1], **TIGHT)


def test_xl_wrapper_trains_over_the_memory_and_generates_as_one_forward():
    net = infini_lm(True, max_seq_len=8)
    xl = XLAutoregressiveWrapper(net)
    x = ids(2, 25)
    expected = F.cross_entropy(net(x[:, :-1]).transpose(1, 2), x[:, 1:])
    loss = xl(x)                                                     # three segments of 8
    assert_close(loss, expected, **TIGHT)
    loss.backward()
    assert net.attn_layers.blocks[0].branch.kernel.gate.grad.abs().sum() > 0
    tokens = xl.generate(x[:, :13], 7, temperature=0.0)
    assert torch.equal(tokens, AutoregressiveWrapper(net).generate(x[:, :13], 7, temperature=0.0, cache_kv=False))


@pytest.mark.parametrize("delta", [False, True])
def test_cached_generation_after_a_carried_memory_equals_uncached_over_the_concatenation(delta):
    net = infini_lm(delta)
    x = ids(2, 19)
    _, record = net(x[:, :12], return_intermediates=True)
    state = net.new_state(2, 16, history=2)
    resume(net, state, record.mems)
    steps = [net(x[:, 12:15], state=state)] + [net(x[:, t:t + 1], state=state) for t in range(15, 19)]
    assert_close(torch.cat(steps, 1), net(x)[:, 12:], **TIGHT)
    state = net.new_state(2, 16)
    resume(net, state, record.mems)
    wrapper = AutoregressiveWrapper(net)
    cached = wrapper.generate(x[:, 12:15], 6, temperature=0.0, state=state)
    uncached = wrapper.generate(x[:, :15], 6, temperature=0.0, cache_kv=False)
    assert torch.equal(cached, uncached)


def test_bfloat16_follows_float32_with_a_float32_memory():
    net = infini_lm(True).float()
    x = ids(2, 16)
    _, record = net(x[:, :8], return_mems=True)
    ref = net(x[:, 8:], mems=record)
    low = net.to(torch.bfloat16)
    _, low_record = low(x[:, :8], return_mems=True)
    assert low_record.infini[0]["M"].dtype == torch.float32
    out = low(x[:, 8:], mems=low_record)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_a_record_from_another_model_is_refused_by_name():
    net = infini_lm(False)
    x = ids(2, 8)
    _, own = net(x, return_mems=True)
    _, other_heads = infini_lm(False, attn_kv_heads=4)(x, return_mems=True)
    with pytest.raises(ValueError, match=r"Memories.infini\[0\]\['M'\] must be a float tensor of shape \(2, 2, 8, 8\)"):
        net(x, mems=other_heads)
    with pytest.raises(ValueError, match=r"Memories.infini\[0\]\['M'\].*another model shape or batch"):
        net(x[:1], mems=own)
    _, one_block = infini_lm(False, depth=1)(x, return_mems=True)
    with pytest.raises(ValueError, match=r"Memories.infini must be a list of 2 memories"):
        net(x, mems=one_block)
    with pytest.raises(ValueError, match="record has none"):
        net(x, mems=Memories([]))
    dense_xl = tiny_lm(seed=0, max_mem_len=4).double()
    with pytest.raises(ValueError, match="holds an Infini memory"):
        dense_xl(x, mems=Memories([torch.zeros(2, 4, 32)] * 2, infini=own.infini))
    with pytest.raises(ValueError, match="a list of Transformer-XL memories needs max_mem_len"):
        net(x, mems=[torch.zeros(2, 4, 32)] * 2)
    with pytest.raises(ValueError, match="mems / return_mems need a model built with max_mem_len > 0"):
        tiny_lm(seed=0)(x, return_mems=True)
    state = net.new_state(2, 16)
    net(x[:, :2], state=state)
    with pytest.raises(ValueError, match="resume: the decode state must be empty"):
        resume(net, state, own)
    with pytest.raises(ValueError, match="not in a universal / hourglass stack"):
        tiny_lm(seed=0, attn_infini=True, attn_infini_segment=4, universal=True)(x, return_mems=True)


def test_a_reversible_stacks_recomputation_reads_the_same_carried_memory():
    # the backward recomputes each block from the memory the forward started from: gradients match differences
    net = infini_lm(True, reversible=True).train()
    x = ids(2, 16)
    with torch.no_grad():
        _, record = net(x[:, :8], return_mems=True)
    params = list(net.parameters())

    def loss() -> torch.Tensor:
        return net(x[:, 8:], mems=record).square().mean()

    grads = torch.autograd.grad(loss(), params)
    direction = [torch.randn_like(p) for p in params]
    with torch.no_grad():
        for p, d in zip(params, direction):
            p.add_(1e-6 * d)
        up = loss()
        for p, d in zip(params, direction):
            p.sub_(2e-6 * d)
        down = loss()
    assert_close((up - down) / 2e-6, sum((g * d).sum() for g, d in zip(grads, direction)), rtol=1e-6, atol=1e-9)


def test_with_an_xl_memory_too_both_travel_in_one_record():
    net = infini_lm(False, max_mem_len=4)
    x = ids(2, 16)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 5:7] = False
    _, record = net(x[:, :8], mask=mask, return_mems=True)
    assert [tuple(m.shape) for m in record.mems] == [(2, 4, 32)] * 2
    assert record.mem_masks[0].tolist() == [[True, False, False, True], [True] * 4]
    out = net(x[:, 8:], mems=record)
    emptied = [{k: torch.zeros_like(t) for k, t in m.items()} for m in record.infini]
    assert not torch.allclose(out, net(x[:, 8:], mems=replace(record, infini=emptied)))
    _, again = net(x[:, 8:], mems=record, return_mems=True)
    assert again.mem_masks[0].all() and len(again.infini) == 2
