"""Kernel attention's three forms agree (causal chunked == token by token == masked quadratic),
nothing a query computes depends on later keys (not even through a maximum), scaled inputs stay
finite, and the linear transformer equals its formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.attention.kernels import linear_core as core
from polyformer.interfaces import KV, KernelSpec
from polyformer.attention.kernels.linear import KERNELS, LinearOptions, PerformerOptions, RfaOptions
from polyformer.memory.recurrent import Recurrent


def terms(n: int = 29, seed: int = 0, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(2, 3, n, 5, generator=g, dtype=torch.float64)
    k = torch.rand(2, 3, n, 5, generator=g, dtype=torch.float64)
    a = torch.randn(2, 3, n, generator=g, dtype=torch.float64) * scale
    v = torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64)
    d = -torch.rand(2, 3, n, generator=g, dtype=torch.float64) * 0.5
    return q, k, a, v, d


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_chunked_equals_quadratic_and_token_by_token(gated, chunk):
    q, k, a, v, d = terms()
    a[1, 2, 5] = float("-inf")                                  # a padded key
    decay = d if gated else None
    reference, _ = core.quadratic(q, k, a, v, decay)
    out, _, _ = core.chunked(q, k, a, v, decay=decay, chunk=chunk)
    assert_close(out, reference, atol=1e-12, rtol=1e-10)
    state, steps = None, []
    for t in range(q.shape[2]):
        one = (slice(None), slice(None), slice(t, t + 1))
        o, state, _ = core.chunked(q[one], k[one], a[one], v[one], decay=None if decay is None else decay[one],
                                   start=state, chunk=chunk)
        steps.append(o)
    assert_close(torch.cat(steps, 2), reference, atol=1e-12, rtol=1e-10)


def test_the_summaries_after_trailing_positions_continue_exactly():
    q, k, a, v, d = terms()
    reference, _ = core.quadratic(q, k, a, v, d)
    _, _, trailing = core.chunked(q[:, :, :20], k[:, :, :20], a[..., :20], v[:, :, :20], decay=d[..., :20], trail=4)
    after_17 = {name: x[:, 1] for name, x in trailing.items()}      # oldest first: positions 16, 17, 18, 19
    out, _, _ = core.chunked(q[:, :, 18:], k[:, :, 18:], a[..., 18:], v[:, :, 18:], decay=d[..., 18:], start=after_17)
    assert_close(out, reference[:, :, 18:], atol=1e-12, rtol=1e-10)


def test_no_query_depends_on_a_later_key_even_a_huge_one():
    """performer-pytorch's causal mode takes a key maximum over the whole sequence (its #45): a later
    key with a huge weight then moves earlier outputs. Here the maximum runs over j <= i only."""
    q, k, a, v, _ = terms(n=16)
    q, k, a, v = q.float(), k.float(), a.float(), v.float()
    later = a.clone()
    later[..., 12] = 200.0
    for chunk in (4, 16):
        x, _, _ = core.chunked(q, k, a, v, chunk=chunk)
        y, _, _ = core.chunked(q, k, later, v, chunk=chunk)
        assert torch.equal(x[:, :, :12], y[:, :, :12])
        assert torch.isfinite(y).all()


def test_scaled_inputs_stay_finite_and_exact():
    q, k, a, v, _ = terms()
    big = a * 1000.0                                              # exp would overflow float32 by far
    reference, _ = core.quadratic(q, k, big, v)
    out, _, _ = core.chunked(q.float(), k.float(), big.float(), v.float(), chunk=8)
    assert torch.isfinite(out).all()
    assert_close(out.double(), reference, atol=1e-5, rtol=1e-4)


def test_bidirectional_equals_the_unmasked_quadratic_form():
    q, k, a, v, _ = terms()
    assert_close(core.bidirectional(q, k, a, v), core.quadratic(q, k, a, v, causal=False)[0])


def spec(options, causal=True, heads=2, kv_heads=2, d=8) -> KernelSpec:
    return KernelSpec(heads=heads, kv_heads=kv_heads, dim_qk=d, dim_v=d, causal=causal, layer=0, scale=d ** -0.5,
                      options=options)


@pytest.mark.parametrize("causal", [True, False])
def test_linear_transformer_equals_its_formula(causal):
    """Katharopoulos et al.: φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / φ(q_i)ᵀ Σ_j φ(k_j), φ = elu + 1."""
    torch.manual_seed(0)
    kernel = KERNELS["linear"](spec(LinearOptions("elu", chunk=4), causal))
    q, k, v = (torch.randn(2, 2, 11, 8, dtype=torch.float64) for _ in range(3))
    out = kernel(q, KV(k, v, torch.arange(11)[None], None), q_pos=torch.arange(11)[None], causal=causal,
                 memory=None, need_weights=False).out
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    scores = fq @ fk.transpose(-1, -2)
    if causal:
        scores = scores.tril()
    assert_close(out, (scores @ v) / scores.sum(-1, keepdim=True))


@pytest.mark.parametrize("name,options", [("linear", LinearOptions("elu", chunk=3)),
                                          ("performer", PerformerOptions(features=12, chunk=3)),
                                          ("rfa", RfaOptions(features=6, chunk=3))])
def test_kernels_with_memory_keys_and_padding_equal_their_quadratic_form(name, options):
    """Keys before the queries (memory key / values, XL memories) are seen by every query, padded keys
    by none; return_attn shows the quadratic form's weights, whose output is the same."""
    torch.manual_seed(1)
    kernel = KERNELS[name](spec(options, heads=4, kv_heads=2)).double()
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 12, 8, dtype=torch.float64), torch.randn(2, 2, 12, 8, dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[0, 4] = False
    kv = KV(k, v, torch.arange(11)[None], mask, free=1)
    kw = dict(q_pos=torch.arange(2, 11)[None], causal=True, memory=None)
    fast = kernel(q, kv, need_weights=False, **kw).out
    shown = kernel(q, kv, need_weights=True, **kw)
    assert_close(fast, shown.out)
    assert (shown.weights[0, :, :, 5] == 0).all()                         # the padded key (free key first)
    assert (shown.weights[..., :3].abs() > 0).all()                      # memory keys and mems: every query
    assert (shown.weights[:, :, 0, 4:] == 0).all()                       # the first query sees no later key


def test_bad_options_are_refused_by_keyword():
    for keywords, named in [(dict(attn_performer=True, attn_performer_features=0), "attn_performer_features"),
                            (dict(attn_performer=True, attn_performer_kernel="cos"), "attn_performer_kernel"),
                            (dict(attn_performer=True, attn_performer_redraw=-1), "attn_performer_redraw"),
                            (dict(attn_rfa=True, attn_rfa_features=0), "attn_rfa_features"),
                            (dict(attn_linear="tanh"), "attn_linear"),
                            (dict(attn_linear_chunk=4), "attn_linear"),
                            (dict(attn_performer_features=4), "attn_performer"),
                            (dict(attn_linear="elu", attn_performer=True), "attn_linear and attn_performer"),
                            (dict(attn_linear="elu", rel_pos_bias=True), "rel_pos_bias"),
                            (dict(attn_linear="elu", attn_sparse_topk=2), "attn_sparse_topk"),
                            (dict(attn_linear="elu", attn_window=4), "attn_window"),
                            (dict(attn_linear="elu", residual_attn=True), "residual_attn")]:
        with pytest.raises(ValueError, match=named):
            Decoder(dim=16, depth=1, heads=2, **keywords)
    with pytest.raises(ValueError, match="attn_rfa_gate"):
        Encoder(dim=16, depth=1, heads=2, attn_rfa=True, attn_rfa_gate=True)
    with pytest.raises(ValueError, match="attn_rfa_gate.*attn_num_mem_kv"):
        Decoder(dim=16, depth=1, heads=2, attn_rfa=True, attn_rfa_gate=True, attn_num_mem_kv=2)


def test_the_gate_decays_the_summary_and_a_closed_gate_is_the_ungated_form():
    """RFA-Gate: S_t = g_t S_(t-1) + (1 - g_t) φ(k_t) v_tᵀ. With g -> 1 everywhere (no decay; the
    common (1 - g) cancels) it is the ungated form; a real gate favours recent keys."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 2, 13, 8, dtype=torch.float64) for _ in range(3))
    kv, kw = KV(k, v, torch.arange(13)[None], None), dict(q_pos=torch.arange(13)[None], causal=True, memory=None,
                                                           need_weights=False)
    plain = KERNELS["rfa"](spec(RfaOptions(features=6, chunk=4))).double()
    gated = KERNELS["rfa"](spec(RfaOptions(features=6, gate=True, chunk=4))).double()
    gated.feature.load_state_dict(plain.feature.state_dict())
    with torch.no_grad():
        gated.gate_weight.zero_()
        gated.gate_bias.fill_(40.0)                      # g = σ(40): log g ≈ -4e-18
    assert_close(gated(q, kv, **kw).out, plain(q, kv, **kw).out)
    with torch.no_grad():
        gated.gate_weight.copy_(torch.randn(2, 8, dtype=torch.float64))
        gated.gate_bias.copy_(torch.tensor([-1.0, 0.5]))
    # explicit recurrence S_t = g_t S_(t-1) + (1 - g_t) φ(k_t) v_tᵀ, z and the mass n alike,
    # out = φ(q)ᵀS / max(φ(q)ᵀz, exp(-2 / σ²) n), g_t = σ(w·k_t + b) per head
    fq, fk = gated.feature.query(q), gated.feature.query(k)
    floor = (-2 / gated.feature.log_sigma.detach().exp().square()).exp()[:, None]     # (h, 1)
    gates = torch.sigmoid(k @ gated.gate_weight.detach()[:, :, None] + gated.gate_bias.detach()[:, None, None])
    S, z, mass, outs, floored = 0, 0, 0, [], 0
    for t in range(13):
        g = gates[:, :, t]                                                  # (b, h, 1)
        S = g[..., None] * S + (1 - g[..., None]) * fk[:, :, t, :, None] * v[:, :, t, None, :]
        z = g * z + (1 - g) * fk[:, :, t]
        mass = g * mass + (1 - g)
        den = (fq[:, :, t] * z).sum(-1, keepdim=True)
        floored += int((den < floor * mass).sum())
        outs.append((fq[:, :, t, None, :] @ S)[:, :, 0] / torch.maximum(den, floor * mass))
    assert floored > 0                                   # 6 features: some estimates fall below the floor
    assert_close(gated(q, kv, **kw).out, torch.stack(outs, 2))


@pytest.mark.parametrize("name,options", [("linear", LinearOptions("elu", chunk=2)),
                                          ("performer", PerformerOptions(features=12, chunk=3)),
                                          ("rfa", RfaOptions(features=6, gate=True, chunk=2))])
@pytest.mark.parametrize("causal", [True, False])
def test_inference_in_runs_of_positions_equals_the_training_form(name, options, causal):
    """Without autograd the kernel runs a few chunks at a time, carrying (causal) or combining
    (bidirectional) summaries: the same outputs."""
    if not causal and options.__class__ is RfaOptions:
        options = RfaOptions(features=6, chunk=2)                # the gate is causal only
    torch.manual_seed(3)
    kernel = KERNELS[name](spec(options, causal=causal, heads=4, kv_heads=2)).double()
    n, free = 53, 0 if name == "rfa" else 1
    q = torch.randn(2, 4, n, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, n + free, 8, dtype=torch.float64), torch.randn(2, 2, n + free, 8, dtype=torch.float64)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, :7] = False
    kv = KV(k, v, torch.arange(n)[None], mask, free=free)
    kw = dict(q_pos=torch.arange(n)[None], causal=causal, memory=None, need_weights=False)
    with torch.enable_grad():
        trained = kernel(q, kv, **kw).out
    with torch.no_grad():
        assert_close(kernel(q, kv, **kw).out, trained)


@pytest.mark.parametrize("causal", [True, False])
def test_rfa_output_stays_bounded_where_the_estimated_normaliser_crosses_zero(causal):
    """Signed Fourier features can estimate the normaliser Σ_j exp(-|q̂ - k̂_j|² / 2σ²) as zero: a key
    direction is found where φ(q)·(φ(k_0) + φ(k_1)) = 0 (to rounding). The true normaliser is at least
    2 exp(-2 / σ²) there, so the output stays within exp(2 / σ²) max |v| (it was ~1e15 or inf)."""
    torch.manual_seed(4)
    kernel = KERNELS["rfa"](spec(RfaOptions(features=2, chunk=4), causal=causal, heads=1, kv_heads=1)).double()
    fourier = kernel.feature
    q = torch.randn(8, dtype=torch.float64)

    def den(k0: Tensor, k1: Tensor) -> float:          # φ(q)·(φ(k_0) + φ(k_1)), the unweighted normaliser
        with torch.no_grad():
            fq, fk = fourier.query(q[None, None, None]), fourier.query(torch.stack((k0, k1))[None, None])
        return float(fq[0, 0, 0] @ fk[0, 0].sum(0))

    k0 = next(k for k in torch.randn(100, 8, dtype=torch.float64) if den(k, k) < 0)
    lo, hi = 0.0, 1.0          # k_1 from q (normaliser φ(q)·φ(k_0) + 1 > 0) to k_0 (2 φ(q)·φ(k_0) < 0)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if den(k0, (1 - mid) * q + mid * k0) > 0 else (lo, mid)
    k1 = (1 - lo) * q + lo * k0
    assert abs(den(k0, k1)) < 1e-12
    k = torch.stack((k0, k1))[None, None]                                  # (1, 1, 2, 8)
    v = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)[None, None]
    out = kernel(torch.stack((q, q))[None, None], KV(k, v, torch.arange(2)[None], None), q_pos=torch.arange(2)[None],
                 causal=causal, memory=None, need_weights=False).out
    floor = math.exp(-2 / fourier.log_sigma.exp().item() ** 2)
    assert torch.isfinite(out).all() and out.abs().max() <= v.abs().max() / floor
    # the formula: Σ_j s_j v_j / max(Σ_j s_j, exp(-2 / σ²) (keys seen)), s_j = φ(q)·φ(k_j)
    with torch.no_grad():
        scores = (fourier.query(q[None, None, None]) @ fourier.query(k).transpose(-1, -2))[0, 0, 0]     # (2,)
    seen = torch.tensor([[1.0, 0.0], [1.0, 1.0]] if causal else [[1.0, 1.0]] * 2, dtype=torch.float64)
    formula = (seen * scores) @ v[0, 0] / torch.maximum((seen * scores).sum(-1), floor * seen.sum(-1))[:, None]
    assert_close(out[0, 0], formula)


@pytest.mark.parametrize("chunk", [4, 64])
def test_a_nearly_shut_gate_keeps_gradients_finite_and_exact(chunk):
    """log g = -200 per position: a later key's weight relative to an earlier query's maximum is
    e^{200 (j - i)}, past any float's range. Masked out of the forward, it must not reach the backward as
    0 · inf (the arena's rfa_gate row went to NaN that way): the gradients are finite and equal the
    quadratic form's (which masks before the exponential), in the chunked and the token-by-token form."""
    torch.manual_seed(5)
    kernel = KERNELS["rfa"](spec(RfaOptions(features=6, gate=True, chunk=chunk))).double()
    with torch.no_grad():
        kernel.gate_bias.fill_(-200.0)
    kv_pos = torch.arange(9)[None]

    def grads(need_weights: bool, trail: int) -> list[Tensor]:
        q, k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
                   .requires_grad_() for s in range(3))
        memory = None
        if trail:            # a decode state asking for the summaries after the last positions: the stepwise form
            memory = Recurrent(history=trail - 1)
            memory.begin(9)
        out = kernel(q, KV(k, v, kv_pos, None), q_pos=kv_pos, causal=True, memory=memory,
                     need_weights=need_weights).out
        kernel.zero_grad()
        out.square().sum().backward()
        return [q.grad, k.grad, v.grad, kernel.gate_weight.grad, kernel.gate_bias.grad]

    reference = grads(True, 0)
    for found in (grads(False, 0), grads(False, 9)):
        assert all(torch.isfinite(g).all() for g in found)
        for g, r in zip(found, reference):
            assert_close(g, r)
