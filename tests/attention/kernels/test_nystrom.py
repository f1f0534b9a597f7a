"""Nyström attention (kernels/nystrom.py): with one landmark per position it is softmax attention (to
the pseudo-inverse's tolerance), its error falls as landmarks grow on inputs smooth along the sequence,
padding is exact, the convolution is a depthwise convolution of the values, the pseudo-inverse's
initialisation decides whether a sample depends on its batch-mates; bad options are refused by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.attention.kernels.dense import match_heads
from polyformer.attention.kernels.nystrom import Nystrom, NystromOptions, iterative_pinv, nystrom, segment_means
from polyformer.interfaces import KV, KernelSpec


def kernel(landmarks: int, heads: int = 2, kv_heads: int | None = None, d: int = 8, **options) -> Nystrom:
    return Nystrom(KernelSpec(heads=heads, kv_heads=kv_heads or heads, dim_qk=d, dim_v=d, causal=False, layer=0,
                              scale=d ** -0.5, options=NystromOptions(landmarks, **options)))


def run(k: Nystrom, q, keys, values, mask=None, need_weights=False):
    pos = torch.arange(keys.shape[2])[None]
    return k(q, KV(keys, values, pos, mask), q_pos=pos[:, -q.shape[2]:], causal=False, memory=None,
             need_weights=need_weights)


def qkv(b=2, h=2, n=16, d=8, hk=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, n, d, generator=g, dtype=dtype), torch.randn(b, hk or h, n, d, generator=g, dtype=dtype),
            torch.randn(b, hk or h, n, d, generator=g, dtype=dtype))


def smooth(b, h, n, d, g, freqs=3):
    """Inputs that vary slowly along the sequence (a few cosines): the regime segment means are made for."""
    t = torch.linspace(0, 1, n, dtype=torch.float64)
    basis = torch.stack([torch.cos(math.pi * f * t) for f in range(freqs)], -1)
    return basis @ torch.randn(b, h, freqs, d, generator=g, dtype=torch.float64)


def padding():
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, 11:] = False
    mask[1, 3:6] = False
    return mask


def test_one_landmark_per_position_is_softmax_attention():
    """With m = n the landmarks are the tokens, A = S and Ŝ = S A⁺ S = S. Tolerance 1e-9 in float64
    with 30 iterations: with X = AZ a step maps X to (13X - 15X² + 7X³ - X⁴) / 4, so I - X is cubed
    (times ~3/4) near convergence, and a direction with small X grows 13/4-fold per step. From
    Z₀ = Aᵀ / ‖A‖₁ the smallest direction starts near 1 / κ(A)², κ(A) between 2·10² and 2.2·10³ for
    these 16 x 16 softmax matrices: about 13 steps to converge, a few more to reach float64 rounding
    grown by κ(A) (~1e-13); 1e-9 leaves margin. The paper's 6 iterations stop far short (asserted: the tolerance is
    the iteration's, not the formula's). Padded positions are no landmarks and no keys, so the masked
    case is masked softmax."""
    q, k, v = qkv(dtype=torch.float64)
    q = q * 8 ** -0.5
    ref = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    assert_close(nystrom(q, k, v, None, 16, 30)[0], ref, atol=1e-9, rtol=0)
    assert (nystrom(q, k, v, None, 16, 6)[0] - ref).abs().max() > 1e-4
    mask = padding()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=1.0)
    out = nystrom(q, k, v, mask, 16, 30)[0]
    assert_close(out.transpose(1, 2)[mask], ref.transpose(1, 2)[mask], atol=1e-9, rtol=0)


def test_default_iterations_hold_the_declared_tolerance():
    for seed in range(3):
        q, k, v = qkv(seed=seed)
        ref = F.scaled_dot_product_attention(q, k, v)
        out = nystrom(q * 8 ** -0.5, k, v, None, 16, NystromOptions(16).pinv_iters)[0]
        assert (out - ref).abs().max() < Nystrom.caps.tolerance


def test_every_key_a_landmark_is_exact_softmax():
    """m >= keys takes softmax attention itself (what the iteration converges to)."""
    q, k, v = qkv()
    mask = padding()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    out = run(kernel(20), q, k, v, mask, need_weights=True)
    assert_close(out.out, ref, atol=1e-6, rtol=1e-5)
    assert_close(out.weights @ v, out.out)


def test_error_falls_as_landmarks_grow():
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        q, k = smooth(2, 2, 64, 16, g) * 0.5, smooth(2, 2, 64, 16, g) * 0.5
        v = torch.randn(2, 2, 64, 16, generator=g, dtype=torch.float64)
        ref = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        errors = [(nystrom(q, k, v, None, m, 30)[0] - ref).norm() / ref.norm() for m in (4, 8, 16, 32)]
        assert all(a > b for a, b in zip(errors, errors[1:])), errors
        assert errors[-1] < 1e-3


@pytest.mark.parametrize("n", [12, 13])
def test_segment_means_are_the_means_of_contiguous_segments(n):
    """Segment t * m // n; the view path (m divides n, no padding) and the weighted path agree with a loop."""
    x, m = torch.randn(2, 3, n, 4, dtype=torch.float64), 4
    segment = torch.arange(n) * m // n
    expected = torch.stack([x[:, :, segment == s].mean(2) for s in range(m)], dim=2)
    for keep in (None, torch.ones(2, n, dtype=torch.bool)):
        marks, ok = segment_means(x, keep, m)
        assert_close(marks, expected, rtol=0, atol=1e-12)
        assert ok.all()


@pytest.mark.parametrize("landmarks", [4, 5])        # segments of 4, and of 3 or 4 positions
def test_padding_is_exact(landmarks):
    torch.manual_seed(0)
    attn = kernel(landmarks, conv=3)
    q, k, v = qkv()
    mask = padding()
    q2, k2, v2 = (torch.where(mask[:, None, :, None], t, torch.randn_like(t)) for t in (q, k, v))
    out, other = run(attn, q, k, v, mask).out, run(attn, q2, k2, v2, mask).out
    assert_close(other.transpose(1, 2)[mask], out.transpose(1, 2)[mask])
    assert not torch.allclose(run(attn, q2, k2, v2).out, run(attn, q, k, v).out)
    none = torch.zeros_like(mask)
    empty = run(attn, q, k, v, none)
    assert torch.equal(empty.out, torch.zeros_like(empty.out))


def test_convolution_adds_a_depthwise_convolution_of_the_values():
    torch.manual_seed(0)
    with_conv, plain = kernel(4, conv=5), kernel(4)
    q, k, v = qkv()
    mask = padding()
    w = with_conv.conv[:, 0, :, 0]                                             # (h, 5)
    kept = v * mask[:, None, :, None]
    padded = F.pad(kept, (0, 0, 2, 2))
    ref = sum(w[None, :, t, None, None] * padded[:, :, t:t + 16] for t in range(5))
    assert_close(run(with_conv, q, k, v, mask).out - run(plain, q, k, v, mask).out, ref, atol=1e-5, rtol=1e-5)


def test_row_initialisation_keeps_samples_apart_and_batch_does_not():
    q, k, v = qkv(b=2)
    k2 = k.clone()
    k2[1] = 3 * k2[1]            # another ‖A‖₁ for sample 1
    row, batch = kernel(4, pinv_init="row"), kernel(4, pinv_init="batch")
    assert_close(run(row, q, k, v).out[0], run(row, q, k2, v).out[0], atol=0, rtol=0)
    assert not torch.allclose(run(batch, q, k, v).out[0], run(batch, q, k2, v).out[0])
    one = kernel(4, heads=1, pinv_init="row"), kernel(4, heads=1, pinv_init="batch")
    a, b = (run(attn, q[:1, :1], k[:1, :1], v[:1, :1]).out for attn in one)      # one matrix: the same
    assert_close(a, b)


def test_pseudo_inverse_converges_from_either_initialisation():
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(2, 3, 6, 6, generator=g, dtype=torch.float64)).softmax(-1)
    a[0, 0, 4:] = 0                      # landmarks without positions: zero rows and columns
    a[0, 0, :, 4:] = 0
    for init in ("row", "batch"):
        assert_close(iterative_pinv(a, 40, init), torch.linalg.pinv(a), atol=1e-8, rtol=0)


def test_weights_give_the_output():
    q, k, v = qkv()
    out = run(kernel(4), q, k, v, padding(), need_weights=True)
    assert out.weights.shape == (2, 2, 16, 16)
    assert_close(out.weights @ v, out.out, atol=1e-5, rtol=1e-5)


def test_grouped_kv_heads_equal_repeated_heads():
    q, k, v = qkv(h=4, hk=2)
    grouped = run(kernel(4, heads=4, kv_heads=2), q, k, v, padding()).out
    assert_close(grouped, run(kernel(4, heads=4), q, match_heads(k, 4), match_heads(v, 4), padding()).out)


def test_bfloat16_follows_float32():
    torch.manual_seed(0)
    attn = kernel(4, conv=3)
    q, k, v = qkv()
    low = run(attn, q.bfloat16(), k.bfloat16(), v.bfloat16(), padding()).out
    assert low.dtype == torch.bfloat16
    assert_close(low.float(), run(attn, q, k, v, padding()).out, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("keywords, named", [
    (dict(attn_nystrom_landmarks=0), "attn_nystrom_landmarks"),
    (dict(attn_nystrom_landmarks=2.5), "attn_nystrom_landmarks"),
    (dict(attn_nystrom_landmarks=4, attn_nystrom_pinv_iters=0), "attn_nystrom_pinv_iters"),
    (dict(attn_nystrom_landmarks=4, attn_nystrom_conv=4), "attn_nystrom_conv"),
    (dict(attn_nystrom_landmarks=4, attn_nystrom_conv=-1), "attn_nystrom_conv"),
    (dict(attn_nystrom_landmarks=4, attn_nystrom_pinv_init="col"), "attn_nystrom_pinv_init"),
    (dict(attn_nystrom_landmarks=4, attn_dropout=0.1), "attn_dropout"),
    (dict(attn_nystrom_conv=3), "attn_nystrom_landmarks"),
])
def test_bad_options_are_refused_by_name(keywords, named):
    with pytest.raises(ValueError, match=named):
        Encoder(dim=16, depth=1, heads=2, **keywords)


def test_a_decoder_is_refused():
    with pytest.raises(ValueError, match="attn_nystrom_landmarks.*cannot be causal"):
        Decoder(dim=16, depth=1, heads=2, attn_nystrom_landmarks=4)
