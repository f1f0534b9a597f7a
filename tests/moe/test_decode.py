"""MoE decoders with a capacity limit: causal (no token is evicted by a later one), and decoded with the
running counts in the decode state, cached == uncached through rollback, clone and reorder."""

import pytest
import torch
from torch.testing import assert_close

from tests.helpers import ids, tiny_lm
from tests.moe.helpers import context, moe_layer
from tests.options import perturb

CAPACITY = dict(ff_moe=True, ff_num_experts=4, ff_moe_top_k=2, ff_moe_capacity_factor=0.5, ff_glu=True)


def model(**extra):
    return perturb(tiny_lm(seed=0, **{**CAPACITY, **extra}), scale=0.05)


def dropped(net, x):
    _, record = net(x, return_intermediates=True)
    return float(record.losses.terms["moe_dropped"])


def test_a_decoder_with_capacity_is_causal():
    net = model()
    x = ids(2, 16)
    assert dropped(net, x) > 0.2, "the capacity must drop tokens for this test to mean anything"
    out = net(x)
    for cut in (3, 8, 12):
        y = x.clone()
        y[:, cut:] = (y[:, cut:] + 7) % 64              # change only the future
        assert_close(net(y)[:, :cut], out[:, :cut], atol=1e-5, rtol=1e-5)


def test_an_encoder_with_capacity_sees_the_whole_row():
    # the layer alone (no attention to mix the row): only the capacity can make the first tokens see the others
    options = {k: v for k, v in CAPACITY.items() if k != "ff_moe"}
    x = torch.randn(1, 16, 8)
    for causal in (False, True):
        layer = moe_layer(causal=causal, **options)
        full, short = layer(x, context(x, causal))[:, :8], layer(x[:, :8], context(x[:, :8], causal))
        if causal:          # the running capacity of token i depends on no later token
            assert_close(full, short)
        else:               # the row's capacity grows with its length: fewer of the first tokens dropped
            assert not torch.allclose(full, short)


def test_cached_steps_with_capacity_equal_the_uncached_forward():
    net = model()
    x = ids(2, 15)
    full = net(x)
    state = net.new_state(2, 15)
    chunks = [net(x[:, :5], state=state)]
    chunks += [net(x[:, t:t + 1], state=state) for t in range(5, 11)]
    chunks.append(net(x[:, 11:], state=state))
    assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


def test_rollback_clone_and_reorder_keep_the_counts_exact():
    net = model()
    x = ids(3, 12)
    full = net(x)
    state = net.new_state(3, 12)
    net(x[:, :6], state=state)
    copy = state.clone()
    wrong = (x[:, 6:9] + 5) % 64
    net(wrong, state=state)                             # three rejected tokens
    state.rollback(3)
    assert_close(net(x[:, 6:], state=state), full[:, 6:], atol=1e-5, rtol=1e-5)
    assert_close(net(x[:, 6:9], state=copy), full[:, 6:9], atol=1e-5, rtol=1e-5)
    order = torch.tensor([2, 0, 1])
    copy.reorder(order)
    assert_close(net(x[order, 9:], state=copy), full[order, 9:], atol=1e-5, rtol=1e-5)


def test_generation_with_capacity_cached_equals_uncached():
    from polyformer import AutoregressiveWrapper

    ar = AutoregressiveWrapper(model(ff_moe_capacity_factor=None, ff_moe_capacity=2, ff_moe_top_k=1))
    prompts = ids(2, 4)
    cached = ar.generate(prompts, 10, temperature=0.0)
    assert torch.equal(cached, ar.generate(prompts, 10, temperature=0.0, cache_kv=False))


def test_the_exported_decode_step_refuses_the_running_counts_by_name():
    from polyformer.export import DecodeStep

    with pytest.raises(ValueError, match="ff_moe_capacity_factor / ff_moe_capacity"):
        DecodeStep(model())
    DecodeStep(model(ff_moe_capacity_factor=None))      # without a limit the state is keys and values only
