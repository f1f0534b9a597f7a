"""Our compiled CPU attention kernel, polyformer/attention/kernels/cpu.py: its output and all three
gradients equal the explicit reference path on either side of its 64-row blocks, causal or not, with
more or fewer keys than queries, on strided inputs; the dense kernel takes it exactly when it may
(float32 on the CPU without mask, bias or dropout) and keeps scaled_dot_product_attention
otherwise; a model trained through it gets the gradients it gets through the fused ATen kernel."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.testing import assert_close

from polyformer import buffers
from polyformer.attention.kernels import cpu
from polyformer.attention.kernels.dense import DenseKernel
from polyformer.attention.normalize import Softmax
from polyformer.interfaces import KV
from tests.helpers import emptied_pool, tiny_lm


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


# --- forward-mode AD and torch.func -------------------------------------------------------------

def test_a_direct_call_under_a_transform_is_a_clear_error():
    q, k, v = leaves((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8))
    with pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.func.jvp(lambda t: cpu.attention(t, k, v, 0.3, True), (q,), (torch.ones_like(q),))
    with torch.autograd.forward_ad.dual_level(), pytest.raises(RuntimeError, match="torch.func"):
        cpu.attention(torch.autograd.forward_ad.make_dual(q, torch.ones_like(q)), k, v, 0.3, True)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_forward_mode_ad_through_the_dense_kernel_equals_the_reference(calls, kv_heads):
    """Neither fused kernel has a forward-mode formula (ours would drop the tangent, ATen's CPU flash
    kernel raises): the dense kernel takes its reference path for torch.func.jvp and forward_ad."""
    fused, explicit = (DenseKernel(4, 0.3, 0.0, Softmax(), fused=f) for f in (None, False))
    shapes = (2, 4, 20, 8), (2, kv_heads, 20, 8), (2, kv_heads, 20, 8)
    primals, tangents = (tuple(t.detach() for t in leaves(*shapes, seed=s)) for s in (1, 2))

    def through(kernel):
        return lambda q, k, v: kernel(q, KV(k, v, None, None), mask=None, bias=None, causal=True).out
    _, tangent = torch.func.jvp(through(fused), primals, tangents)
    _, ref_tangent = torch.func.jvp(through(explicit), primals, tangents)
    assert_close(tangent, ref_tangent)
    assert tangent.abs().max() > 0.1
    fw = torch.autograd.forward_ad
    with fw.dual_level():
        dual = fw.unpack_dual(through(fused)(*(fw.make_dual(p, t) for p, t in zip(primals, tangents))))
    assert_close(dual.tangent, ref_tangent)
    assert calls == []


def test_a_tangent_on_the_score_bias_alone_reaches_the_output(calls):
    """forward_ad with a tangent only on an additive bias (a learned T5 / dynamic position bias): the
    reference path carries it, where SDPA would raise."""
    fused, explicit = (DenseKernel(4, 0.3, 0.0, Softmax(), fused=f) for f in (None, False))
    q, k, v, bias, tangent = (t.detach() for t in leaves(*[(2, 4, 12, 8)] * 3, (1, 4, 12, 12), (1, 4, 12, 12)))
    fw = torch.autograd.forward_ad

    def run(kernel):
        with fw.dual_level():
            out = kernel(q, KV(k, v, None, None), mask=None, bias=fw.make_dual(bias, tangent), causal=True).out
            return fw.unpack_dual(out).tangent
    assert_close(run(fused), torch.func.jvp(
        lambda b: explicit(q, KV(k, v, None, None), mask=None, bias=b, causal=True).out, (bias,), (tangent,))[1])


def test_grad_of_grad_under_torch_func_equals_the_reference(calls):
    """grad(grad(f)) (MAML's pattern): SDPA's CPU flash backward has no derivative and our operator
    steps aside under torch.func, so the dense kernel takes its reference path."""
    fused, explicit = (DenseKernel(4, 0.3, 0.0, Softmax(), fused=f) for f in (None, False))
    q, k, v = (t.detach() for t in leaves((2, 4, 20, 8), (2, 2, 20, 8), (2, 2, 20, 8), seed=3))

    def second(kernel):
        def loss(q):
            return kernel(q, KV(k, v, None, None), mask=None, bias=None, causal=True).out.square().sum()
        return torch.func.grad(lambda q: torch.func.grad(loss)(q).square().sum())(q)
    assert_close(second(fused), second(explicit))
    assert calls == []


def test_torch_func_grad_of_a_model_equals_its_backward(calls):
    model = tiny_lm(seed=0, depth=2, max_seq_len=24).train()
    x = torch.randint(0, model.num_tokens, (2, 24), generator=torch.Generator().manual_seed(1))
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p):
        logits = torch.func.functional_call(model, p, (x,))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    grads = torch.func.grad(loss)(params)
    assert calls == []
    loss({name: p for name, p in model.named_parameters()}).backward()
    assert len(calls) == 2
    for name, p in model.named_parameters():
        assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4)


def test_a_model_under_torch_func_grad_and_vmap_gives_per_sample_gradients(calls):
    """vmap(grad(loss)) over a model (per-sample gradients) runs on SDPA and matches a loop of
    ordinary backward passes, which do take the kernel."""
    model = tiny_lm(seed=0, depth=2, max_seq_len=24).train()
    x = torch.randint(0, model.num_tokens, (3, 24), generator=torch.Generator().manual_seed(1))
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p, tokens):
        logits = torch.func.functional_call(model, p, (tokens[None],))
        return torch.nn.functional.cross_entropy(logits[0, :-1], tokens[1:])
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    assert calls == []
    for n, tokens in enumerate(x):
        model.zero_grad()
        logits = model(tokens[None])
        torch.nn.functional.cross_entropy(logits[0, :-1], tokens[1:]).backward()
        for name, p in model.named_parameters():
            assert_close(per_sample[name][n], p.grad, atol=1e-5, rtol=1e-4)
    assert len(calls) == 2 * len(x)


def test_a_models_jacobian_vector_product_agrees_with_its_gradient(calls):
    """u . (J t) from torch.func.jvp equals (J^T u) . t from an ordinary backward pass (on the kernel):
    forward mode through a whole model is exact."""
    model = tiny_lm(seed=0, depth=2, max_seq_len=24, rotary_pos_emb=True)
    x = torch.randint(0, model.num_tokens, (2, 24), generator=torch.Generator().manual_seed(1))
    params = {name: p.detach() for name, p in model.named_parameters()}
    g = torch.Generator().manual_seed(2)
    tangents = {name: torch.randn(p.shape, generator=g) for name, p in params.items()}
    _, jt = torch.func.jvp(lambda p: torch.func.functional_call(model, p, (x,)), (params,), (tangents,))
    assert calls == []
    u = torch.randn(jt.shape, generator=g)
    (u * model(x)).sum().backward()
    assert len(calls) == 2
    jtu = sum((p.grad * tangents[name]).sum() for name, p in model.named_parameters())
    assert_close((u * jt).sum(), jtu, atol=1e-3, rtol=1e-4)


# --- when the dense kernel takes it -------------------------------------------------------------

@pytest.fixture
def calls(monkeypatch):
    """Every call of our kernel, as (kv heads it was handed, scale, causal)."""
    seen = []
    real = cpu.attention

    def counted(*args, **kwargs):
        seen.append((args[1].shape[1], *args[3:]))
        return real(*args, **kwargs)
    monkeypatch.setattr(cpu, "attention", counted)
    return seen


def dense_call(*, mask=False, bias=False, dropout=0.0, dtype=torch.float32, grad=True, kv_heads=4):
    kernel = DenseKernel(4, 0.25, dropout, Softmax()).train()
    torch.manual_seed(0)
    q, k, v = (t.to(dtype).requires_grad_(grad) for t in
               (torch.randn(2, 4, 6, 16), torch.randn(2, kv_heads, 6, 16), torch.randn(2, kv_heads, 6, 16)))
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool) if mask else None
    extra = torch.zeros(1, 4, 6, 6) if bias else None
    return kernel(q, KV(k, v, None, None), mask=keep, bias=extra, causal=True).out


def test_the_dense_kernel_takes_it_for_float32_without_mask_or_bias(calls):
    dense_call()
    dense_call(kv_heads=2)                                      # grouped heads, read in place
    dense_call(kv_heads=1)
    with torch.no_grad():                                       # inference too
        dense_call(grad=False)
    assert calls == [(4, 0.25, True), (2, 0.25, True), (1, 0.25, True), (4, 0.25, True)]  # kv heads unexpanded


@pytest.mark.parametrize("case", [
    dict(mask=True), dict(bias=True), dict(dropout=0.1), dict(dtype=torch.float64)],
    ids=["mask", "bias", "dropout", "float64"])
def test_the_dense_kernel_keeps_sdpa_where_it_does_not_apply(calls, case):
    dense_call(**case)
    assert calls == []


def test_long_inference_keeps_sdpa_and_long_training_does_not(calls):
    kernel = DenseKernel(2, 0.25, 0.0, Softmax())
    n = cpu.LONGEST_INFERENCE + 1
    q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
    with torch.no_grad():
        kernel(q[:, :, :8], KV(k[:, :, :-1], v[:, :, :-1], None, None), mask=None, bias=None, causal=False)
        assert len(calls) == 1
        kernel(q[:, :, :8], KV(k, v, None, None), mask=None, bias=None, causal=False)
        assert len(calls) == 1
    kernel(q[:, :, :8].requires_grad_(), KV(k, v, None, None), mask=None, bias=None, causal=False)
    assert len(calls) == 2


def test_an_empty_key_set_keeps_sdpa(calls):
    """No keys at all (an empty context) goes to SDPA, as before, not to a kernel error."""
    kernel = DenseKernel(4, 0.25, 0.0, Softmax()).train()
    q = torch.randn(2, 4, 6, 16, requires_grad=True)
    empty = torch.zeros(2, 4, 0, 16, requires_grad=True)
    out = kernel(q, KV(empty, empty, None, None), mask=None, bias=None, causal=False).out
    assert calls == [] and torch.equal(out, torch.zeros(2, 4, 6, 16))     # SDPA's and the reference's answer


def test_autocast_switched_off_and_the_environment_keep_sdpa(calls, monkeypatch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense_call()
    with cpu.switched_off():
        dense_call()
    assert calls == []
    monkeypatch.setenv(cpu.SWITCH, "0")
    dense_call()
    assert calls == []
    monkeypatch.setenv(cpu.SWITCH, "1")
    dense_call()
    assert len(calls) == 1


def test_a_kernel_that_cannot_be_built_warns_once_and_falls_back(monkeypatch, calls):
    def broken():
        raise OSError("no compiler here")
    monkeypatch.setattr(cpu, "_built", cpu.lazy(broken))
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        out = dense_call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = dense_call()
    assert calls == [] and torch.equal(out, again)


# --- whole models -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(attn_kv_heads=1), dict(rotary_pos_emb=True)],
                         ids=["plain", "multi-query", "rotary"])
def test_a_model_trains_to_the_same_gradients_as_through_sdpa(calls, kw):
    model = tiny_lm(seed=0, depth=2, max_seq_len=80, **kw).train()
    x = torch.randint(0, model.num_tokens, (2, 80), generator=torch.Generator().manual_seed(1))

    def loss_and_grads():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        return loss, torch.autograd.grad(loss, list(model.parameters()))
    ours = loss_and_grads()
    assert len(calls) == 2                                      # one per layer
    with cpu.switched_off():
        theirs = loss_and_grads()
    assert len(calls) == 2
    assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(ours[1], theirs[1]):
        assert_close(a, b, atol=1e-5, rtol=1e-4)



def compiled_call(model, x):
    """The compiled model's output on x (fullgraph), how many graphs dynamo made and how many nodes of
    them are our kernel."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm
    torch._dynamo.reset()
    out = torch.compile(model, backend=capture, fullgraph=True)(x)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    return out, len(graphs), targets.count("polyformer.attention.default")


def test_torch_compile_keeps_the_kernel_in_one_graph():
    """A registered operator: dynamo traces it into the graph (no break), and the compiled model
    trains to the eager model's gradients."""
    assert cpu.extension() is not None
    model = tiny_lm(seed=0, depth=2, max_seq_len=64).train()
    x = torch.randint(0, model.num_tokens, (2, 64), generator=torch.Generator().manual_seed(1))
    out, graphs, kernels = compiled_call(model, x)
    ref = model(x)
    assert graphs == 1 and kernels == 2
    assert_close(out, ref, atol=1e-5, rtol=1e-5)
    ours = torch.autograd.grad(out.square().mean(), list(model.parameters()))
    theirs = torch.autograd.grad(ref.square().mean(), list(model.parameters()))
    for a, b in zip(ours, theirs):
        assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("builds", [True, False], ids=["builds", "cannot-build"])
def test_a_model_compiled_before_any_eager_call_builds_the_kernel_into_its_graph(monkeypatch, builds):
    """dynamo asks whether the kernel is built outside the graph it traces, so compiling first builds
    it; where it cannot be built, the graph keeps SDPA after one warning."""
    def broken():
        raise OSError("no compiler here")
    monkeypatch.setattr(cpu, "_built", cpu.lazy(None if builds else broken))
    model = tiny_lm(seed=0, depth=2, max_seq_len=32).train()
    x = torch.randint(0, model.num_tokens, (2, 32), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, graphs, kernels = compiled_call(model, x)
    assert graphs == 1 and kernels == (2 if builds else 0)
    assert (cpu._built.module is not None) == builds
    assert sum("no compiler here" in str(w.message) for w in caught) == (0 if builds else 1)
    assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


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


def test_a_missing_kernel_is_a_clear_error_when_called_directly(monkeypatch):
    missing = cpu.lazy()
    missing.error = OSError("no compiler here")
    monkeypatch.setattr(cpu, "_built", missing)
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="not available: no compiler here"):
        cpu.attention(q, q, q, 0.3, True)


def test_shapes_sdpa_broadcasts_keep_sdpa(calls):
    """A batch of one key set against several queries: SDPA broadcasts it, the kernel does not take it."""
    kernel = DenseKernel(4, 0.25, 0.0, Softmax())
    q = torch.randn(3, 4, 6, 16, requires_grad=True)
    k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 6, 16)
    assert cpu.applies(q, k, v, None, None, 0.0) is False
    kernel(q, KV(k, v, None, None), mask=None, bias=None, causal=True)
    assert calls == []


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
