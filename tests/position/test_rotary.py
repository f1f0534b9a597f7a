"""Rotary position embedding, polyformer/position/rotary.py (RoPE, arXiv:2104.09864).

Each pair of features is a complex number rotated by pos * w_i, w_i = base^(-2i/r); the two pairing
conventions are checked against that complex computation, and the paper's properties (scores
depend only on the offset, norms are preserved) are checked on the module and on whole stacks.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.position.rotary import Rotary, apply_rotary, rotary_angles
from tests.helpers import ids, tiny_lm



def frequencies(r: int, base: float = 10000.0) -> torch.Tensor:
    """w_i = base^(-2i/r), i = 0 .. r/2 - 1, in float64, from the paper's formula."""
    return torch.tensor([base ** (-2.0 * i / r) for i in range(r // 2)], dtype=torch.float64)


def complex_rope(x: torch.Tensor, pos: torch.Tensor, r: int, interleaved: bool,
                 base: float = 10000.0) -> torch.Tensor:
    """Explicit RoPE: pair features into complex numbers z_i and multiply by e^(i pos w_i).

    interleaved: z_i = x[2i] + i x[2i+1] (RoFormer); otherwise z_i = x[i] + i x[i + r/2] (GPT-NeoX).
    Features past r are left as they are. x (b, h, n, d), pos (b|1, n).
    """
    xd = x.double()
    rot, rest = xd[..., :r], xd[..., r:]
    if interleaved:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2])
    else:
        z = torch.complex(rot[..., : r // 2], rot[..., r // 2:])
    theta = pos.double()[:, None, :, None] * frequencies(r, base)          # (b|1, 1, n, r/2)
    z = z * torch.polar(torch.ones_like(theta), theta)
    if interleaved:
        out = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        out = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out, rest), dim=-1).float()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_rotary_equals_complex_rotation(interleaved, rotary_dim):
    d = 16
    rotary = Rotary(d, rotary_dim=rotary_dim, interleaved=interleaved)
    q, k = torch.randn(2, 3, 7, d), torch.randn(2, 3, 5, d)
    q_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 9, 4, 20, 0, 1, 13]])
    k_pos = torch.tensor([[2, 7, 11, 0, 5]])
    rq, rk = rotary(q, k, q_pos, k_pos)
    r = rotary_dim or d
    assert_close(rq, complex_rope(q, q_pos, r, interleaved), atol=1e-5, rtol=1e-5)
    assert_close(rk, complex_rope(k, k_pos, r, interleaved), atol=1e-5, rtol=1e-5)


def test_the_two_pairings_are_different_rotations():
    """Guards the convention tests above: the flag really changes which features are paired."""
    x = torch.randn(1, 1, 4, 8)
    angles = rotary_angles(torch.arange(1, 5)[None], frequencies(8).float())
    assert not torch.allclose(apply_rotary(x, angles, interleaved=False),
                              apply_rotary(x, angles, interleaved=True), atol=1e-3)


def test_inv_freq_is_base_power():
    rotary = Rotary(16, base=500.0)
    assert_close(rotary.inv_freq, frequencies(16, 500.0).float())


@pytest.mark.parametrize("interleaved", [False, True])
def test_scores_depend_only_on_offset(interleaved):
    """q_m . k_n after rotation is a function of n - m: shifting both positions changes nothing."""
    rotary = Rotary(16, interleaved=interleaved)
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 4, 9, 16)
    q_pos = torch.tensor([[0, 3, 5, 8, 2, 1], [7, 7, 0, 4, 11, 6]])
    k_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [8, 1, 6, 3, 12, 5, 2, 7, 0]])
    scores = torch.einsum("bhid,bhjd->bhij", *rotary(q, k, q_pos, k_pos))
    for shift in (1, 13, 40):
        shifted = torch.einsum("bhid,bhjd->bhij", *rotary(q, k, q_pos + shift, k_pos + shift))
        assert_close(shifted, scores, atol=2e-4, rtol=1e-4)
    # and the scores do see the offset: moving only the keys changes them
    moved = torch.einsum("bhid,bhjd->bhij", *rotary(q, k, q_pos, k_pos + 1))
    assert not torch.allclose(moved, scores, atol=1e-2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_preserves_norms(interleaved):
    x = torch.randn(2, 3, 10, 16)
    pos = torch.randint(0, 1000, (2, 10))
    y = apply_rotary(x, rotary_angles(pos, frequencies(16).float()), interleaved)
    assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    # each rotated pair keeps its own length, not only the whole vector
    if interleaved:
        pairs_x, pairs_y = x.unflatten(-1, (8, 2)), y.unflatten(-1, (8, 2))
    else:
        pairs_x, pairs_y = torch.stack(x.chunk(2, -1), -1), torch.stack(y.chunk(2, -1), -1)
    assert_close(pairs_y.norm(dim=-1), pairs_x.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_position_zero_is_identity():
    rotary = Rotary(16)
    q, k = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    zeros = torch.zeros(1, 3, dtype=torch.long)
    rq, rk = rotary(q, k, zeros, zeros)
    assert_close(rq, q)
    assert_close(rk, k)


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_dim_leaves_tail_untouched(interleaved):
    rotary = Rotary(16, rotary_dim=6, interleaved=interleaved)
    q, k = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    pos = torch.arange(1, 6)[None]
    rq, rk = rotary(q, k, pos, pos)
    assert torch.equal(rq[..., 6:], q[..., 6:])
    assert torch.equal(rk[..., 6:], k[..., 6:])
    assert not torch.allclose(rq[..., :6], q[..., :6], atol=1e-3)    # the head is rotated


@pytest.mark.parametrize("interleaved", [False, True])
def test_stack_keywords_build_the_rotation(interleaved):
    """rotary_emb_dim / rotary_base / rotary_interleaved reach the module every block uses."""
    layers = Decoder(dim=32, depth=1, heads=4, rotary_pos_emb=True, rotary_emb_dim=4,
                     rotary_base=100.0, rotary_interleaved=interleaved)
    position = layers.blocks[0].branch.position
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    pos = torch.arange(6)[None] * 3
    rq, rk = position(q, k, pos, pos)
    assert_close(rq, complex_rope(q, pos, 4, interleaved, base=100.0), atol=1e-5, rtol=1e-5)
    assert_close(rk, complex_rope(k, pos, 4, interleaved, base=100.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stack", [Decoder, Encoder])
@pytest.mark.parametrize("flash", [None, False])
def test_stack_is_translation_invariant(stack, flash):
    """With rotary as the only position signal, shifting every position leaves the output and
    every attention map unchanged (on both the fused and the reference path)."""
    layers = stack(dim=32, depth=2, heads=4, rotary_pos_emb=True, attn_flash=flash).eval()
    x = torch.randn(2, 12, 32)
    pos = torch.arange(12)[None]
    out = layers(x, pos=pos)
    out_attn, rec = layers(x, pos=pos, return_attn=True)
    assert_close(out_attn, out, atol=1e-5, rtol=1e-5)
    for shift in (5, 37):
        assert_close(layers(x, pos=pos + shift), out, atol=1e-4, rtol=1e-4)
        _, rec_shift = layers(x, pos=pos + shift, return_attn=True)
        for a, b in zip(rec_shift.attn, rec.attn):
            assert_close(a, b, atol=1e-5, rtol=1e-4)
    # a shift of the keys' positions relative to the queries does change it: positions are used
    spread = layers(x, pos=pos * 2)
    assert not torch.allclose(spread, out, atol=1e-3)


def test_memory_keys_are_not_rotated():
    """Persistent memory keys carry no position: the first layer's map equals a by-hand softmax over
    [q_rot . mem_k, q_rot . k_rot] with only the sequence keys rotated."""
    model = tiny_lm(depth=1, rotary_pos_emb=True, attn_num_mem_kv=3, attn_dim_head=8)
    x = ids(batch=2, n=9)
    _, maps = model(x, return_attn=True)
    block = model.attn_layers.blocks[0]
    attn, proj = block.branch, block.branch.project
    h = block.norm_in(model.token_emb(x))
    q, k, _ = proj.to_qkv(h).split(proj.split, dim=-1)
    q, k = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in (q, k))
    pos = torch.arange(9)[None]
    q = complex_rope(q, pos, 8, interleaved=False)
    k = complex_rope(k, pos, 8, interleaved=False)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    seq = (q @ k.transpose(-1, -2) * 8 ** -0.5).masked_fill(~causal, float("-inf"))
    mem = q @ attn.memory_kv.k.transpose(-1, -2) * 8 ** -0.5
    expected = torch.cat((mem, seq), dim=-1).softmax(-1)
    assert_close(maps[0], expected, atol=1e-5, rtol=1e-5)


def test_decoder_attention_is_toeplitz_on_a_repeated_token():
    """A repeated token: first-layer scores s(i - j) depend only on the offset, so in a causal map
    A[i, i - k] / A[i, i] = exp(s(k) - s(0)) is the same for every row i >= k."""
    model = tiny_lm(depth=1, rotary_pos_emb=True)
    x = torch.full((1, 12), 5)
    _, maps = model(x, return_attn=True)
    a = maps[0][0]                                                         # (h, i, j)
    n = a.shape[-1]
    ratios_seen = []
    for k in range(1, 6):
        ratios = torch.stack([a[:, i, i - k] / a[:, i, i] for i in range(k, n)])   # (rows, h)
        assert_close(ratios, ratios[:1].expand_as(ratios), atol=1e-5, rtol=1e-4)
        ratios_seen.append(ratios[0])
    # the ratios vary with the offset: the map is not position-blind
    assert not torch.allclose(torch.stack(ratios_seen), torch.ones(5, 4), atol=1e-3)


def test_encoder_attention_repeats_on_a_periodic_sequence():
    """Bidirectional, distinct tokens: with x[i + 4] = x[i], the first-layer scores satisfy
    s(i + 4, j + 4) = s(i, j), so log A[i + 4, j + 4] - log A[i + 4, 4] = log A[i, j] - log A[i, 0]
    (the row normaliser cancels)."""
    model = tiny_lm(Encoder, depth=1, rotary_pos_emb=True)
    assert model.pos_emb is None                         # rotary replaces learned positions
    x = ids(batch=1, n=4).repeat(1, 3)                   # (1, 12), period 4
    _, maps = model(x, return_attn=True)
    log_a = maps[0][0].log()                             # (h, 12, 12)
    later = log_a[:, 4:8, 4:12] - log_a[:, 4:8, 4:5]
    first = log_a[:, 0:4, 0:8] - log_a[:, 0:4, 0:1]
    assert_close(later, first, atol=1e-4, rtol=1e-4)
    # without periodic tokens this fails, i.e. the comparison has teeth
    y = ids(batch=1, n=12, seed=3)
    _, maps_y = model(y, return_attn=True)
    log_b = maps_y[0][0].log()
    assert not torch.allclose(log_b[:, 4:8, 4:12] - log_b[:, 4:8, 4:5],
                              log_b[:, 0:4, 0:8] - log_b[:, 0:4, 0:1], atol=1e-3)


# --- scaled frequencies: position interpolation (arXiv:2306.15595) and Llama 3's scaling -------

LLAMA3 = dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def test_interpolation_divides_the_positions():
    """Angles at position p with factor f are the unscaled angles at p / f."""
    x = torch.randn(1, 2, 7, 16, dtype=torch.float64).float()
    pos = torch.arange(7)[None] * 3
    scaled, plain = Rotary(16, interpolation=2.5), Rotary(16)
    got = apply_rotary(x, rotary_angles(pos, scaled.inv_freq))
    expected = complex_rope(x, pos / 2.5, 16, interleaved=False)
    assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)
    assert_close(scaled.inv_freq, plain.inv_freq / 2.5)


def test_llama3_scaling_keeps_high_frequencies_divides_low_ones_and_blends_between():
    r, ctx = 32, LLAMA3["original_max_position_embeddings"]
    w = frequencies(r)
    scaled = Rotary(r, llama3=tuple(LLAMA3.values())).inv_freq.double()
    wavelength = 2 * torch.pi / w
    high = wavelength < ctx / LLAMA3["high_freq_factor"]               # shorter than 16 positions
    low = wavelength > ctx / LLAMA3["low_freq_factor"]                 # longer than 64 positions
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()                      # every band is exercised
    assert_close(scaled[high], w[high], rtol=1e-6, atol=0)
    assert_close(scaled[low], w[low] / LLAMA3["factor"], rtol=1e-6, atol=0)
    assert ((scaled[mid] < w[mid]) & (scaled[mid] > w[mid] / LLAMA3["factor"])).all()
    smooth = (ctx / wavelength[mid] - 1.0) / (4.0 - 1.0)               # the published blend
    assert_close(scaled[mid], (1 - smooth) * w[mid] / 4.0 + smooth * w[mid], rtol=1e-6, atol=0)


@pytest.mark.parametrize("scaling", [dict(rotary_interpolation_factor=3.0), dict(rotary_llama3_scaling=LLAMA3)])
def test_scaled_scores_still_depend_only_on_offset(scaling):
    model = tiny_lm(rotary_pos_emb=True, attn_dim_head=16, **scaling)
    rotary = model.attn_layers.blocks[0].branch.position
    assert not torch.equal(rotary.inv_freq, Rotary(16).inv_freq)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    scores = []
    for shift in (0, 5, 40):
        pos_q, pos_k = torch.tensor([[7 + shift]]), torch.tensor([[2 + shift]])
        rq, rk = rotary(q, k, pos_q, pos_k)
        scores.append((rq * rk).sum())
    assert_close(scores[1], scores[0], atol=1e-5, rtol=1e-5)
    assert_close(scores[2], scores[0], atol=1e-5, rtol=1e-5)


def test_scaling_is_saved_with_the_config_and_its_dict_is_checked():
    from polyformer import build_model, model_config

    model = tiny_lm(rotary_pos_emb=True, rotary_llama3_scaling=LLAMA3)
    rebuilt = build_model(model_config(model))
    assert torch.equal(rebuilt.attn_layers.blocks[0].branch.position.inv_freq,
                       model.attn_layers.blocks[0].branch.position.inv_freq)
    # the rules (scaling without rotary, factor below 1, swapped bands, two scalings) are rows of
    # tests/test_keywords.py RULE_CASES; the dict's own shape is checked when the keyword is read
    with pytest.raises(TypeError, match="rotary_llama3_scaling.*exactly the keys"):
        Decoder(dim=32, depth=1, rotary_pos_emb=True, rotary_llama3_scaling={"factor": 8.0})
