"""The router's losses and statistics through the auxiliary-loss channel."""

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper
from polyformer.losses import loss_names
from tests.helpers import ids, tiny_lm
from tests.moe.helpers import context, moe_layer


def reported(layer, x, **kw):
    ctx = context(x, **kw)
    layer(x, ctx)
    return ctx.losses


def test_balance_loss_is_its_formula():
    layer = moe_layer(ff_num_experts=4, ff_moe_top_k=2, ff_moe_balance_loss=0.03)
    x = torch.randn(3, 7, 8)
    losses = reported(layer, x)
    logits = x.reshape(-1, 8) @ layer.router.weight.T
    probs = logits.softmax(-1)
    chosen = probs.topk(2, -1).indices
    f = torch.stack([(chosen == e).sum() for e in range(4)]).float() / chosen.numel()
    assert_close(losses.terms["moe_balance"], 4 * (f * probs.mean(0)).sum())
    assert losses.weights["moe_balance"] == 0.03
    for e in range(4):
        assert_close(losses.terms[f"moe_load_{e}"], f[e])
        assert losses.weights[f"moe_load_{e}"] == 0.0


@pytest.mark.parametrize("k", [1, 2])
def test_balance_loss_is_alpha_at_uniform_routing_and_grows_with_imbalance(k):
    layer = moe_layer(ff_num_experts=4, ff_moe_top_k=k, ff_moe_balance_loss=0.1)
    x = torch.randn(2, 8, 8)
    with torch.no_grad():
        layer.router.weight.zero_()         # uniform probabilities
    losses = reported(layer, x)
    assert_close(losses.terms["moe_balance"] * losses.weights["moe_balance"], torch.tensor(0.1))
    if k == 1:                               # confident routing over `share` of the 4 experts: E * sum f_i^2
        values = []
        for share in (1, 2, 4):
            with torch.no_grad():
                layer.router.weight.copy_(torch.eye(4, 8) * 50)
            xs = torch.zeros(2, 8, 8)
            for t in range(8):
                xs[:, t, t % share] = 1.0
            values.append(float(reported(layer, xs).terms["moe_balance"].detach()))
        assert_close(torch.tensor(values), torch.tensor([4.0, 2.0, 1.0]))


def test_z_loss_is_the_mean_squared_logsumexp_over_real_tokens():
    layer = moe_layer(ff_num_experts=4, ff_moe_top_k=2, ff_moe_z_loss=1e-3)
    x = torch.randn(2, 6, 8)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False
    losses = reported(layer, x, mask=mask)
    logits = x[mask] @ layer.router.weight.T
    assert_close(losses.terms["moe_z"], torch.logsumexp(logits, -1).square().mean())
    assert losses.weights["moe_z"] == 1e-3


def test_dropped_fraction_is_reported_with_weight_zero_and_not_added():
    layer = moe_layer(causal=True, ff_num_experts=4, ff_moe_top_k=1, ff_moe_capacity=1)
    x = torch.randn(1, 10, 8)
    losses = reported(layer, x, causal=True)
    distinct = len(set((x[0] @ layer.router.weight.T).argmax(-1).tolist()))    # one token per expert is kept
    assert_close(losses.terms["moe_dropped"], torch.tensor(1 - distinct / 10))
    assert losses.weights["moe_dropped"] == 0.0
    total = losses.total()
    assert_close(total, 0.01 * losses.terms["moe_balance"] + 0 * losses.terms["moe_z"])


def test_wrapper_returns_the_losses_and_the_training_loss_adds_them():
    model = tiny_lm(ff_moe=True, ff_num_experts=4, ff_moe_top_k=2, ff_moe_z_loss=0.01, depth=3, ff_moe_every=2,
                    seed=0)
    assert {"moe_balance", "moe_z", "moe_dropped", "moe_load_3"} <= set(loss_names(model))
    x = ids(2, 9)
    _, record = model(x, return_intermediates=True)
    assert set(record.losses.weights) == {"moe_balance", "moe_z", "moe_dropped", *(f"moe_load_{e}" for e in range(4))}
    assert_close(sum(record.losses.terms[f"moe_load_{e}"] for e in range(4)), torch.tensor(1.0))  # one layer of 3
    ar = AutoregressiveWrapper(model.train())
    torch.manual_seed(0)
    loss = ar(x)
    router = model.attn_layers.blocks[3].branch.router.weight
    loss.backward()
    assert router.grad is not None and router.grad.abs().sum() > 0
    logits, again = model(x[:, :-1], return_intermediates=True)
    plain = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:])
    assert float(again.losses.total().detach()) > 0
    assert_close(loss, plain + again.losses.total())       # the weighted balance and z terms are added
