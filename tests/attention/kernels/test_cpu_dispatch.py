"""When the dense kernel takes our compiled CPU attention kernel (polyformer/attention/kernels/cpu.py):
exactly when it may (float32 on the CPU without mask, bias or dropout, not under forward-mode AD or
torch.func), else scaled_dot_product_attention; a kernel that cannot be built warns once and falls back;
a model trained through it, compiled or not, gets the gradients it gets through the fused ATen kernel.
The kernel's own numerics are in test_cpu.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

from polyformer.attention.kernels import cpu
from polyformer.attention.kernels.dense import DenseKernel
from polyformer.attention.normalize import Softmax
from polyformer.interfaces import KV
from tests.attention.kernels.test_cpu import leaves
from tests.helpers import tiny_lm

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
