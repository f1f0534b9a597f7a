"""The pooled linear of CPU training steps (polyformer/pooled.py): equal to F.linear in output, first
and second derivatives; taken exactly where the shared test `applies` says (plain nn.Linear, autograd
recording on the CPU, nothing tracing or transforming); its output is a fresh tensor on reused memory;
in a model it carries the attention projections, and a training loop's gradients stay autograd's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from polyformer import pooled
from polyformer.pooled import PooledLinear
from tests.helpers import emptied_pool, loss_grads, sgd_steps, tiny_lm


@pytest.fixture
def taken(monkeypatch):
    """The input shapes of the calls that went through PooledLinear."""
    seen = []
    real = PooledLinear.apply

    def counted(*args):
        seen.append(tuple(args[0].shape))
        return real(*args)
    monkeypatch.setattr(PooledLinear, "apply", counted)
    return seen


def layer_and_input(bias=True, shape=(3, 7, 12), seed=0):
    torch.manual_seed(seed)
    return nn.Linear(12, 20, bias=bias), torch.randn(*shape, requires_grad=True)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 7, 12), (9, 12), (2, 3, 4, 12)], ids=["3d", "2d", "4d"])
def test_output_and_gradients_equal_f_linear(bias, shape, taken):
    layer, x = layer_and_input(bias, shape)
    params = [x, *layer.parameters()]
    grad = torch.randn(*shape[:-1], 20)
    ours = pooled.linear(layer, x)
    ref = F.linear(x, layer.weight, layer.bias)
    assert taken == [shape]
    assert ours.shape == ref.shape and ours._base is None
    assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(torch.autograd.grad(ours, params, grad), torch.autograd.grad(ref, params, grad)):
        assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_a_strided_input_and_frozen_parameters(taken):
    layer, _ = layer_and_input()
    layer.weight.requires_grad_(False)
    x = torch.randn(12, 7, 3, requires_grad=True).transpose(0, 2)            # (3, 7, 12), strided
    grad = torch.randn(3, 7, 20)
    ours = torch.autograd.grad(pooled.linear(layer, x), (x, layer.bias), grad)
    ref = torch.autograd.grad(F.linear(x, layer.weight, layer.bias), (x, layer.bias), grad)
    assert len(taken) == 1
    for a, b in zip(ours, ref):
        assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_second_derivatives_equal_f_linears(taken):
    layer, x = layer_and_input()
    found = []
    for fn in (lambda t: pooled.linear(layer, t), lambda t: F.linear(t, layer.weight, layer.bias)):
        (g,) = torch.autograd.grad(fn(x).tanh().sum(), x, create_graph=True)
        found.append((g, *torch.autograd.grad(g.pow(2).sum(), (x, layer.weight, layer.bias))))
    assert len(taken) == 1
    for a, b in zip(*found):
        assert_close(a, b, atol=1e-6, rtol=1e-5)


class Scaled(nn.Linear):
    """A subclass with its own forward: never bypassed."""

    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("case", ["no-grad", "nothing-requires-grad", "subclass", "dtype", "autocast",
                                  "torch.func", "forward-ad"])
def test_it_steps_aside_where_autograds_path_must_run(case, taken):
    layer, x = layer_and_input()
    if case == "no-grad":
        with torch.no_grad():
            out = pooled.linear(layer, x)
    elif case == "nothing-requires-grad":
        layer.requires_grad_(False)
        out = pooled.linear(layer, x.detach())
    elif case == "subclass":
        torch.manual_seed(0)
        layer = Scaled(12, 20)
        out = pooled.linear(layer, x)
        assert_close(out, 2 * F.linear(x, layer.weight, layer.bias))
    elif case == "dtype":                                   # ATen's own error, not ours
        with pytest.raises(RuntimeError, match="dtype"):
            pooled.linear(layer, x.double())
    elif case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pooled.linear(layer, x)
        assert out.dtype == torch.bfloat16
    elif case == "torch.func":
        params = dict(layer.named_parameters())
        grads = torch.func.grad(lambda p, t: torch.func.functional_call(layer, p, (t,)).sum())(params, x.detach())
        assert_close(grads["bias"], torch.full((20,), 21.0))
    else:
        import torch.autograd.forward_ad as fwAD
        with fwAD.dual_level():
            dual = fwAD.make_dual(x.detach(), torch.ones_like(x))
            tangent = fwAD.unpack_dual(pooled.linear(layer, dual)).tangent
        assert_close(tangent, layer.weight.sum(1).expand(3, 7, 20).detach())
    assert taken == []


def test_a_compiled_call_keeps_f_linear(taken):
    layer, x = layer_and_input()
    torch._dynamo.reset()
    out = torch.compile(lambda t: pooled.linear(layer, t), backend="aot_eager", fullgraph=True)(x)
    assert taken == []
    assert_close(out, F.linear(x, layer.weight, layer.bias))


def test_its_output_reuses_a_free_buffer_and_never_one_still_held():
    held = emptied_pool()
    layer, x = layer_and_input()
    first = pooled.linear(layer, x)
    second = pooled.linear(layer, x)
    assert first.data_ptr() != second.data_ptr()
    address = first.data_ptr()
    del first
    third = pooled.linear(layer, x)
    assert third.data_ptr() == address
    assert torch.equal(third, second)
    del second, third
    assert emptied_pool() == held


def test_a_models_projections_take_it_and_train_to_autograds_gradients(taken, monkeypatch):
    """Each layer's fused q|k|v and output projections go through it; three SGD steps later the
    gradients still equal autograd's, and the later steps allocate no new buffer."""
    held = emptied_pool()
    model = tiny_lm(seed=0, depth=2, max_seq_len=40).train()
    x = torch.randint(0, model.num_tokens, (2, 40), generator=torch.Generator().manual_seed(1))
    states = sgd_steps(model, x)
    assert len(taken) == 12                                     # two projections, two layers, three steps
    assert states[1] == states[2]
    ours = loss_grads(model, x)
    monkeypatch.setattr(pooled, "linear", lambda layer, t: layer(t))
    ref = loss_grads(model, x)
    for a, b in zip(ours, ref):
        assert_close(a, b, atol=1e-6, rtol=1e-5)
    del ours, ref, model
    assert emptied_pool() == held
