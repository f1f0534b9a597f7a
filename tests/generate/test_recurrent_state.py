"""The recurrent kind of decode state (kernel attention: Performer, linear, RFA): a fixed-size summary
per block instead of keys, exact under every operation generation uses."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper
from tests.helpers import ids, tiny_lm
from tests.options import KERNEL_OPTIONS, perturb

KERNELS = {name: KERNEL_OPTIONS[f"attn_{name}"] for name in ("performer", "linear", "rfa_gate")}


def model(name: str):
    torch.manual_seed(0)
    return perturb(tiny_lm(num_tokens=64, max_seq_len=512, **KERNELS[name]), scale=0.05)


@pytest.mark.parametrize("name", list(KERNELS))
def test_the_state_keeps_no_keys_and_does_not_grow(name):
    net = model(name)
    state = net.new_state(2, 300)
    assert state.k.numel() == 0 and state.kinds == ("recurrent", "recurrent")
    net(ids(2, 8), state=state)
    small = sum(m.nbytes() for m in state.recurrent_layers.values())
    for t in range(40):
        net(ids(2, 1, seed=t), state=state)
    net(ids(2, 200), state=state)
    assert sum(m.nbytes() for m in state.recurrent_layers.values()) == small
    bigger = net.new_state(2, 3000)
    net(ids(2, 8), state=bigger)
    assert sum(m.nbytes() for m in bigger.recurrent_layers.values()) == small
    assert bigger.nbytes() - state.nbytes() == (3000 - 300) * 2 * 9     # positions and padding flags alone


@pytest.mark.parametrize("name", list(KERNELS))
def test_rollback_within_history_is_exact_and_beyond_it_is_refused_untouched(name):
    net = model(name)
    x = ids(2, 12)
    full = net(x)
    state = net.new_state(2, 20, history=3)
    net(x[:, :6], state=state)
    net(ids(2, 3, seed=9), state=state)           # three wrong tokens
    state.rollback(3)
    assert_close(net(x[:, 6:], state=state), full[:, 6:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="history"):
        state.rollback(4)
    assert state.length == 12                     # nothing rolled back by a refused call
    state.rollback(2)
    assert_close(net(x[:, 10:], state=state), full[:, 10:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(KERNELS))
def test_clone_and_reorder_keep_rows_apart(name):
    net = model(name)
    x = ids(3, 10)
    full = net(x)
    state = net.new_state(3, 10)
    net(x[:, :7], state=state)
    copy = state.clone()
    net(ids(3, 2, seed=4), state=copy)            # the copy moves on; the original must not
    state.reorder(torch.tensor([2, 0]))
    assert_close(net(x[[2, 0], 7:], state=state), full[[2, 0], 7:], atol=1e-5, rtol=1e-5)


def test_generation_matches_the_uncached_loop_for_long_outputs():
    net = model("performer")
    prompts = ids(2, 5)
    wrapper = AutoregressiveWrapper(net)
    cached = wrapper.generate(prompts, 40, temperature=0.0, cache_kv=True)
    uncached = wrapper.generate(prompts, 40, temperature=0.0, cache_kv=False)
    assert torch.equal(cached, uncached)
