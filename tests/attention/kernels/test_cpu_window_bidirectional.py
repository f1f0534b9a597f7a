"""The compiled CPU attention kernel with a bidirectional window (polyformer/attention/kernels/cpu.py,
`window` with causal=False): row r sees the keys |r - j| <= w // 2, queries and keys one sequence.
Output and all three gradients equal a dense softmax over the explicit band, for lengths that are not
multiples of the 64-row blocks or of the key chunks, odd and even windows, windows that cover every
row (full attention, exactly), grouped kv heads, kept or recomputed weights; the kernel computes each
block's band of keys and no more; the kept weights are sized by the band; an Encoder's window pattern
runs on it (block_sparse.cpu_window)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import Encoder
from polyformer.attention.kernels import block_sparse, cpu

from .test_cpu_window import leaves, matches_the_band, path  # noqa: F401  (path: the backward-path fixture)


@pytest.mark.parametrize("n", [1, 5, 70, 130, 257])
@pytest.mark.parametrize("window", [2, 3, 8, 64, 300])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_output_and_gradients_equal_the_banded_reference(n, window, kv_heads, path):
    matches_the_band(n, n, window, kv_heads, path, causal=False)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_a_window_that_covers_every_row_is_full_attention_exactly(keep):
    """w // 2 >= n - 1: every row sees every key; the kernel then runs full attention, bit for bit."""
    q, k, v = (torch.randn(1, 2, 100, 8) for _ in range(3))
    plain = torch.ops.polyformer.attention(q, k, v, 0.3, False, keep)
    for window in (198, 199, 200, 10_000):
        banded = torch.ops.polyformer.attention(q, k, v, 0.3, False, keep, window)
        for a, b in zip(plain, banded):
            assert torch.equal(a, b)
        assert torch.equal(cpu.attention(q, k, v, 0.3, False, window=window), cpu.attention(q, k, v, 0.3, False))
    assert not torch.equal(torch.ops.polyformer.attention(q, k, v, 0.3, False, keep, 197)[0], plain[0])


def kept_by_blocks(n, half):
    """Rows times the keys of each 64-row block's band, from max(0, first row - half) to
    min(n, last row + half + 1)."""
    return sum(rows * (min(i0 + rows + half, n) - max(0, i0 - half))
               for i0, rows in ((i0, min(64, n - i0)) for i0 in range(0, n, 64)))


def test_the_kept_weights_are_sized_by_the_band():
    """kept_floats (closed form, for symbolic sizes) equals the kernel's own count and the count
    block by block; the weights a call keeps are each block's band, row-major."""
    kept_per_task = cpu.extension().kept_per_task
    for n in (1, 2, 63, 64, 65, 127, 128, 129, 191, 300, 1000):
        for window in (2, 3, 4, 63, 64, 65, 100, 126, 127, 128, 129, 130, 255, 256, 500, 2000, 2001):
            want = kept_by_blocks(n, window // 2)
            assert kept_per_task(n, n, False, window) == want, (n, window)
            assert cpu.kept_floats(n, n, False, window) == want, (n, window)
    q, k, v = (torch.randn(2, 3, 300, 8) for _ in range(3))
    _, lse, kept = torch.ops.polyformer.attention(q, k, v, 0.4, False, True, 21)     # 10 keys each side
    assert kept.shape == (2, 3, cpu.kept_floats(300, 300, False, 21))
    assert kept.shape[-1] < cpu.kept_floats(300, 300, False) / 2
    scores = q @ k.transpose(-1, -2) * 0.4
    rows, keys = torch.arange(300)[:, None], torch.arange(300)[None, :]
    scores = scores.masked_fill((rows - keys).abs() > 10, float("-inf"))
    weights = scores.softmax(-1)
    at = 0
    for i0 in range(0, 300, 64):
        n, lo, hi = min(64, 300 - i0), max(0, i0 - 10), min(i0 + 64 + 10, 300)
        block = kept[:, :, at:at + n * (hi - lo)].reshape(2, 3, n, hi - lo)
        assert_close(block, weights[:, :, i0:i0 + n, lo:hi], atol=1e-6, rtol=1e-5)
        at += n * (hi - lo)
    assert at == kept.shape[-1]
    assert_close(lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [16, 1024])
def test_the_kernel_computes_each_blocks_band_of_keys_alone(chunk):
    """The score products (forward and recomputing backward) cover, for each block of 64 rows, the
    keys from its first row's first to its last row's last and no more, whatever the chunk size: the
    chunks on either side of the band are skipped, work O(n w), not O(n^2)."""
    module = cpu.extension()
    module.set_chunk(chunk)
    try:
        q, k, v = leaves((1, 2, 1000, 8), (1, 2, 1000, 8), (1, 2, 1000, 8))
        for window in (40, 41, 0):
            band = 2 * kept_by_blocks(1000, window // 2 if window else 1000)     # entries per call, both heads
            module.scored_entries(True)
            with cpu.recomputed_weights():
                out = cpu.attention(q, k, v, 0.3, False, window=window)
            assert module.scored_entries(False) == band
            torch.autograd.grad(out.sum(), (q, k, v))
            assert module.scored_entries(True) == 2 * band
        assert kept_by_blocks(1000, 20) * 5 < 1000 * 1000
    finally:
        module.set_chunk(1024)


def test_windows_it_does_not_take_are_clear_errors():
    q = torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match=">= 2"):
        cpu.attention(q, q, q, 0.3, False, window=1)
    with pytest.raises(RuntimeError, match=">= 2"):
        torch.ops.polyformer.attention(q, q, q, 0.3, False, False, 1)
    with pytest.raises(ValueError, match="one sequence"):
        cpu.attention(q, q[:, :, :5], q[:, :, :5], 0.3, False, window=4)
    with pytest.raises(RuntimeError, match="one sequence"):
        torch.ops.polyformer.attention(q, q[:, :, :5], q[:, :, :5], 0.3, False, False, 4)
    with pytest.raises(ValueError, match="one sequence"):       # even where the band covers every key
        cpu.attention(q[:, :, :5], q, q, 0.3, False, window=100)


@pytest.mark.parametrize("n, attn_window, kv_heads", [(48, 6, 4), (150, 7, 2), (130, 64, 1), (40, 200, 4)])
def test_an_encoders_window_runs_on_the_kernel(n, attn_window, kv_heads, monkeypatch):
    """block_sparse.cpu_window reads an Encoder's window part as the kernel's bidirectional window
    2 (w // 2) (attn_window 7: |i - j| <= 3); output and gradients equal the block-sparse path's and
    the dense reference's."""
    torch.manual_seed(0)
    encoder = Encoder(dim=32, depth=1, heads=4, attn_dim_head=8, attn_kv_heads=kv_heads, attn_window=attn_window)
    reference_model = Encoder(dim=32, depth=1, heads=4, attn_dim_head=8, attn_kv_heads=kv_heads,
                              attn_window=attn_window, attn_flash=False)
    reference_model.load_state_dict(encoder.state_dict())
    windows, original = [], cpu.attention
    monkeypatch.setattr(block_sparse.cpu, "attention",
                        lambda *a, **k: windows.append((a[4], k.get("window"))) or original(*a, **k))
    x = torch.randn(2, n, 32, requires_grad=True)
    grad_out = torch.randn(2, n, 32)

    def run(model):
        x.grad = None
        y = model(x)
        (y * grad_out).sum().backward()
        return y.detach(), x.grad.clone(), [p.grad.clone() for p in model.parameters()]
    ours = run(encoder)
    assert windows == [(False, 2 * (attn_window // 2))]
    encoder.zero_grad()
    with monkeypatch.context() as m:
        m.setattr(block_sparse, "cpu_window", lambda *a: (0, False))
        sparse = run(encoder)
    assert len(windows) == 1
    for other in (sparse, run(reference_model)):
        assert_close(ours[0], other[0], atol=1e-5, rtol=1e-5)
        assert_close(ours[1], other[1], atol=1e-5, rtol=1e-5)
        for a, b in zip(ours[2], other[2]):
            assert_close(a, b, atol=1e-4, rtol=1e-4)
