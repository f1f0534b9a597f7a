"""Our compiled CPU attention kernel, polyformer/attention/kernels/cpu.py: its output and all three
gradients equal the explicit reference path on either side of its 64-row blocks, causal or not, with
more or fewer keys than queries, on strided inputs, compiled, kept or recomputed weights, pooled
buffers. When the dense kernel takes it, and whole models through it: test_cpu_dispatch.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.testing import assert_close

from polyformer import buffers
from polyformer.attention.kernels import cpu
from polyformer.attention.kernels.dense import DenseKernel
from polyformer.attention.normalize import Softmax
from polyformer.interfaces import KV
from tests.helpers import emptied_pool


def test_the_kernel_builds_on_this_machine():
    assert cpu.extension() is not None, cpu._built.error


def reference(q, k, v, scale, causal):
    """The dense kernel's explicit path (einsum, softmax, einsum), the project's reference."""
    explicit = DenseKernel(q.shape[1], scale, 0.0, Softmax(), fused=False)
    return explicit(q, KV(k, v, None, None), mask=None, bias=None, causal=causal).out


def leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def grads_of(leaf, out, grad_out):
    return (out, *torch.autograd.grad(out, leaf, grad_out.to(out.dtype)))


def grads(fn, q, k, v, grad_out):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype)))


@pytest.fixture(params=["kept", "recomputed", "recomputed-chunk48"])
def path(request):
    """The backward's two ways to the weights: kept by the forward (what training takes up to
    KEEP_KEYS keys), or recomputed from the log-sum-exp in chunks of the default 1024 keys, or of 48,
    small enough that the shapes below span several chunks (the forward without autograd too)."""
    kept = request.param == "kept"
    cpu.extension().set_chunk(48 if request.param.endswith("48") else 1024)
    with contextlib.nullcontext() if kept else cpu.recomputed_weights():
        yield request.param
    cpu.extension().set_chunk(1024)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("i, j", [(1, 1), (5, 5), (63, 63), (64, 64), (65, 65), (130, 130), (200, 200),
                                  (70, 150), (150, 70), (1, 40)])
@pytest.mark.parametrize("d, dv", [(16, 16), (8, 12)])
def test_output_and_gradients_equal_the_reference(causal, i, j, d, dv, path):
    q, k, v = leaves((2, 3, i, d), (2, 3, j, d), (2, 3, j, dv))
    grad_out = torch.randn(2, 3, i, dv)
    scale = d ** -0.5
    ours = grads(lambda *t: cpu.attention(*t, scale, causal), q, k, v, grad_out)
    ref = grads(lambda *t: reference(*t, scale, causal), q, k, v, grad_out)
    for a, b in zip(ours, ref):
        assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_strided_inputs_and_a_stride_zero_head(path):
    """Heads read in place from a fused (b, n, 3, h, d) projection, and one kv head expanded over all."""
    b, n, h, d = 2, 90, 4, 16
    (qkv,) = leaves((b, n, 3, h, d))
    q, k, v = qkv.permute(2, 0, 3, 1, 4)                      # each (b, h, n, d), rows 3 h d apart
    assert q.stride(-2) == 3 * h * d
    grad_out = torch.randn(b, h, n, d)
    ours, ref = (grads_of(qkv, run(q, k, v, 0.3, True), grad_out) for run in (cpu.attention, reference))
    for a, r in zip(ours, ref):
        assert_close(a, r, atol=2e-5, rtol=1e-4)
    q1, k1, v1 = leaves((b, h, n, d), (b, 1, n, d), (b, 1, n, d), seed=3)
    ours = grads(lambda q, k, v: cpu.attention(q, k.expand(-1, h, -1, -1), v.expand(-1, h, -1, -1), 0.25, True),
                 q1, k1, v1, grad_out)
    ref = grads(lambda q, k, v: reference(q, k.expand(-1, h, -1, -1), v.expand(-1, h, -1, -1), 0.25, True),
                q1, k1, v1, grad_out)
    for a, r in zip(ours, ref):
        assert_close(a, r, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_kv_heads_are_read_in_place(kv_heads, path):
    """Six query heads on one or two kv heads: no copy of k and v per query head, and the gradients of
    the shared kv heads sum over their group."""
    q, k, v = leaves((2, 6, 70, 8), (2, kv_heads, 70, 8), (2, kv_heads, 70, 8))
    grad_out = torch.randn(2, 6, 70, 8)
    for causal in (True, False):
        ours = grads(lambda *t: cpu.attention(*t, 0.35, causal), q, k, v, grad_out)
        ref = grads(lambda *t: reference(*t, 0.35, causal), q, k, v, grad_out)
        assert ours[2].shape == k.shape
        for a, b in zip(ours, ref):
            assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_more_keys_than_the_default_chunk():
    q, k, v = leaves((1, 2, 1100, 16), (1, 2, 1100, 16), (1, 2, 1100, 16))
    assert not cpu.keeps(q, k, True)                            # past KEEP_KEYS: recomputed
    grad_out = torch.randn(1, 2, 1100, 16)
    for causal in (True, False):
        ours = grads(lambda *t: cpu.attention(*t, 0.25, causal), q, k, v, grad_out)
        ref = grads(lambda *t: reference(*t, 0.25, causal), q, k, v, grad_out)
        for a, r in zip(ours, ref):
            assert_close(a, r, atol=2e-5, rtol=1e-4)


def test_causal_rows_never_see_later_keys():
    q, k, v = leaves((1, 2, 150, 8), (1, 2, 150, 8), (1, 2, 150, 8))
    out = cpu.attention(q, k, v, 0.35, True)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 100:] += 5.0
    v2[:, :, 100:] -= 3.0
    again = cpu.attention(q, k2, v2, 0.35, True)
    assert torch.equal(out[:, :, :100], again[:, :, :100])
    assert not torch.allclose(out[:, :, 100:], again[:, :, 100:])


def test_large_scores_stay_finite_and_exact(path):
    """The softmax subtracts each row's running maximum: scores of several hundred do not overflow,
    also when a later chunk of keys raises the maximum."""
    q, k, v = leaves((1, 1, 80, 8), (1, 1, 80, 8), (1, 1, 80, 8))
    with torch.no_grad():
        q.mul_(30.0)
    grad_out = torch.randn(1, 1, 80, 8)
    ours = grads(lambda *t: cpu.attention(*t, 1.0, True), q, k, v, grad_out)
    ref = grads(lambda *t: reference(*t, 1.0, True), q, k, v, grad_out)
    for a, r in zip(ours, ref):
        assert torch.isfinite(a).all()
        assert_close(a, r, atol=1e-3, rtol=1e-3)


def test_second_derivatives_equal_the_reference():
    """create_graph=True takes a differentiable backward: a gradient penalty sees attention's curvature."""
    q, k, v = leaves((1, 2, 70, 8), (1, 2, 70, 8), (1, 2, 70, 8))
    second = []
    for fn in (lambda *t: cpu.attention(*t, 0.35, True), lambda *t: reference(*t, 0.35, True)):
        out = fn(q, k, v)
        (g,) = torch.autograd.grad((out * out).sum(), q, create_graph=True)
        second.append(torch.autograd.grad(g.pow(2).sum(), (q, k, v)))
    for a, b in zip(*second):
        assert_close(a, b, atol=1e-4, rtol=1e-4)
    q, k, v = leaves((1, 4, 30, 8), (1, 2, 30, 8), (1, 2, 30, 8))      # grouped kv heads too
    second = []
    for fn in (lambda *t: cpu.attention(*t, 0.35, True), lambda *t: reference(*t, 0.35, True)):
        (g,) = torch.autograd.grad(fn(q, k, v).square().sum(), k, create_graph=True)
        second.append(torch.autograd.grad(g.pow(2).sum(), (q, k, v)))
    for a, b in zip(*second):
        assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_one_tensor_in_several_slots_gets_each_slots_gradient_under_create_graph():
    """x passed as q, k and v: the differentiable backward returns one gradient per slot (autograd adds
    them), not the sum of all three in each slot."""
    (x,) = leaves((1, 2, 30, 8))
    found = []
    for fn in (lambda t: cpu.attention(t, t, t, 0.35, True), lambda t: reference(t, t, t, 0.35, True)):
        (g,) = torch.autograd.grad(fn(x).square().sum(), x, create_graph=True)
        found.append((g, *torch.autograd.grad(g.pow(2).sum(), x)))
    for a, b in zip(*found):
        assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_forward_and_backward_through_aot_autograd_equal_eager(dynamic, path):
    """aot_eager traces the backward too: the backward operator's fake shapes and strides hold, and
    the kept weights' size holds for symbolic lengths (two lengths through one dynamic graph)."""
    assert cpu.extension() is not None
    fn = lambda q, k, v: cpu.attention(q, k, v, 0.25, True)   # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for n in (70, 135):
        q, k, v = leaves((2, 3, n, 16), (2, 3, n, 16), (2, 3, n, 16), seed=n)
        grad_out = torch.randn(2, 3, n, 16)
        for a, b in zip(grads(compiled, q, k, v, grad_out), grads(fn, q, k, v, grad_out)):
            assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_the_operators_pass_opcheck(keep):
    """torch.library's own checks: schema, fake implementation against the real one, autograd."""
    q, k, v = leaves((2, 2, 70, 8), (2, 2, 90, 8), (2, 2, 90, 12))
    torch.library.opcheck(torch.ops.polyformer.attention.default, (q, k, v, 0.3, False, keep))
    out, lse, weights = torch.ops.polyformer.attention(q, k, v, 0.3, True, keep)
    grad = torch.randn_like(out)
    # the backward operator is never differentiated (a second derivative takes plain operations), so
    # its checks leave out those that differentiate it
    torch.library.opcheck(torch.ops.polyformer.attention_backward.default,
                          (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse, weights, 0.3, True),
                          test_utils=("test_schema", "test_faketensor"))


# --- kept weights -------------------------------------------------------------------------------

def test_training_keeps_the_weights_within_its_limits(monkeypatch):
    """Kept only where autograd records the call, up to KEEP_KEYS keys and KEEP_BYTES of weights."""
    q, k = (torch.randn(2, 4, cpu.KEEP_KEYS, 8, requires_grad=True) for _ in range(2))
    assert cpu.keeps(q, k, True) and cpu.keeps(q, k, False)
    with torch.no_grad():
        assert not cpu.keeps(q, k, True)
    assert not cpu.keeps(q.detach(), k.detach(), True)
    assert not cpu.keeps(q, torch.randn(2, 4, cpu.KEEP_KEYS + 1, 8), False)
    with cpu.recomputed_weights():
        assert not cpu.keeps(q, k, True)
    needed = 4 * 2 * 4 * cpu.kept_floats(cpu.KEEP_KEYS, cpu.KEEP_KEYS, True)
    monkeypatch.setattr(cpu, "KEEP_BYTES", needed)
    assert cpu.keeps(q, k, True)
    monkeypatch.setattr(cpu, "KEEP_BYTES", needed - 1)
    assert not cpu.keeps(q, k, True)


@pytest.mark.parametrize("i, j, causal", [(130, 130, True), (70, 150, True), (150, 70, True), (70, 90, False)])
def test_the_kept_weights_are_the_softmax_block_by_block(i, j, causal):
    """Each block of 64 rows keeps its rows' weights over the keys its last row sees, row-major: the
    explicit softmax, zero where causality hides a key."""
    q, k, v = (torch.randn(2, 3, n, 8) for n in (i, j, j))
    _, lse, kept = torch.ops.polyformer.attention(q, k, v, 0.4, causal, True)
    scores = q @ k.transpose(-1, -2) * 0.4
    if causal:
        scores = scores.masked_fill(~torch.ones(i, j, dtype=torch.bool).tril(), float("-inf"))
    weights = scores.softmax(-1)
    assert kept.shape == (2, 3, cpu.kept_floats(i, j, causal))
    at = 0
    for i0 in range(0, i, 64):
        rows = min(64, i - i0)
        keys = min(i0 + rows, j) if causal else j
        block = kept[:, :, at:at + rows * keys].reshape(2, 3, rows, keys)
        assert_close(block, weights[:, :, i0:i0 + rows, :keys], atol=1e-6, rtol=1e-5)
        assert (weights[:, :, i0:i0 + rows, keys:] == 0).all()
        at += rows * keys
    assert at == kept.shape[-1]
    assert_close(lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)


def test_a_pooled_buffer_still_held_is_not_handed_out():
    """A kept-weights tensor held by the caller (here: outliving its graph) keeps its buffer; the next
    call gets another one and the held weights do not change."""
    others = emptied_pool()
    q, k, v = (torch.randn(1, 2, 100, 8) for _ in range(3))
    held = torch.ops.polyformer.attention(q, k, v, 0.3, True, True)[2]
    before = held.clone()
    again = torch.ops.polyformer.attention(q * 2, k, v, 0.3, True, True)[2]
    assert again.data_ptr() != held.data_ptr()
    assert torch.equal(held, before)
    assert buffers.state()["buffers"] == others + 2
    del held, again
    assert emptied_pool() == others


@pytest.mark.parametrize("d", [3, 65])
def test_odd_head_dims_and_single_rows_with_any_stride(d):
    """A length-1 sequence dimension may carry any stride (torch ignores it); the BLAS must not see it."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, d, 1, generator=g).transpose(-1, -2).requires_grad_()   # (2, 3, 1, d), stride 1
    k1 = torch.randn(2, 3, 1, d, generator=g).expand(2, 3, 1, d)
    k = torch.randn(2, 3, 9, d, generator=g).requires_grad_()
    v = torch.randn(2, 3, 9, d, generator=g).requires_grad_()
    assert q.stride(-2) < d
    grad_out = torch.randn(2, 3, 1, d)
    for keys, values in ((k, v), (k1, k1)):
        ours = cpu.attention(q, keys, values, 0.4, False)
        ref = reference(q, keys, values, 0.4, False)
        assert_close(ours, ref, atol=2e-5, rtol=1e-4)
        (a,) = torch.autograd.grad(ours, q, grad_out)
        (b,) = torch.autograd.grad(ref, q, grad_out)
        assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_frozen_inputs_and_a_broadcast_output_gradient():
    """Only some inputs need a gradient; out.sum() hands back an expanded (stride 0) gradient."""
    q, k, v = leaves((1, 2, 80, 8), (1, 2, 80, 8), (1, 2, 80, 8))
    frozen_q = q.detach()
    for args, wanted in (((frozen_q, k, v), (k, v)), ((q, k.detach(), v.detach()), (q,))):
        ours = torch.autograd.grad(cpu.attention(*args, 0.35, True).sum(), wanted)
        ref = torch.autograd.grad(reference(*args, 0.35, True).sum(), wanted)
        for a, b in zip(ours, ref):
            assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_large_outputs_and_gradients_from_reused_buffers_stay_exact():
    """From 1 MiB up the kernel's output and gradients come from the buffer pool: the second call
    writes into the buffers the first one left (dK and dV must be zeroed again, not accumulated onto
    the last call's values), and two outputs alive at once never share one."""
    held = emptied_pool()
    q, k, v = leaves((1, 4, 520, 128), (1, 4, 520, 128), (1, 4, 520, 128))
    assert q.numel() * 4 >= 2 ** 20
    grad_out = torch.randn(1, 4, 520, 128)
    ref = grads(lambda *t: reference(*t, 0.1, True), q, k, v, grad_out)
    for _ in range(2):
        ours = grads(lambda *t: cpu.attention(*t, 0.1, True), q, k, v, grad_out)
        for a, r in zip(ours, ref):
            assert_close(a, r, atol=2e-5, rtol=1e-4)
        del ours, a
    assert buffers.state()["buffers"] > held
    with torch.no_grad():
        first, second = cpu.attention(q, k, v, 0.1, True), cpu.attention(q * 2, k, v, 0.1, True)
    assert first.data_ptr() != second.data_ptr()
    assert_close(first, ref[0], atol=2e-5, rtol=1e-4)
    del first, second
    assert emptied_pool() == held
