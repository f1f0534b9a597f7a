"""x-transformers 2.x position keywords (issue 24, S2): rotary_xpos (arXiv:2212.10554), rotary_base_rescale_factor
(NTK-aware base), rotate_num_heads, dynamic_pos_bias (SwinV2's continuous bias, arXiv:2111.09883) and attn_use_cope
(arXiv:2405.18719). Each against its formula in float64 and x-transformers' module with the same weights (tests
only), causality, and named errors. Cached == uncached: tests/options.py (rotary_xpos, rotate_num_heads,
dynamic_pos_bias, attn_use_cope, attn_cope_soft_onehot) through tests/generate/test_decode.py and tests/contracts."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.config import AttentionConfig
from polyformer.interfaces import KV
from polyformer.position.cope import CopeOptions, CopeRelative
from polyformer.position.dynamic_bias import DynamicBiasOptions, DynamicPositionBias
from polyformer.position.rotary import Rotary
from polyformer.position.rotary_scaling import ntk_keyword
from tests.helpers import ids, tiny_lm
from tests.options import perturb

xt = pytest.importorskip("x_transformers.x_transformers")


def rotary(heads: int = 2, **fields) -> Rotary:
    return Rotary.from_config(8, AttentionConfig(heads=heads, dim_head=8, position="rotary", **fields))


def scores(r: Rotary, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(q.shape[2])[None]
    q2, k2 = r(q, k, pos, pos)
    return q2 @ k2.transpose(-1, -2)


def test_xpos_scores_are_the_rotary_scores_decayed_by_zeta_to_the_offset():
    torch.manual_seed(0)
    r, gamma, n = rotary(rotary_xpos=True, rotary_xpos_scale_base=4.0), 4.0, 6
    q, k = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    got = scores(r, q, k).double()
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)         # pair i: features i, i + 4
    zeta = (torch.arange(0, 8, 2, dtype=torch.float64) + 0.4 * 8) / (1.4 * 8)
    qc, kc = torch.complex(q[..., :4].double(), q[..., 4:].double()), torch.complex(k[..., :4].double(), k[..., 4:].double())
    m = torch.arange(n, dtype=torch.float64)
    off = m[:, None] - m[None, :]                                               # (i, j) = m - n
    want = (qc[..., :, None, :] * kc[..., None, :, :].conj() * torch.exp(1j * off[..., None] * theta)
            * zeta ** (off[..., None] / gamma)).real.sum(-1)                   # Σ_i Re(q k* e^{i(m-n)θ}) ζ^((m-n)/γ)
    assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_xpos_and_base_rescale_give_x_transformers_scores():
    torch.manual_seed(1)
    n, r = 7, 8
    ours = rotary(rotary_xpos=True, rotary_xpos_scale_base=16.0, rotary_interleaved=True,
                  rotary_scaling=ntk_keyword(3.0))
    theirs = xt.RotaryEmbedding(r, use_xpos=True, scale_base=16, base_rescale_factor=3.0)
    q, k = torch.randn(2, 2, n, r), torch.randn(2, 2, n, r)
    freqs, scale = theirs(torch.arange(n))
    want = xt.apply_rotary_pos_emb(q, freqs, scale) @ xt.apply_rotary_pos_emb(k, freqs, scale ** -1).transpose(-1, -2)
    assert_close(scores(ours, q, k), want, rtol=1e-4, atol=1e-5)       # their centring cancels in q.k


def test_base_rescale_factor_is_the_ntk_base():
    s, base, r = 2.5, 10000.0, 8
    got = rotary(rotary_scaling=ntk_keyword(s))
    new_base = base * s ** (r / (r - 2))
    want = new_base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    assert_close(got.frequencies(None).double(), want, rtol=1e-6, atol=0)


def test_rotate_num_heads_rotates_only_the_last_heads_and_their_kv_groups():
    torch.manual_seed(2)
    part, full = rotary(heads=4, rotary_heads=2), rotary(heads=4)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)               # GQA: 2 query heads per key head
    pos = torch.arange(3, 8)[None]
    (pq, pk), (fq, fk) = part(q, k, pos, pos), full(q, k, pos, pos)
    assert_close(pq[:, :2], q[:, :2])
    assert_close(pk[:, :1], k[:, :1])
    assert_close(pq[:, 2:], fq[:, 2:])
    assert_close(pk[:, 1:], fk[:, 1:])
    assert not torch.allclose(pq[:, 2:], q[:, 2:])
    assert_close(part.rotate(k, pos), pk)


def test_dynamic_pos_bias_equals_x_transformers_and_depends_only_on_the_offset():
    torch.manual_seed(3)
    o = DynamicBiasOptions(depth=3, log_distance=True, norm=True)
    ours = perturb(DynamicPositionBias(32, 4, o))
    theirs = xt.DynamicPositionBias(8, heads=4, depth=3, log_distance=True, norm=True)
    linears = [m for m in ours.mlp if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm))]
    with torch.no_grad():
        their = [m for m in theirs.modules() if isinstance(m, torch.nn.Linear)]
        norms = [m for m in theirs.modules() if isinstance(m, xt.LayerNorm)] + [
            m for m in theirs.modules() if type(m) is torch.nn.LayerNorm and m.elementwise_affine]
        ln_ours = [m for m in linears if isinstance(m, torch.nn.LayerNorm)]
        for a, b in zip([m for m in linears if isinstance(m, torch.nn.Linear)], their):
            b.weight.copy_(a.weight), b.bias.copy_(a.bias)
        norms[0].gamma.copy_(ln_ours[0].weight)
        ln_ours[0].bias.zero_()                                # theirs has no bias on the first norm
        for a, b in zip(ln_ours[1:], norms[1:]):
            b.weight.copy_(a.weight), b.bias.copy_(a.bias)
    i, j = 5, 9
    got = ours(torch.arange(j - i, j)[None], torch.arange(j)[None])[0]
    assert_close(got, theirs(i, j), rtol=1e-5, atol=1e-6)
    shifted = ours(torch.arange(j - i, j)[None] + 11, torch.arange(j)[None] + 11)[0]
    assert_close(shifted, got)
    heads = torch.tensor([3, 1])
    aligned = ours.aligned(torch.arange(j - i, j).view(1, 1, i), torch.arange(j).view(1, 1, j), heads)
    assert_close(aligned[:, 0], got[heads])


def cope_kv(k: torch.Tensor, pos: torch.Tensor) -> KV:
    return KV(k=k, v=k, pos=pos, mask=None)


def test_cope_term_equals_x_transformers_cope():
    torch.manual_seed(4)
    n, d, scale = 6, 8, 8 ** -0.5
    ours = CopeRelative(CopeOptions(max_pos=4), dim=32, heads=2, dim_head=d)
    with torch.no_grad():
        ours.pos_emb.normal_()
    theirs = xt.CoPE(d, 2, max_pos=4)
    with torch.no_grad():
        theirs.pos_emb.copy_(ours.pos_emb)
    q, k = torch.randn(2, 2, n, d), torch.randn(2, 2, n, d)
    pos = torch.arange(n)[None]
    logits = (q @ k.transpose(-1, -2)) * scale
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    want = theirs(q, logits.masked_fill(~causal, -torch.finfo(q.dtype).max))
    got = ours.cope_terms(q, cope_kv(k, pos), pos, scale, None)
    assert_close(got[..., causal], want[..., causal], rtol=1e-5, atol=1e-5)
    assert (got[..., ~causal] == 0).all()


def test_cope_soft_onehot_weights_rows_by_a_softmax_of_their_distance_to_p():
    torch.manual_seed(6)      # (x-transformers 2.31.10's own soft one-hot path fails on 4-d positions)
    n, d, scale = 5, 8, 0.5
    ours = perturb(CopeRelative(CopeOptions(max_pos=3, soft_onehot=True), dim=32, heads=2, dim_head=d))
    q, k = torch.randn(1, 2, n, d).double(), torch.randn(1, 2, n, d).double()
    pos = torch.arange(n)[None]
    got = ours.cope_terms(q.float(), cope_kv(k.float(), pos), pos, scale, None).double()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    gates = torch.sigmoid(q @ k.transpose(-1, -2) * scale) * causal
    p = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=2)                    # Σ_{t=j..i} g_it
    rows = torch.arange(3, dtype=torch.float64)
    weights = torch.softmax(-(p[..., None] - rows).abs() / 0.05, dim=-1)
    want = (weights * (q @ ours.pos_emb.double().t())[..., None, :]).sum(-1) * causal
    assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_cope_counts_gates_in_position_order_whatever_the_key_order():
    torch.manual_seed(5)
    ours = perturb(CopeRelative(CopeOptions(max_pos=5), dim=32, heads=2, dim_head=8))
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 7, 8)
    q_pos, k_pos = torch.arange(4, 7)[None], torch.arange(7)[None]
    perm = torch.tensor([5, 2, 6, 0, 3, 1, 4])                               # a decode ring's slot order
    straight = ours.cope_terms(q, cope_kv(k, k_pos), q_pos, 0.3, None)
    shuffled = ours.cope_terms(q, cope_kv(k[:, :, perm], k_pos[:, perm]), q_pos, 0.3, None)
    assert_close(shuffled, straight[..., perm])
    gates = torch.sigmoid(q.double() @ k.double().transpose(-1, -2) * 0.3)   # explicit p_ij for query 0 (pos 4)
    p = torch.stack([gates[..., 0, j:5].sum(-1) for j in range(5)], -1).clamp(max=4)
    e = q.double()[..., 0, :] @ ours.pos_emb.double().t()                    # (1, 2, P)
    lo = p.floor().long()
    want = (1 - (p - lo)) * e.gather(-1, lo) + (p - lo) * e.gather(-1, p.ceil().long())
    assert_close(straight[..., 0, :5].double(), want, rtol=1e-5, atol=1e-6)


CAUSAL_SETS = {
    "rotary_xpos": dict(rotary_xpos=True, rotary_xpos_scale_base=8),
    "rotate_num_heads": dict(rotary_pos_emb=True, rotate_num_heads=1, rotary_base_rescale_factor=2.0),
    "dynamic_pos_bias": dict(dynamic_pos_bias=True, dynamic_pos_bias_mlp_depth=1),
    "attn_use_cope": dict(attn_use_cope=True, attn_cope_talking_heads=True),
}


@pytest.mark.parametrize("name", CAUSAL_SETS)
def test_a_later_token_leaves_earlier_outputs(name):
    model = perturb(tiny_lm(seed=0, **CAUSAL_SETS[name]), scale=0.1)
    x = ids(2, 10)
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % 64
    a, b = model(x), model(y)
    assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_dynamic_pos_bias_works_bidirectionally():
    model = perturb(tiny_lm(Encoder, seed=0, dynamic_pos_bias=True), scale=0.1)
    x = ids(1, 8)
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % 64
    assert not torch.allclose(model(x)[:, 0], model(y)[:, 0])          # position 0 sees the last token


@pytest.mark.parametrize("stack, keywords, words", [
    (Encoder, dict(rotary_xpos=True), ["rotary_xpos", "causal"]),
    (Decoder, dict(rotary_pos_emb=True, rotary_xpos_scale_base=64), ["rotary_xpos_scale_base", "rotary_xpos=True"]),
    (Decoder, dict(rotary_xpos=True, exit_layers=True), ["rotary_xpos", "exit_layers"]),
    (Decoder, dict(rotary_pos_emb=True, rotary_base_rescale_factor="big"), ["rotary_base_rescale_factor", "number"]),
    (Decoder, dict(rotary_pos_emb=True, rotary_base_rescale_factor=-1.0), ["rotary_base_rescale_factor", "positive"]),
    (Decoder, dict(rotary_pos_emb=True, rotary_base_rescale_factor=2.0, rotary_yarn=(2.0, 8)),
     ["rotary_base_rescale_factor", "rotary_yarn"]),
    (Decoder, dict(rotary_pos_emb=True, rotate_num_heads=5), ["rotate_num_heads", "heads (4)"]),
    (Decoder, dict(rotate_num_heads=2), ["rotate_num_heads", "rotary_pos_emb"]),
    (Decoder, dict(rotary_pos_emb=True, rotate_num_heads=1, attn_kv_heads=2), ["rotate_num_heads", "attn_kv_heads"]),
    (Decoder, dict(dynamic_pos_bias=True, dynamic_pos_bias_mlp_depth=0), ["dynamic_pos_bias_mlp_depth"]),
    (Decoder, dict(dynamic_pos_bias_norm=True), ["dynamic_pos_bias_norm", "dynamic_pos_bias=True"]),
    (Decoder, dict(dynamic_pos_bias=True, rel_pos_bias=True), ["dynamic_pos_bias", "rel_pos_bias"]),
    (Encoder, dict(attn_use_cope=True), ["attn_use_cope", "causal"]),
    (Decoder, dict(attn_use_cope=True, attn_cope_max_pos=0), ["attn_cope_max_pos"]),
    (Decoder, dict(attn_cope_max_pos=8), ["attn_cope_max_pos", "attn_use_cope"]),
    (Decoder, dict(attn_use_cope=True, dynamic_pos_bias=True), ["attn_use_cope", "dynamic_pos_bias"]),
    (Decoder, dict(rotary_xpso=True), ["rotary_xpos"]),
])
def test_bad_values_fail_at_build_naming_the_keyword(stack, keywords, words):
    with pytest.raises((ValueError, TypeError)) as err:
        stack(dim=32, depth=1, heads=4, **keywords)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_rotary_xpos_alone_turns_rotary_on_and_both_spellings_agree():
    one, two = Decoder(dim=32, depth=1, rotary_xpos=True), Decoder(dim=32, depth=1, rotary_xpos=True, rotary_pos_emb=True)
    assert one.cfg == two.cfg and one.cfg.attention.position == "rotary" and one.cfg.attention.rotary_xpos
    zeta0 = Rotary.from_config(8, one.cfg.attention).log_zeta[0].double() * 512      # gamma defaults to 512
    assert math.isclose(zeta0.exp().item(), 0.4 / 1.4, rel_tol=1e-5)


def test_configs_round_trip_through_json():
    from polyformer.config import LayersConfig, dumps, from_dict

    import json

    for keywords in CAUSAL_SETS.values():
        cfg = Decoder(dim=32, depth=1, heads=4, **keywords).cfg
        assert from_dict(LayersConfig, json.loads(dumps(cfg))) == cfg
