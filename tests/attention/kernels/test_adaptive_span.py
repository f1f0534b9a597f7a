"""Adaptive attention span (kernels/adaptive_span.py): the soft mask is the paper's formula; the
output is m exp(s) / sum m exp(s) (float64, against the formula written out), on the banded path and
the reference path alike, with padding, memory key / values and keys before the queries; z gets
gradients (projected at the box's edges); keys beyond the current span are never read; the L1 term is
its formula and reaches AutoregressiveWrapper's loss; causal; cached == uncached with a decode state
that keeps the last S + R keys only; bad options refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper
from polyformer.attention.kernels.adaptive_span import AdaptiveSpan, AdaptiveSpanOptions, soft_mask
from polyformer.interfaces import KV, KernelSpec
from tests.helpers import ids, tiny_lm


def kernel(h: int = 3, d: int = 8, fractions=None, **options) -> AdaptiveSpan:
    options = {"span": 8, "ramp": 3, **options}
    k = AdaptiveSpan(KernelSpec(heads=h, kv_heads=h, dim_qk=d, dim_v=d, causal=True, layer=0, scale=d ** -0.5,
                                options=AdaptiveSpanOptions(**options)))
    if fractions is not None:
        with torch.no_grad():
            k.fraction.copy_(torch.tensor(fractions))
    return k.eval()


def qkv(b=2, h=3, i=20, j=20, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, i, d, generator=g, dtype=dtype)
    return q, torch.randn(b, h, j, d, generator=g, dtype=dtype), torch.randn(b, h, j, d, generator=g, dtype=dtype)


def call(k: AdaptiveSpan, q, keys, values, mask=None, free=0, need_weights=False, pos=None):
    pos = torch.arange(keys.shape[2] - free)[None] if pos is None else pos
    return k(q, KV(keys, values, pos, mask, free), q_pos=pos[:, -q.shape[2]:], causal=True, memory=None,
             need_weights=need_weights)


def by_formula(k: AdaptiveSpan, q, keys, values, mask=None, free=0):
    """a_ij = m_z(i - j) exp(s_ij) / sum_r m_z(i - r) exp(s_ir), every term written out (free keys: m = 1)."""
    S, R = k.max_span, k.ramp
    z = S * k.fraction.detach().double().clamp(0, 1)
    i, j = q.shape[2], keys.shape[2] - free
    x = (torch.arange(i)[:, None] + j - i) - torch.arange(j)                  # query t is key t + j - i
    m = torch.minimum(torch.maximum((R + z[:, None, None] - x) / R, torch.zeros(())), torch.ones(()))
    m = torch.where(x >= 0, m, torch.zeros(()))[None].expand(q.shape[0], -1, -1, -1)
    if mask is not None:
        m = m * mask[:, None, None, :]
    m = torch.cat((torch.ones(*m.shape[:3], free, dtype=m.dtype), m), -1)
    e = m * torch.exp((q @ keys.transpose(-1, -2)) * k.scale)
    a = e / e.sum(-1, keepdim=True).clamp_min(1e-300)                        # a query that sees no key: zeros
    return a @ values, a


def test_soft_mask_is_the_formula():
    z = torch.tensor([0.0, 2.5, 7.0])
    x = torch.arange(-3, 15)[None].expand(2, -1)
    got = soft_mask(z, x, ramp=4)                                            # (heads 3, i 2, j 18)
    for h, zh in enumerate(z.tolist()):
        for col, xv in enumerate(x[0].tolist()):
            want = 0.0 if xv < 0 else min(max((4 + zh - xv) / 4, 0.0), 1.0)
            assert got[h, 1, col].item() == pytest.approx(want)
    k = kernel(fractions=[-0.2, 0.3, 1.4], span=10)
    assert_close(k.spans(), torch.tensor([0.0, 3.0, 10.0]))                  # z = S clamp(p, 0, 1)


@pytest.mark.parametrize("case", ["plain", "padding", "memory_kv", "keys_before_queries"])
def test_equals_the_explicit_soft_masked_softmax_in_float64(case):
    k = kernel(fractions=[0.0, 0.9, 0.45])        # spans 0, 7.2, 3.6 (+ ramp 3): 11 keys, the last at m = 0.07
    free = 2 if case == "memory_kv" else 0
    j = 26 if case == "keys_before_queries" else 20
    q, keys, values = qkv(i=20, j=j + free)
    mask = None
    if case == "padding":
        mask = torch.ones(2, j, dtype=torch.bool)
        mask[0, :5] = False
        mask[1, 9:12] = False
    want, weights = by_formula(k, q, keys, values, mask, free)
    assert_close(call(k, q, keys, values, mask, free).out, want)             # banded
    full = call(k, q, keys, values, mask, free, need_weights=True)          # the reference path, with weights
    assert_close(full.out, want)
    assert_close(full.weights, weights)


@pytest.mark.parametrize("padded", [False, True])
def test_banded_gradients_equal_the_reference_paths(padded):
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 3:6] = False
    mask = mask if padded else None
    grads = []
    for need_weights in (False, True):                                       # banded, then the reference path
        k = kernel(fractions=[0.1, 0.55, 0.8]).train()
        q, keys, values = (t.requires_grad_() for t in qkv(i=18, j=22))
        out = call(k, q, keys, values, mask, free=2, need_weights=need_weights).out
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype))
        grads.append([q.grad, keys.grad, values.grad, k.fraction.grad])
    for banded, reference in zip(*grads):
        assert_close(banded, reference.to(banded.dtype))


def test_shuffled_positions_take_the_reference_path_and_agree():
    k = kernel(fractions=[0.2, 0.5, 0.9])
    q, keys, values = qkv(i=20, j=20)
    pos = torch.arange(20)[None] * 2                                        # not one run: distances doubled
    got = call(k, q, keys, values, pos=pos).out
    x = pos[0, :, None] - pos[0]
    z = k.spans().detach().double()
    m = ((3 + z[:, None, None] - x) / 3).clamp(0, 1) * (x >= 0)
    e = m * torch.exp((q @ keys.transpose(-1, -2)) * k.scale)
    assert_close(got, (e / e.sum(-1, keepdim=True)) @ values)


def test_z_gets_gradients_from_the_output_and_the_projection_keeps_them_inward():
    k = kernel(fractions=[0.1, 0.5, 0.9]).train()
    q, keys, values = qkv(i=24, j=24, dtype=torch.float32)
    (call(k, q, keys, values).out ** 2).sum().backward()                      # the main loss alone
    assert k.fraction.grad is not None and (k.fraction.grad != 0).all()
    out_below = kernel(fractions=[-0.1, -0.1, -0.1])
    out_below.spans().sum().backward()                                        # descent would push p further below 0
    assert (out_below.fraction.grad == 0).all()
    out_below.fraction.grad = None
    (-out_below.spans().sum()).backward()                                     # descent brings p back into [0, 1]
    assert (out_below.fraction.grad < 0).all()


def test_keys_beyond_the_current_span_are_never_read(monkeypatch):
    k = kernel(fractions=[0.0, 0.25, 0.5], span=16, ramp=4)                  # max z = 8: w = floor(8 + 4) + 1 = 13
    assert k.reach() == 13
    q, keys, values = qkv(b=1, i=96, j=96, dtype=torch.float32)
    products = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: products.append((a.shape, b.shape)) or real(a, b))
    call(k, q, keys, values)
    widths = {b[-1] if b[-2] == 8 else b[-2] for a, b in products}           # keys per product
    assert products and max(widths) < 96
    size = min(96, max(16, 13 // 2))
    assert widths == {size + 13 - 1}                                          # each group of Q: Q + w - 1 keys
    monkeypatch.setattr(torch, "matmul", real)
    # a decode-like call: one query, 60 cached keys, every key older than the reach is NaN
    q1, keys, values = q[:, :, -1:], keys[:, :, :60].clone(), values[:, :, :60].clone()
    keys[:, :, :60 - 13], values[:, :, :60 - 13] = float("nan"), float("nan")
    out = call(k, q1, keys, values).out
    assert torch.isfinite(out).all()
    want, _ = by_formula(k, q1.double(), keys[:, :, -13:].double(), values[:, :, -13:].double())
    assert_close(out, want.float(), atol=1e-5, rtol=1e-5)


def test_causal_later_keys_change_nothing_before_them():
    k = kernel(fractions=[0.3, 0.6, 1.0])
    q, keys, values = qkv(i=30, j=30)
    out = call(k, q, keys, values).out
    for t in (0, 11, 25):
        q2, k2, v2 = q.clone(), keys.clone(), values.clone()
        q2[:, :, t + 1:] += 1.0
        k2[:, :, t + 1:] += 1.0
        v2[:, :, t + 1:] -= 1.0
        out2 = call(k, q2, k2, v2).out
        assert_close(out2[:, :, :t + 1], out[:, :, :t + 1])
        assert not torch.allclose(out2[:, :, t + 1:], out[:, :, t + 1:])


def lm(**keywords) -> TransformerWrapper:
    return tiny_lm(seed=0, use_abs_pos_emb=False, rotary_pos_emb=True, attn_adaptive_span=8, attn_adaptive_span_ramp=2,
                   **keywords)


def test_l1_term_is_its_formula_and_reaches_the_autoregressive_loss():
    model = lm(attn_adaptive_span_loss=0.5)
    kernels = [m for m in model.modules() if isinstance(m, AdaptiveSpan)]
    with torch.no_grad():
        kernels[0].fraction.copy_(torch.tensor([0.0, 0.25, 0.5, 1.0]))      # z = 0, 2, 4, 8
        kernels[1].fraction.copy_(torch.tensor([0.5, 0.5, 0.5, 0.5]))       # z = 4 each
    x = ids(2, 12)
    _, record = model(x, return_intermediates=True)
    want = (0 + 2 + 4 + 8) / 4 + (4 * 4) / 4                                 # sum over layers of sum_h z_h / heads
    assert record.losses.terms["adaptive_span"].item() == pytest.approx(want)
    assert record.losses.weights["adaptive_span"] == 0.5
    loss = AutoregressiveWrapper(model)(x)
    ce = F.cross_entropy(model(x[:, :-1]).transpose(1, 2), x[:, 1:])
    assert_close(loss, ce + 0.5 * want)
    assert lm().attn_layers.blocks[0].branch.kernel.weight == 2e-6          # the paper's lambda by default


def test_cached_generation_equals_uncached_while_the_state_keeps_only_s_plus_r_keys():
    model = lm(attn_adaptive_span_init=0.5)
    assert model.attn_layers.window == (0, 10)                               # S + R = 8 + 2
    ar = AutoregressiveWrapper(model)
    prompts = ids(2, 6)
    state = model.new_state(2, 14)                                            # a ring, whatever the room asked
    cached = ar.generate(prompts, 30, temperature=0.0, state=state)
    assert state.k.shape[3] == 10 + 1 and state.length == 6 + 30 - 1         # S + R, + 1 to roll back
    assert torch.equal(cached, ar.generate(prompts, 30, temperature=0.0, cache_kv=False))


def test_xl_segments_equal_one_long_forward_when_the_memory_covers_s_plus_r():
    model = lm(max_mem_len=16, attn_adaptive_span_init=0.5)                  # memory 16 >= S + R = 10
    x = ids(2, 32)
    first, mems = model(x[:, :16], return_mems=True)
    second, _ = model(x[:, 16:], mems=mems, return_mems=True)
    assert_close(torch.cat((first, second), 1), model(x))


def test_runs_in_bfloat16_close_to_float32():
    k = kernel(fractions=[0.2, 0.5, 1.0])
    q, keys, values = qkv(i=20, j=20, dtype=torch.float32)
    want = call(k, q, keys, values).out
    got = call(k.to(torch.bfloat16), q.bfloat16(), keys.bfloat16(), values.bfloat16()).out
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("keywords, match", [
    (dict(attn_adaptive_span=0), "attn_adaptive_span must be an integer >= 1"),
    (dict(attn_adaptive_span=8, attn_adaptive_span_ramp=0), "attn_adaptive_span_ramp must be an integer >= 1"),
    (dict(attn_adaptive_span=8, attn_adaptive_span_loss=-1e-6), "attn_adaptive_span_loss must be a number >= 0"),
    (dict(attn_adaptive_span=8, attn_adaptive_span_init=1.5), r"attn_adaptive_span_init must be a number in \[0, 1\]"),
    (dict(attn_adaptive_span_ramp=4), "need.*attn_adaptive_span"),
    (dict(attn_adaptive_span=8, alibi_pos_emb=True), "cannot take the stack's score bias"),
    (dict(attn_adaptive_span=8, attn_window=4), "cannot combine with a sparse attention pattern"),
])
def test_bad_options_are_refused_by_name(keywords, match):
    with pytest.raises(ValueError, match=match):
        Decoder(dim=16, depth=1, heads=2, **keywords)


def test_an_encoder_is_refused():
    with pytest.raises(ValueError, match="attn_adaptive_span needs a causal stack"):
        Encoder(dim=16, depth=1, heads=2, attn_adaptive_span=8)
