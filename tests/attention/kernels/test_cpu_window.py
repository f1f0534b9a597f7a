"""The compiled CPU attention kernel with a sliding window (polyformer/attention/kernels/cpu.py,
`window`): causal row r sees the keys r - w < j <= r. Output and all three gradients equal a dense
softmax over the explicit band, for windows of one key, windows that cover every row (plain causal),
lengths that are not multiples of the 64-row blocks or of the key chunks, grouped kv heads, kept
or recomputed weights; the kernel computes each block's band of keys and no more; the kept weights
are sized by the band."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.testing import assert_close

from polyformer.attention.kernels import cpu


def test_the_kernel_builds_on_this_machine():
    assert cpu.extension() is not None, cpu._built.error


def banded(q, k, v, scale, window, causal):
    """Dense softmax attention with the band mask spelled out: causal keep r - window < j <= r
    (window 0: plain causal), bidirectional keep |r - j| <= window // 2."""
    h = q.shape[1]
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    i, j = q.shape[-2], k.shape[-2]
    rows, keys = torch.arange(i)[:, None], torch.arange(j)[None, :]
    if causal:
        keep = (keys <= rows) & (keys > rows - window if window else True)
    else:
        keep = (rows - keys).abs() <= window // 2
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    weights = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bhjd->bhid", weights, v)


def leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def grads(fn, q, k, v, grad_out):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


@pytest.fixture(params=["kept", "recomputed", "recomputed-chunk48", "recomputed-chunk7"])
def path(request):
    """The backward's two ways to the weights: kept by the forward, or recomputed from the log-sum-exp
    in chunks of the default 1024 keys, of 48, or of 7 (fewer than a block's 64 rows: a row's band
    may then start several chunks after its block's, and chunks straddle its lower edge)."""
    chunk = int(request.param.split("chunk")[1]) if "chunk" in request.param else 1024
    cpu.extension().set_chunk(chunk)
    with contextlib.nullcontext() if request.param == "kept" else cpu.recomputed_weights():
        yield request.param
    cpu.extension().set_chunk(1024)


@pytest.mark.parametrize("i, j, window", [
    (1, 1, 1), (5, 5, 1), (70, 70, 1), (70, 70, 3), (130, 130, 64), (130, 130, 65), (200, 200, 100),
    (150, 150, 150), (90, 90, 200), (257, 257, 31), (70, 150, 20), (150, 100, 60)],
    ids=lambda x: str(x))
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_output_and_gradients_equal_the_banded_reference(i, j, window, kv_heads, path):
    matches_the_band(i, j, window, kv_heads, path, causal=True)


def matches_the_band(i: int, j: int, window: int, kv_heads: int, path: str, causal: bool) -> None:
    """The kernel's output and q / k / v gradients equal the explicit band's (both directions' tests)."""
    q, k, v = leaves((2, 4, i, 16), (2, kv_heads, j, 16), (2, kv_heads, j, 8), seed=i + window)
    grad_out = torch.randn(2, 4, i, 8, generator=torch.Generator().manual_seed(1))
    if path == "kept" and i > 1:
        assert cpu.keeps(q, k, causal, window)
    ours = grads(lambda *t: cpu.attention(*t, 0.25, causal, window=window), q, k, v, grad_out)
    ref = grads(lambda *t: banded(*t, 0.25, window, causal), q, k, v, grad_out)
    assert ours[2].shape == k.shape
    for a, b in zip(ours, ref):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_a_window_that_covers_every_row_is_plain_causal_attention(keep):
    q, k, v = (torch.randn(1, 2, 100, 8) for _ in range(3))
    plain = torch.ops.polyformer.attention(q, k, v, 0.3, True, keep)
    for window in (100, 101, 10_000):
        banded = torch.ops.polyformer.attention(q, k, v, 0.3, True, keep, window)
        for a, b in zip(plain, banded):
            assert torch.equal(a, b)
        assert torch.equal(cpu.attention(q, k, v, 0.3, True, window=window), cpu.attention(q, k, v, 0.3, True))


def test_the_kept_weights_are_sized_by_the_band():
    """kept_floats (closed form, for symbolic sizes) equals the kernel's own count, and the weights a
    call keeps: rows times the keys of each block's band, from its first row's first key on."""
    kept_per_task = cpu.extension().kept_per_task
    for i in (1, 63, 64, 65, 127, 128, 129, 300, 1000):
        for window in (1, 2, 63, 64, 65, 100, 128, 129, 500, 2000):
            for j in {i, i + 37, max(i - window + 1, 1)}:
                blocks = [(i0, min(64, i - i0)) for i0 in range(0, i, 64)]
                want = sum(n * (min(i0 + n, j) - max(0, i0 - window + 1)) for i0, n in blocks)
                assert kept_per_task(i, j, True, window) == want, (i, j, window)
                assert cpu.kept_floats(i, j, True, window) == want, (i, j, window)
    q, k, v = (torch.randn(2, 3, 300, 8) for _ in range(3))
    _, lse, kept = torch.ops.polyformer.attention(q, k, v, 0.4, True, True, 20)
    assert kept.shape == (2, 3, cpu.kept_floats(300, 300, True, 20))
    assert kept.shape[-1] < cpu.kept_floats(300, 300, True) / 2
    # each block's weights, row-major over its band: the banded softmax, zero outside each row's band
    scores = (q @ k.transpose(-1, -2) * 0.4)
    rows, keys = torch.arange(300)[:, None], torch.arange(300)[None, :]
    weights = scores.masked_fill(~((keys <= rows) & (keys > rows - 20)), float("-inf")).softmax(-1)
    at = 0
    for i0 in range(0, 300, 64):
        n, lo, hi = min(64, 300 - i0), max(0, i0 - 19), min(i0 + 64, 300)
        block = kept[:, :, at:at + n * (hi - lo)].reshape(2, 3, n, hi - lo)
        assert_close(block, weights[:, :, i0:i0 + n, lo:hi], atol=1e-6, rtol=1e-5)
        at += n * (hi - lo)
    assert at == kept.shape[-1]
    assert_close(lse, scores.masked_fill(~((keys <= rows) & (keys > rows - 20)), float("-inf")).logsumexp(-1),
                 atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [16, 1024])
def test_the_kernel_computes_each_blocks_band_of_keys_alone(chunk):
    """The score products (forward and recomputing backward) cover, for each block of 64 rows, the
    keys from its first row's first to its last row's last and no more, whatever the chunk size: the
    chunks below the band are skipped, work O(i w), not O(i^2)."""
    module = cpu.extension()
    module.set_chunk(chunk)
    try:
        q, k, v = leaves((1, 2, 1000, 8), (1, 2, 1000, 8), (1, 2, 1000, 8))
        for window in (40, 0):
            band = 2 * cpu.kept_floats(1000, 1000, True, window)       # entries per call, both heads
            module.scored_entries(True)
            with cpu.recomputed_weights():
                out = cpu.attention(q, k, v, 0.3, True, window=window)
            assert module.scored_entries(False) == band
            torch.autograd.grad(out.sum(), (q, k, v))
            assert module.scored_entries(True) == 2 * band
        assert cpu.kept_floats(1000, 1000, True, 40) * 4 < cpu.kept_floats(1000, 1000, True)
    finally:
        module.set_chunk(1024)


def test_windows_it_does_not_take_are_clear_errors():
    """(The bidirectional window's errors: test_cpu_window_bidirectional.py.)"""
    q = torch.randn(1, 2, 10, 8)
    for causal in (True, False):
        with pytest.raises(ValueError, match=">= 0"):
            cpu.attention(q, q, q, 0.3, causal, window=-1)
        with pytest.raises(RuntimeError, match=">= 0"):
            torch.ops.polyformer.attention(q, q, q, 0.3, causal, False, -1)
    with pytest.raises(ValueError, match="see a key"):
        cpu.attention(q, q[:, :, :5], q[:, :, :5], 0.3, True, window=5)     # row 9 would see keys 5..9
    with pytest.raises(RuntimeError, match="see a key"):
        torch.ops.polyformer.attention(q, q[:, :, :5], q[:, :, :5], 0.3, True, False, 5)


def test_inference_with_a_window_has_no_length_limit():
    """Past LONGEST_INFERENCE keys inference keeps SDPA for full attention, but not for a window, whose
    alternative (the block-sparse kernel) is slower at every length."""
    q = torch.randn(1, 1, cpu.LONGEST_INFERENCE + 1, 4)
    assert not cpu.applies(q, q, q, None, None, 0.0)
    assert cpu.applies(q, q, q, None, None, 0.0, window=8)


def reference(q, k, v, scale, window):
    return banded(q, k, v, scale, window, True)


DIRECTIONS = pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])


@DIRECTIONS
def test_second_derivatives_equal_the_reference(causal):
    """create_graph=True takes the differentiable reference path, with the band."""
    q, k, v = leaves((1, 4, 40, 8), (1, 2, 40, 8), (1, 2, 40, 8))
    second = []
    for fn in (lambda *t: cpu.attention(*t, 0.35, causal, window=7), lambda *t: banded(*t, 0.35, 7, causal)):
        (g,) = torch.autograd.grad(fn(q, k, v).square().sum(), q, create_graph=True)
        second.append(torch.autograd.grad(g.pow(2).sum(), (q, k, v)))
    for a, b in zip(*second):
        assert_close(a, b, atol=1e-4, rtol=1e-4)


@DIRECTIONS
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_the_packed_call_takes_the_window(keep, causal):
    """q, k, v as one fused projection's columns: the packed operator, with the band, equals the
    reference in the projection's gradient."""
    h, hk, d, n = 4, 2, 8, 90
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, n, 16, generator=g, requires_grad=True)
    w = torch.randn(h * d + 2 * hk * d, 16, generator=g) / 4
    grad_out = torch.randn(2, h, n, d, generator=g)

    def run(fn):
        q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (x @ w.t()).split((h * d, hk * d, hk * d), -1))
        assert cpu.packed_columns(q, k, v) is not None
        out = fn(q, k, v)
        return out, *torch.autograd.grad(out, x, grad_out)
    with contextlib.nullcontext() if keep else cpu.recomputed_weights():
        ours = run(lambda *t: cpu.attention(*t, 0.3, causal, window=11))
    for a, b in zip(ours, run(lambda *t: banded(*t, 0.3, 11, causal))):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


@DIRECTIONS
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_the_operators_pass_opcheck(keep, causal):
    q, k, v = leaves((2, 2, 70, 8), (2, 1, 70, 8), (2, 1, 70, 12))
    torch.library.opcheck(torch.ops.polyformer.attention.default, (q, k, v, 0.3, causal, keep, 9))
    out, lse, weights = torch.ops.polyformer.attention(q, k, v, 0.3, causal, keep, 9)
    torch.library.opcheck(torch.ops.polyformer.attention_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, weights,
                           0.3, causal, 9),
                          test_utils=("test_schema", "test_faketensor"))


@DIRECTIONS
def test_compiled_with_dynamic_shapes_equals_eager(causal):
    """aot_eager traces forward and backward for symbolic lengths: the kept weights' closed-form size
    with a window holds for two lengths through one graph."""
    fn = lambda q, k, v: cpu.attention(q, k, v, 0.25, causal, window=50)   # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for n in (70, 135):
        q, k, v = leaves((2, 3, n, 16), (2, 3, n, 16), (2, 3, n, 16), seed=n)
        grad_out = torch.randn(2, 3, n, 16)
        for a, b in zip(grads(compiled, q, k, v, grad_out), grads(fn, q, k, v, grad_out)):
            assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch._dynamo.reset()
