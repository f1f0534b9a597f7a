"""FAVOR+ and random Fourier features, by the properties that define them: unbiased estimates of
their kernels, error falling with the number of features, orthogonal features beating iid ones,
and redraws exactly on schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder
from polyformer.attention.kernels.features import Favor, Fourier, positive_features, random_rows
from polyformer.attention.kernels.linear import KERNELS, PerformerOptions
from polyformer.interfaces import KV, KernelSpec


def test_positive_features_are_an_unbiased_estimate_of_the_softmax_kernel():
    """E[φ(q)·φ(k)] = exp(qᵀk / √d): the mean over many independent draws (400 draws of 512 features)
    is within 2% for moderate norms (|q|, |k| about 2 at d = 16); a single draw of 16 is not."""
    d = 16
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, d, generator=g, dtype=torch.float64) * 0.5, torch.randn(8, d, generator=g, dtype=torch.float64) * 0.5
    exact = (q * k).sum(-1).div(math.sqrt(d)).exp()
    estimates = torch.stack([(positive_features(q, w) * positive_features(k, w)).sum(-1)
                             for w in (random_rows(512, d, False, g) for _ in range(400))])
    assert ((estimates.mean(0) - exact).abs() / exact).max() < 0.02
    assert ((estimates[0, :] - exact).abs() / exact).max() > 0.001     # one draw only estimates


def test_random_fourier_features_estimate_the_gaussian_kernel():
    d = 16
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, d, generator=g, dtype=torch.float64), torch.randn(8, d, generator=g, dtype=torch.float64)
    fourier = Fourier(d, 1, 40000, seed=3, layer=0).double()
    with torch.no_grad():
        fourier.log_sigma.fill_(math.log(0.8))
    fx, fy = fourier.query(x[None, None])[0, 0], fourier.query(y[None, None])[0, 0]
    xn, yn = torch.nn.functional.normalize(x, dim=-1), torch.nn.functional.normalize(y, dim=-1)
    exact = (-(xn - yn).square().sum(-1) / (2 * 0.8 ** 2)).exp()
    assert ((fx * fy).sum(-1) - exact).abs().max() < 0.02


@pytest.mark.parametrize("kind", ["softmax", "relu"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_kernel_equals_its_formula_with_the_features_written_out(kind, causal):
    """out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j) over the keys i sees, φ FAVOR+'s positive
    features (or relu(ωᵀx̃) / √m) on the kernel's own ω: its stabilising shifts cancel exactly."""
    d, m, n = 8, 12, 11
    spec = KernelSpec(heads=2, kv_heads=2, dim_qk=d, dim_v=d, causal=causal, layer=0, scale=d ** -0.5,
                      options=PerformerOptions(features=m, kernel=kind, chunk=4))
    kernel = KERNELS["performer"](spec).double()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    omega = kernel.feature.omega
    if kind == "softmax":
        fq, fk = positive_features(q, omega), positive_features(k, omega)
    else:
        fq, fk = (F.relu(x * d ** -0.25 @ omega.T) / math.sqrt(m) for x in (q, k))
    scores = fq @ fk.transpose(-1, -2)
    if causal:
        scores = scores.tril()
    out = kernel(q, KV(k, v, torch.arange(n)[None], None), q_pos=torch.arange(n)[None], causal=causal, memory=None,
                 need_weights=False).out
    den = scores.sum(-1, keepdim=True)                  # relu: 0 where a query's features meet no key's
    assert_close(out, scores @ v / torch.where(den > 0, den, 1.0), rtol=1e-5, atol=1e-7)


def mse_against_softmax(m: int, orthogonal: bool, seed: int) -> float:
    d, n = 16, 64
    g = torch.Generator().manual_seed(100 + seed)
    q, k, v = (torch.randn(1, 1, n, d, generator=g) * 0.6 for _ in range(3))
    spec = KernelSpec(heads=1, kv_heads=1, dim_qk=d, dim_v=d, causal=False, layer=0, scale=d ** -0.5,
                      options=PerformerOptions(features=m, orthogonal=orthogonal, seed=seed))
    kernel = KERNELS["performer"](spec)
    out = kernel(q, KV(k, v, None, None), q_pos=torch.arange(n)[None], causal=False, memory=None, need_weights=False).out
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1) @ v
    return float((out - exact).square().mean())


def test_error_falls_as_features_grow_and_orthogonal_features_beat_iid():
    seeds = range(8)
    errors = {m: sum(mse_against_softmax(m, True, s) for s in seeds) for m in (16, 64, 256)}
    assert errors[16] > errors[64] > errors[256]
    iid = sum(mse_against_softmax(64, False, s) for s in seeds)
    assert errors[64] < iid


def test_features_are_redrawn_only_on_schedule():
    """attn_performer_redraw=3: each training forward counts once; forwards 3 and 6 draw new features."""
    stack = Decoder(dim=16, depth=1, heads=2, attn_performer=True, attn_performer_features=8,
                    attn_performer_redraw=3).train()
    favor = stack.blocks[0].branch.kernel.feature
    x = torch.randn(1, 5, 16)
    seen = []
    for _ in range(7):
        stack(x)
        seen.append(favor.omega.clone())
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert changed == [False, True, False, False, True, False]
    before = favor.omega.clone()
    stack.eval()
    stack(x)
    with torch.no_grad():
        stack.train()(x)
    assert torch.equal(before, favor.omega) and int(favor.calls) == 7     # evaluation and no-grad forwards never count
    again = Favor(64, 8, "softmax", True, redraw=3, seed=0, layer=0)     # the head size, 8 features
    again.load_state_dict(favor.state_dict())
    assert torch.equal(again.omega, favor.omega) and int(again.draws) == 2    # a checkpoint keeps its draw


def test_a_decoder_learns_through_the_performer_and_stays_causal():
    torch.manual_seed(0)
    stack = Decoder(dim=16, depth=1, heads=2, attn_performer=True, attn_performer_features=8)
    x = torch.randn(2, 10, 16, requires_grad=True)
    y = stack(x)
    y[:, 4].sum().backward()
    assert (x.grad[:, 5:] == 0).all() and (x.grad[:, :5] != 0).any()
    assert_close(stack(x[:, :5]), y[:, :5])
