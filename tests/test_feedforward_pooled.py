"""The pooled training path of the feedforward (polyformer/feedforward.py, polyformer/buffers.py): it
equals autograd's path in output, first and second derivatives for every activation it takes; it is
taken exactly when autograd records a plain feedforward on the CPU; a training loop's later steps
allocate no new buffer, and buffers still held are never handed out again."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from polyformer import buffers, feedforward
from polyformer.config import FeedForwardConfig
from polyformer.feedforward import FeedForward, PooledFeedForward
from tests.helpers import emptied_pool, loss_grads, sgd_steps, tiny_lm


def test_the_pool_is_available_on_this_machine():
    assert buffers.available()


def plain(ff: FeedForward, x: torch.Tensor) -> torch.Tensor:
    """Autograd's path over the same stages, the reference."""
    return FeedForward.compute(x, ff.proj_in, ff.act, ff.proj_out, ff.glu, ff.dropout)


@pytest.fixture
def taken(monkeypatch):
    """How many calls went through PooledFeedForward."""
    seen = []
    real = PooledFeedForward.apply

    def counted(*args):
        seen.append(args[0].shape)
        return real(*args)
    monkeypatch.setattr(PooledFeedForward, "apply", counted)
    return seen


def feedforward_of(activation="gelu", bias=True, dim=12, seed=0, **kw):
    torch.manual_seed(seed)
    return FeedForward(dim, FeedForwardConfig(activation=activation, bias=bias, **kw)).train()


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "swish"])
@pytest.mark.parametrize("bias", [True, False])
def test_output_and_gradients_equal_autograds_path(activation, bias, taken):
    ff = feedforward_of(activation, bias)
    x = torch.randn(3, 7, 12, requires_grad=True)
    weights = [x, *ff.parameters()]
    grad = torch.randn(3, 7, 12)
    ours = ff(x)
    ours_grads = torch.autograd.grad(ours, weights, grad)
    ref = plain(ff, x)
    ref_grads = torch.autograd.grad(ref, weights, grad)
    assert len(taken) == 1
    assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(ours_grads, ref_grads):
        assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_frozen_weights_a_constant_input_and_a_strided_input(taken):
    """Only what autograd asks for is computed; an input that is a strided view is read right."""
    ff = feedforward_of()
    ff.proj_in.weight.requires_grad_(False)
    base = torch.randn(7, 3, 12)
    x = base.transpose(0, 1)                                     # (3, 7, 12), not contiguous
    y = ff(x)
    grads = torch.autograd.grad(y.sum(), [ff.proj_in.bias, ff.proj_out.weight])
    ref = torch.autograd.grad(plain(ff, x).sum(), [ff.proj_in.bias, ff.proj_out.weight])
    assert len(taken) == 1 and y.grad_fn is not None
    for a, b in zip(grads, ref):
        assert_close(a, b, atol=1e-6, rtol=1e-6)
    xg = base.clone().requires_grad_().transpose(0, 1)
    (gx,) = torch.autograd.grad(ff(xg).square().sum(), [xg])
    (rx,) = torch.autograd.grad(plain(ff, xg).square().sum(), [xg])
    assert_close(gx, rx, atol=1e-6, rtol=1e-6)


def test_second_derivatives_equal_autograds_path(taken):
    """create_graph=True: a gradient penalty through the feedforward sees its curvature, in the input
    and in the weights."""
    ff = feedforward_of("gelu")
    x = torch.randn(2, 5, 12, requires_grad=True)
    second = []
    for fn in (ff, lambda t: plain(ff, t)):
        (gx,) = torch.autograd.grad(fn(x).sin().sum(), [x], create_graph=True)
        second.append(torch.autograd.grad(gx.square().sum(), [x, *ff.parameters()]))
    assert len(taken) == 1
    for a, b in zip(*second):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["no_grad", "eval_input_frozen", "glu", "dropout", "relu_squared",
                                  "autocast", "float64_weights", "lora"])
def test_it_steps_aside_where_it_does_not_apply(case, taken):
    ff = feedforward_of(glu=case == "glu", dropout=0.1 if case == "dropout" else 0.0,
                        activation="relu_squared" if case == "relu_squared" else "gelu")
    x = torch.randn(2, 5, 12, requires_grad=True)
    if case == "float64_weights":
        ff.proj_out.double()
        x = x.detach().requires_grad_()
    if case == "lora":                                            # a wrapped linear, not nn.Linear
        inner = ff.proj_in
        ff.proj_in = type("Wrapped", (nn.Module,), {"forward": lambda self, t: inner(t)})()
    if case == "no_grad":
        with torch.no_grad():
            ff(x)
    elif case == "eval_input_frozen":
        for p in ff.parameters():
            p.requires_grad_(False)
        ff(x.detach())
    elif case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ff(x)
    elif case == "float64_weights":
        with pytest.raises(RuntimeError):                         # what autograd's path says about it
            ff(x)
    else:
        ff(x)
    assert taken == []


def test_torch_func_and_compile_keep_autograds_path(taken):
    ff = feedforward_of()
    x = torch.randn(2, 5, 12)
    params = dict(ff.named_parameters())
    grads = torch.func.grad(lambda p: torch.func.functional_call(ff, p, (x,)).square().sum())(params)
    ref = torch.autograd.grad(plain(ff, x).square().sum(), list(params.values()))
    for a, b in zip(grads.values(), ref):
        assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch._dynamo.reset()
    compiled = torch.compile(ff, backend="aot_eager", fullgraph=True)
    xr = x.clone().requires_grad_()
    assert_close(torch.autograd.grad(compiled(xr).sum(), [xr])[0],
                 torch.autograd.grad(plain(ff, xr).sum(), [xr])[0], atol=1e-6, rtol=1e-6)
    assert taken == []


def test_without_the_pool_it_keeps_autograds_path(taken, monkeypatch):
    monkeypatch.setenv("POLYFORMER_CPU_ATTENTION", "0")
    assert not buffers.available()
    ff = feedforward_of()
    ff(torch.randn(2, 5, 12, requires_grad=True))
    assert taken == []
    empty = buffers.empty((3, 4), torch.float32)
    assert empty.shape == (3, 4) and buffers.state() == {"buffers": 0, "free": 0, "bytes": 0}


# --- the pool -----------------------------------------------------------------------------------

def test_pooled_tensors_have_the_asked_shape_and_dtype_and_never_share_while_held():
    held = emptied_pool()
    a = buffers.empty((5, 7), torch.float32)
    b = buffers.empty((5, 7), torch.float32)
    c = buffers.empty((3, 2), torch.bfloat16)
    assert (a.shape, a.dtype, c.shape, c.dtype) == ((5, 7), torch.float32, (3, 2), torch.bfloat16)
    assert a.is_contiguous() and c.is_contiguous()
    a.fill_(1.0)
    b.fill_(2.0)
    assert (a == 1).all() and a.data_ptr() != b.data_ptr()
    assert buffers.state()["buffers"] == held + 3
    pointer = b.data_ptr()
    del b
    again = buffers.empty((5, 7), torch.float32)                # b's buffer, free again
    assert again.data_ptr() == pointer and (a == 1).all()
    del a, again, c
    assert emptied_pool() == held


def test_a_request_takes_the_smallest_free_buffer_that_fits():
    """Best fit: a 40-float request takes a free 40-float buffer over an earlier free 60-float one
    (which also fits), so that requests of two sizes in one step keep their own buffers."""
    held = emptied_pool()
    larger, smaller = buffers.empty((60,), torch.float32), buffers.empty((40,), torch.float32)
    pointers = larger.data_ptr(), smaller.data_ptr()
    del larger, smaller
    first = buffers.empty((40,), torch.float32)
    second = buffers.empty((40,), torch.float32)
    assert (first.data_ptr(), second.data_ptr()) == (pointers[1], pointers[0])
    too_small = buffers.empty((20,), torch.float32)               # 60 and 40 held: a new buffer
    assert buffers.state()["buffers"] == held + 3
    del first, second, too_small
    assert emptied_pool() == held


def test_free_buffers_go_least_recently_used_first_once_they_outweigh_the_peak_handed_out():
    """Free buffers stay while they add up to no more than the most ever handed out at once; past that
    the least recently used goes first, and the pool never drops a buffer still held."""
    held = emptied_pool()
    before = buffers.state()["bytes"]                         # held by tensors of earlier tests
    small = 4096 + before                                     # bytes: larger than everything held
    old = buffers.empty((small,), torch.uint8)
    del old                                                   # free, the least recently used
    big = buffers.empty((3 * small,), torch.uint8)            # too large for old's buffer: a new one
    del big                                                   # free: 4 small, peak handed out 3 small
    assert buffers.state() == {"buffers": held + 2, "free": 2, "bytes": before + 4 * small}
    tiny = buffers.empty((small // 8,), torch.uint8)          # fits neither: new; old's buffer goes
    assert buffers.state() == {"buffers": held + 2, "free": 1, "bytes": before + 3 * small + small // 8}
    again = buffers.empty((3 * small,), torch.uint8)          # big's buffer survived
    assert buffers.state()["buffers"] == held + 2
    del tiny, again
    assert emptied_pool() == held


def test_a_training_loop_allocates_no_new_buffer_after_its_first_step(taken):
    """Every step after the first writes its feedforward hiddens and kept attention weights into the
    buffers the first step left free; the model's gradients equal autograd's path throughout."""
    held = emptied_pool()
    model = tiny_lm(seed=0, depth=3, max_seq_len=70).train()
    x = torch.randint(0, model.num_tokens, (2, 70), generator=torch.Generator().manual_seed(1))
    states = sgd_steps(model, x)
    assert len(taken) == 9                                        # three layers, three steps
    assert states[0]["buffers"] > held and states[1] == states[0] == states[2]
    assert states[0]["free"] == states[0]["buffers"] - held       # nothing held once a step is done
    real = feedforward.pooled_applies
    try:
        feedforward.pooled_applies = lambda *a: False
        ref = loss_grads(model, x)
    finally:
        feedforward.pooled_applies = real
    for a, b in zip(loss_grads(model, x), ref):
        assert_close(a, b, atol=1e-6, rtol=1e-5)
    del ref
    assert emptied_pool() == held
