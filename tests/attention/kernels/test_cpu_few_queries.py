"""Which path a dense attention call takes on the CPU: a decode step's few queries go to
scaled_dot_product_attention, longer blocks and recorded calls to the compiled kernel."""

from __future__ import annotations

import pytest
import torch

from polyformer.attention.kernels import cpu
from polyformer.attention.kernels.dense import DenseKernel
from polyformer.attention.normalize import Softmax
from polyformer.interfaces import KV


def test_a_decode_steps_few_queries_keep_sdpa_and_longer_blocks_our_kernel(monkeypatch):
    """cpu.applies: inference with up to FEW_QUERIES queries runs scaled_dot_product_attention (faster
    at every length measured), more queries or a recorded call the compiled kernel, same values."""
    if cpu.extension() is None:
        pytest.skip("the compiled CPU kernel is not available")
    calls = []
    real = cpu.attention
    monkeypatch.setattr(cpu, "attention", lambda *a, **k: calls.append(a[0].shape[2]) or real(*a, **k))
    kernel = DenseKernel(4, 0.25, 0.0, Softmax())
    k, v = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    for i in (1, cpu.FEW_QUERIES, cpu.FEW_QUERIES + 1):
        q = torch.randn(1, 4, i, 8)
        with torch.no_grad():
            got = kernel(q, KV(k, v, None, None), mask=None, bias=None, causal=False).out
        expected = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25, -1) @ v.repeat_interleave(2, 1)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert calls == [cpu.FEW_QUERIES + 1]
    kernel(torch.randn(1, 4, 1, 8, requires_grad=True), KV(k, v, None, None), mask=None, bias=None, causal=False)
    assert calls == [cpu.FEW_QUERIES + 1, 1]
