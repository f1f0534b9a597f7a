"""The CPU kernel on q, k and v that are one fused projection's columns (polyformer/attention/kernels/
cpu.py, `packed_columns`): found only for that exact layout, equal to the unpacked call in output and
gradients (exactly: the same arithmetic), one gradient written in place of three, and no zeros made
for the outputs that take no gradient (the log-sum-exp and the kept weights)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from polyformer.attention.kernels import cpu
from tests.attention.kernels.test_cpu import reference
from tests.helpers import emptied_pool, tiny_lm


def heads(t, n):
    b, length, width = t.shape
    return t.view(b, length, n, width // n).transpose(1, 2)


def split(columns, h, hk, d, dv):
    """q, k, v as the model's projection makes them: split the columns, view each as heads."""
    q, k, v = columns.split((h * d, hk * d, hk * dv), dim=-1)
    return heads(q, h), heads(k, hk), heads(v, hk)


def test_packed_columns_are_found_only_for_a_fused_projections_layout():
    columns = torch.randn(2, 9, 4 * 8 + 2 * 8 + 2 * 6)
    q, k, v = split(columns, 4, 2, 8, 6)
    assert cpu.packed_columns(q, k, v) is columns
    assert cpu.packed_columns(q.clone(), k, v) is None                    # q copied out
    assert cpu.packed_columns(q, k, heads(torch.randn(2, 9, 12), 2)) is None   # v from elsewhere
    assert cpu.packed_columns(q, v, k) is None                            # slots in another order
    assert cpu.packed_columns(q[:, :, :5], k[:, :, :5], v[:, :, :5]) is None   # rows cut
    wide = torch.randn(2, 9, 4 * 8 + 2 * 8 + 2 * 6 + 3)[..., :60]         # a base with more columns
    assert cpu.packed_columns(*split(wide, 4, 2, 8, 6)) is None
    swapped = torch.randn(9, 2, 60).transpose(0, 1)                       # a non-contiguous base
    assert cpu.packed_columns(*split(swapped, 4, 2, 8, 6)) is None


@pytest.mark.parametrize("kv_heads, dv", [(4, 8), (2, 8), (1, 8), (4, 12)], ids=["mha", "gqa", "mqa", "dv12"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_the_packed_call_equals_the_unpacked_one_exactly(kv_heads, dv, causal, keep, monkeypatch):
    h, d, n = 4, 8, 70
    g = torch.Generator().manual_seed(kv_heads + dv)
    x = torch.randn(2, n, 16, generator=g, requires_grad=True)
    w = (torch.randn(h * d + kv_heads * (d + dv), 16, generator=g) / 4).requires_grad_()
    grad_out = torch.randn(2, h, n, dv, generator=g)
    packed = []
    real = cpu.attention_packed_op
    monkeypatch.setattr(cpu, "attention_packed_op", lambda *a: packed.append(a[1:4]) or real(*a))

    def run(copy_q):
        q, k, v = split(x @ w.t(), h, kv_heads, d, dv)
        out = cpu.attention(q.clone() if copy_q else q, k, v, 0.3, causal)
        return (out, *torch.autograd.grad(out, (x, w), grad_out))
    with contextlib.nullcontext() if keep else cpu.recomputed_weights():
        ours, unpacked = run(False), run(True)
    assert packed == [(h, kv_heads, dv)]
    for a, b in zip(ours, unpacked):
        assert torch.equal(a, b)
    q, k, v = split(x @ w.t(), h, kv_heads, d, dv)
    out = reference(q, k, v, 0.3, causal)
    for a, b in zip(ours, (out, *torch.autograd.grad(out, (x, w), grad_out))):
        assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_second_derivatives_through_the_packed_call_equal_the_reference():
    x = torch.randn(1, 40, 12, generator=torch.Generator().manual_seed(3), requires_grad=True)
    w = torch.randn(4 * 8 + 2 * 16, 12, generator=torch.Generator().manual_seed(4)) / 4
    found = []
    for fn in (cpu.attention, reference):
        q, k, v = split(x @ w.t(), 4, 2, 8, 8)
        assert cpu.packed_columns(q, k, v) is not None
        (g,) = torch.autograd.grad(fn(q, k, v, 0.35, True).square().sum(), x, create_graph=True)
        found.append((g, *torch.autograd.grad(g.pow(3).sum(), x)))
    for a, b in zip(*found):
        assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_the_packed_operators_pass_opcheck(keep):
    columns = torch.randn(2, 70, 2 * 8 + 1 * 8 + 1 * 12, requires_grad=True)
    torch.library.opcheck(torch.ops.polyformer.attention_packed.default, (columns, 2, 1, 12, 0.3, True, keep))
    out, lse, weights = torch.ops.polyformer.attention_packed(columns, 2, 1, 12, 0.3, True, keep)
    torch.library.opcheck(torch.ops.polyformer.attention_packed_backward.default,
                          (torch.randn_like(out), columns.detach(), out.detach(), lse, weights, 2, 1, 0.3, True),
                          test_utils=("test_schema", "test_faketensor"))


class Recorded(TorchDispatchMode):
    """The ATen operators that ran, with the shapes of what they returned."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,))
                  if isinstance(t, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, shapes))
        return out


def test_a_models_backward_writes_one_projection_gradient_and_no_zeros_for_the_kept_weights():
    """In a training step each layer's attention takes the packed operator; its backward writes the
    fused projection's gradient whole (autograd concatenates nothing) and autograd makes no zeros
    for the log-sum-exp or the kept weights, which take no gradient."""
    model = tiny_lm(seed=0, depth=2, max_seq_len=40).train()
    x = torch.randint(0, model.num_tokens, (2, 40), generator=torch.Generator().manual_seed(1))
    out = model(x)
    with Recorded() as recorded:
        out.square().mean().backward()
    names = [name for name, _ in recorded.ops]
    assert names.count("attention_packed_backward") == 2
    assert "cat" not in names and "attention_backward" not in names
    made = [shape for name, shapes in recorded.ops if name in ("zeros", "zeros_like", "fill_", "zero_", "new_zeros")
            for shape in shapes]
    assert (2, 4, cpu.kept_floats(40, 40, True)) not in made and (2, 4, 40) not in made


def test_the_unpacked_operator_makes_no_zeros_for_its_outputs_without_gradient():
    q, k, v = (torch.randn(2, 4, 40, 8, requires_grad=True) for _ in range(3))
    out = cpu.attention(q, k, v, 0.3, True)
    assert cpu.keeps(q, k, True)
    with Recorded() as recorded:
        out.square().sum().backward()
    made = [shape for name, shapes in recorded.ops if name in ("zeros", "zeros_like", "fill_", "zero_", "new_zeros")
            for shape in shapes]
    assert [name for name, _ in recorded.ops].count("attention_backward") == 1
    assert (2, 4, cpu.kept_floats(40, 40, True)) not in made and (2, 4, 40) not in made


def test_a_reused_gradient_buffer_is_written_afresh():
    """From 1 MiB up the projection's gradient comes from the buffer pool: the second backward writes
    into the buffer the first one left, so its dK and dV columns must be zeroed again, not accumulated
    onto the last call's values."""
    held = emptied_pool()
    x = torch.randn(1, 520, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
    w = torch.randn(3 * 4 * 128, 32, generator=torch.Generator().manual_seed(6)) / 6
    grad_out = torch.randn(1, 4, 520, 128)
    q, k, v = split(x @ w.t(), 4, 4, 128, 128)
    assert q._base.numel() * 4 >= 2 ** 20
    ref = torch.autograd.grad(reference(q, k, v, 0.1, True), x, grad_out)[0]
    for _ in range(2):
        q, k, v = split(x @ w.t(), 4, 4, 128, 128)
        assert cpu.packed_columns(q, k, v) is not None
        assert_close(torch.autograd.grad(cpu.attention(q, k, v, 0.1, True), x, grad_out)[0], ref,
                     atol=1e-4, rtol=1e-4)
    del q, k, v
    assert emptied_pool() == held
