"""The MoE layer against explicit formulas: one expert is the dense feedforward, top-k is the gated sum
of the chosen experts, capacity drops exactly what token-order priority drops, shared experts add."""

import math

import pytest
import torch
from torch.testing import assert_close

from polyformer import Encoder
from tests.moe.helpers import context, moe_layer, reference_keep, reference_output

KINDS = {"gelu": {}, "swiglu": dict(ff_glu=True, ff_swish=True), "relu2_no_bias": dict(ff_relu_squared=True,
                                                                                        ff_no_bias=True)}


@pytest.mark.parametrize("kind", KINDS)
def test_one_expert_top1_without_capacity_is_the_dense_feedforward(kind):
    torch.manual_seed(0)
    moe = Encoder(dim=8, depth=1, heads=2, ff_moe=True, ff_num_experts=1, ff_moe_top_k=1, **KINDS[kind]).eval()
    dense = Encoder(dim=8, depth=1, heads=2, **KINDS[kind]).eval()
    state = {k: v for k, v in moe.state_dict().items() if "blocks.1" not in k}
    ex = moe.blocks[1].branch.experts
    state["blocks.1.norm_in.weight"] = moe.state_dict()["blocks.1.norm_in.weight"]
    state["blocks.1.norm_in.bias"] = moe.state_dict()["blocks.1.norm_in.bias"]
    state["blocks.1.branch.proj_in.weight"] = ex.w_in[0].T
    state["blocks.1.branch.proj_out.weight"] = ex.w_out[0].T
    if ex.b_in is not None:
        state["blocks.1.branch.proj_in.bias"] = ex.b_in[0]
        state["blocks.1.branch.proj_out.bias"] = ex.b_out[0]
    dense.load_state_dict(state)
    x = torch.randn(2, 6, 8)
    assert_close(moe(x), dense(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("k, renormalize", [(1, None), (2, None), (2, False), (3, True), (1, True)])
def test_top_k_is_the_gated_sum_of_the_chosen_experts(k, renormalize):
    layer = moe_layer(ff_num_experts=4, ff_moe_top_k=k, ff_glu=True, ff_moe_renormalize=renormalize)
    x = torch.randn(3, 5, 8)
    out = layer(x, context(x))
    assert_close(out, reference_output(layer, x), atol=1e-6, rtol=1e-5)
    if k == 1 and renormalize is None:      # Switch: the gate is the expert's probability, not 1
        assert not torch.allclose(out, reference_output(moe_layer(ff_num_experts=4, ff_moe_top_k=1, ff_glu=True,
                                                                   ff_moe_renormalize=True), x))


def test_shared_experts_add_an_always_on_feedforward():
    layer = moe_layer(ff_num_experts=4, ff_moe_top_k=2, ff_moe_shared_experts=2)
    assert layer.shared.w_in.shape == (1, 8, 2 * 32)        # two experts of inner 32 as one of 64
    x = torch.randn(2, 5, 8)
    assert_close(layer(x, context(x)), reference_output(layer, x), atol=1e-6, rtol=1e-5)


def spy_counts(layer):
    """Record the tokens each expert processes per call."""
    seen = []
    grouped = layer.experts.grouped

    def record(x, counts):
        seen.append(list(counts))
        return grouped(x, counts)

    layer.experts.grouped = record
    return seen


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k, c, absolute", [(1, 1.0, None), (2, 0.5, None), (2, 1.5, None), (1, None, 2)])
def test_capacity_bound_and_exactly_the_priority_drops_pass_through(causal, k, c, absolute):
    num, n = 4, 12
    options = dict(ff_moe_capacity_factor=c) if c is not None else dict(ff_moe_capacity=absolute)
    layer = moe_layer(causal=causal, ff_num_experts=num, ff_moe_top_k=k, **options)
    with torch.no_grad():       # a router that favours expert 0, so that it overflows
        layer.router.weight[0] += 2 * layer.router.weight[1]
    torch.manual_seed(1)
    x = 0.3 * torch.randn(1, n, 8) + 10 * layer.router.weight[1]
    seen = spy_counts(layer)
    out = layer(x, context(x, causal))
    bound = absolute if absolute is not None else math.ceil(c * n * k / num)
    assert max(seen[0]) <= bound
    experts = torch.softmax(x @ layer.router.weight.T, -1).topk(k, -1).indices
    keep = reference_keep(experts, torch.ones(1, n, dtype=torch.bool), num, k, c, absolute, causal)
    assert (~keep).any(), "the test must drop some tokens"
    assert sum(seen[0]) == int(keep.sum())
    assert_close(out, reference_output(layer, x, keep), atol=1e-6, rtol=1e-5)
    dropped = ~keep.any(-1)
    if dropped.any():           # every choice dropped: the branch gives exactly zero, the residual carries it
        assert torch.equal(out[dropped], torch.zeros_like(out[dropped]))


def test_the_running_capacity_never_exceeds_the_whole_row_bound():
    for seed in range(5):
        layer = moe_layer(causal=True, seed=seed, ff_num_experts=3, ff_moe_top_k=2, ff_moe_capacity_factor=0.8)
        x = torch.randn(2, 17, 8) + 3 * layer.router.weight[seed % 3]
        seen = spy_counts(layer)
        for row in range(2):
            layer(x[row:row + 1], context(x[row:row + 1], True))
        assert max(max(s) for s in seen) <= math.ceil(0.8 * 17 * 2 / 3)


def test_padding_takes_no_capacity_and_gets_no_expert():
    layer = moe_layer(causal=True, ff_num_experts=4, ff_moe_top_k=2, ff_moe_capacity_factor=0.5)
    x = torch.randn(1, 9, 8)
    padded = torch.cat([torch.randn(1, 3, 8), x], dim=1)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[:, :3] = False
    out = layer(padded, context(padded, True, mask))
    assert_close(out[:, 3:], layer(x, context(x, True)))
    assert torch.equal(out[:, :3], torch.zeros(1, 3, 8))


def test_bfloat16_runs_with_a_float32_router():
    layer = moe_layer(ff_num_experts=4, ff_moe_top_k=2, ff_moe_capacity_factor=1.0).to(torch.bfloat16)
    x = torch.randn(2, 6, 8).bfloat16()
    assert layer.router(x.reshape(-1, 8)).logits.dtype == torch.float32
    out = layer(x, context(x))
    assert out.dtype == torch.bfloat16
    ref = layer.float()(x.float(), context(x))      # the same routing: the router saw these values in float32
    assert_close(out.float(), ref, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("kind", KINDS)
def test_the_traced_path_runs_every_expert_and_equals_the_dispatch(kind, monkeypatch):
    # torch.compile / export take `Experts.everywhere`: every expert on every token, the dropped choices' gates 0
    layer = moe_layer(causal=True, ff_num_experts=4, ff_moe_top_k=2, ff_moe_capacity_factor=0.5,
                      ff_moe_shared_experts=1, **KINDS[kind])
    x = torch.randn(2, 9, 8)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    dispatched = layer(x, context(x, True, mask))
    monkeypatch.setattr("polyformer.moe.layer.values_hidden", lambda: True)
    seen = spy_counts(layer)
    traced = layer(x, context(x, True, mask))
    assert seen == []                                   # not the sorted dispatch
    assert_close(traced, dispatched, atol=1e-6, rtol=1e-5)
    experts = torch.softmax(x @ layer.router.weight.T, -1).topk(2, -1).indices
    keep = reference_keep(experts, mask, 4, 2, 0.5, None, True)
    assert (~keep[mask]).any()                          # the capacity drops some choices
    assert_close(traced, reference_output(layer, x, keep), atol=1e-6, rtol=1e-5)
