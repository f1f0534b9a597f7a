"""The Attention Free Transformer kernels, polyformer/attention/kernels/aft.py: each mode equals the
paper's formula evaluated explicitly in float64 (conv through its own convolution form), full with
zero biases is simple, local is full with the biases outside the window zeroed, inputs scaled x100
stay finite and exact, nothing a query computes depends on later keys, one query at a time equals
the whole sequence, biases follow each row's positions (gaps included), and bad options are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder, Encoder, TransformerWrapper
from polyformer.attention.kernels.aft import Aft, AftOptions
from polyformer.interfaces import KV, KernelSpec
from tests.helpers import ids, tiny_lm

B, H, D, WINDOW = 2, 4, 3, 3
MODES = ["simple", "full", "local", "conv"]


def make(mode: str, causal: bool, kv_heads: int = 2, seed: int = 0, window: int = WINDOW, max_len: int = 24) -> Aft:
    options = AftOptions(mode, window=window if mode in ("local", "conv") else None,
                         max_len=max_len if mode in ("full", "local") else None)
    kernel = Aft(KernelSpec(H, kv_heads, D, D, causal, layer=0, scale=1.0, options=options))
    kernel.chunk = 5                                   # several chunks on small inputs
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in kernel.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return kernel


def inputs(i: int = 9, n: int = 9, free: int = 0, kv_heads: int = 2, scale: float = 1.0, padded: bool = True,
           seed: int = 0) -> tuple[torch.Tensor, KV, torch.Tensor]:
    """q (B, H, i, D); n positioned keys after `free` memory keys, the queries' own last. Row 1 is
    left-padded by 2, its positions starting at 0 on its first kept key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, i, D, generator=g) * scale
    k, v = (torch.randn(B, kv_heads, free + n, D, generator=g) * scale for _ in range(2))
    pos = torch.arange(n).repeat(B, 1)
    mask = None
    if padded:
        pos[1] = (pos[1] - 2).clamp(min=0)
        mask = torch.ones(B, n, dtype=torch.bool)
        mask[1, :2] = False
    return q, KV(k, v, pos, mask, free), pos[:, n - i:]


def run(kernel: Aft, q: torch.Tensor, kv: KV, q_pos: torch.Tensor) -> torch.Tensor:
    return kernel(q, kv, q_pos=q_pos, causal=kernel.causal, memory=None, need_weights=False).out


def biases(kernel: Aft, kv: KV, q_pos: torch.Tensor) -> torch.Tensor:
    """w (B, kv_heads, i, j) straight from the definitions, one pair at a time (free keys: 0)."""
    i, g, j = q_pos.shape[1], kv.k.shape[1], kv.k.shape[2]
    w = torch.zeros(B, g, i, j, dtype=torch.float64)
    for b in range(B):
        for t in range(i):
            for u in range(j - kv.free):
                tp, up = int(q_pos[b, t]), int(kv.pos[b, u])
                near = abs(tp - up) < kernel.window
                if kernel.mode == "full" or (kernel.mode == "local" and near):
                    w[b, :, t, kv.free + u] = float(kernel.pair_bias[tp, up].detach())
                elif kernel.mode == "conv" and (0 <= tp - up < kernel.window if kernel.causal else near):
                    offset = tp - up + (0 if kernel.causal else kernel.window - 1)
                    w[b, :, t, kv.free + u] = kernel.conv_bias.detach()[:, offset]
    return w


def formula(q: torch.Tensor, kv: KV, w: torch.Tensor, causal: bool) -> torch.Tensor:
    """σ(Q_t) ⊙ Σ_j exp(K_j + w_tj) ⊙ V_j / Σ_j exp(K_j + w_tj) over the keys t sees, in float64."""
    i, j, h = q.shape[2], kv.k.shape[2], q.shape[1]
    k, v, w = (x.double().repeat_interleave(h // x.shape[1], 1) for x in (kv.k, kv.v, w))
    seen = torch.ones(B, i, j, dtype=torch.bool)
    if causal:
        seen &= torch.ones(i, j, dtype=torch.bool).tril(j - i)
    if kv.mask is not None:
        seen &= F.pad(kv.mask, (kv.free, 0), value=True)[:, None]
    e = (k[:, :, None] + w[..., None]).exp() * seen[:, None, :, :, None]      # (b, h, t, j, d)
    return torch.sigmoid(q.double()) * (e * v[:, :, None]).sum(3) / e.sum(3)


def kept(out: torch.Tensor, kv: KV) -> torch.Tensor:
    """The outputs of queries that are not padding."""
    i = out.shape[2]
    return out.transpose(1, 2)[kv.mask[:, -i:]] if kv.mask is not None else out


SHAPES = [(9, 9, 0), (4, 9, 2), (1, 9, 2)]     # (queries, positioned keys, memory keys)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("i, n, free", SHAPES)
def test_every_mode_equals_its_formula(mode, causal, i, n, free):
    kernel = make(mode, causal)
    q, kv, q_pos = inputs(i, n, free)
    expected = formula(q, kv, biases(kernel, kv, q_pos), causal)
    assert_close(kept(run(kernel, q, kv, q_pos), kv), kept(expected, kv).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["local", "conv"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("i, n, free", [(40, 40, 0), (13, 40, 2), (1, 40, 2)])
def test_windows_wider_than_a_block_equal_the_formula(mode, causal, i, n, free):
    """A window of 19 keys over blocks of 8 queries (Aft.scan_chunk): per block one product for the keys
    before it and its own keys elementwise (causal), or one product for all its keys (bidirectional)."""
    kernel = make(mode, causal, window=19, max_len=48)
    q, kv, q_pos = inputs(i, n, free)
    expected = formula(q, kv, biases(kernel, kv, q_pos), causal)
    assert_close(kept(run(kernel, q, kv, q_pos), kv), kept(expected, kv).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["full", "local", "conv"])
@pytest.mark.parametrize("causal", [True, False])
def test_biases_follow_positions_with_gaps(mode, causal):
    """Positions 0, 2, 4, ...: the window and the biases are offsets of positions, not of indices."""
    kernel = make(mode, causal)
    q, kv, q_pos = inputs(6, 9, 2)
    kv, q_pos = KV(kv.k, kv.v, kv.pos * 2, kv.mask, kv.free), q_pos * 2
    expected = formula(q, kv, biases(kernel, kv, q_pos), causal)
    assert_close(kept(run(kernel, q, kv, q_pos), kv), kept(expected, kv).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_conv_equals_a_depthwise_convolution_of_exp_k_v(causal):
    """The paper's form: conv(exp(K) ⊙ V, exp(w) - 1) + Σ exp(K) ⊙ V over the denominator's alike."""
    kernel = make("conv", causal)
    q, kv, q_pos = inputs(padded=False)
    k, v = kv.k.double(), kv.v.double()
    b, g, n, d = k.shape
    taps = (kernel.conv_bias.detach().double().exp() - 1).flip(-1).repeat_interleave(d, 0)[:, None]
    pad = (WINDOW - 1, 0 if causal else WINDOW - 1)

    def aft_conv(x: torch.Tensor) -> torch.Tensor:       # (b, g, n, d) -> (b, g, n, d)
        flat = x.transpose(2, 3).reshape(b, g * d, n)
        conv = F.conv1d(F.pad(flat, pad), taps, groups=g * d).reshape(b, g, d, n).transpose(2, 3)
        return conv + (x.cumsum(2) if causal else x.sum(2, keepdim=True))

    out = aft_conv(k.exp() * v) / aft_conv(k.exp())
    expected = torch.sigmoid(q.double()) * out.repeat_interleave(H // g, 1)
    assert_close(run(kernel, q, kv, q_pos), expected.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_full_with_zero_biases_is_simple(causal):
    full, simple = make("full", causal), make("simple", causal)
    with torch.no_grad():
        full.pair_bias.zero_()
    q, kv, q_pos = inputs(6, 9, 2)
    assert_close(kept(run(full, q, kv, q_pos), kv), kept(run(simple, q, kv, q_pos), kv), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_local_is_full_without_the_biases_outside_the_window(causal):
    local, full = make("local", causal), make("full", causal)
    t = torch.arange(24)
    with torch.no_grad():
        full.pair_bias.copy_(local.pair_bias * ((t[:, None] - t[None]).abs() < WINDOW))
    q, kv, q_pos = inputs(12, 12, 2)
    out = run(local, q, kv, q_pos)
    assert_close(kept(out, kv), kept(run(full, q, kv, q_pos), kv), atol=1e-5, rtol=1e-5)
    # keys beyond the window still count (unbiased): the last query sees a change to key 0
    kv.v[0, :, kv.free] += 1.0
    assert (run(local, q, kv, q_pos)[0, :, -1] - out[0, :, -1]).abs().min() > 1e-4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [True, False])
def test_inputs_scaled_by_100_stay_finite_and_exact(mode, causal):
    kernel = make(mode, causal)
    q, kv, q_pos = inputs(6, 11, 2, scale=100.0)
    out = run(kernel, q, kv, q_pos)
    assert torch.isfinite(out).all()
    expected = formula(q, kv, biases(kernel, kv, q_pos), causal)
    assert_close(kept(out, kv), kept(expected, kv).float(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_no_query_depends_on_a_later_key_even_a_huge_one(mode):
    kernel = make(mode, causal=True)
    q, kv, q_pos = inputs(12, 12, 2)
    out = run(kernel, q, kv, q_pos)
    for t in (0, 3, 4, 9):
        k, v = kv.k.clone(), kv.v.clone()
        k[..., kv.free + t + 1:, :] = 1e4        # a huge weight after t: a maximum over it would underflow the rest
        v[..., kv.free + t + 1:, :] = -1e4
        changed = run(kernel, q, KV(k, v, kv.pos, kv.mask, kv.free), q_pos)
        assert torch.equal(changed[:, :, :t + 1], out[:, :, :t + 1])
        assert not torch.allclose(changed[:, :, t + 1:], out[:, :, t + 1:])


@pytest.mark.parametrize("mode", MODES)
def test_one_query_at_a_time_equals_the_whole_sequence(mode):
    """What a decode state gives the kernel: every key so far, the last one the query's own."""
    kernel = make(mode, causal=True)
    q, kv, q_pos = inputs(11, 11, 2)
    whole = run(kernel, q, kv, q_pos)
    for t in range(2, 11):
        end = kv.free + t + 1
        step = KV(kv.k[:, :, :end], kv.v[:, :, :end], kv.pos[:, :t + 1], kv.mask[:, :t + 1], kv.free)
        assert_close(run(kernel, q[:, :, t:t + 1], step, q_pos[:, t:t + 1]), whole[:, :, t:t + 1],
                     atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_equal_finite_differences(mode, causal):
    """The maxima carry no gradient: they only rescale numerator and denominator alike."""
    kernel = make(mode, causal).double()
    q, kv, q_pos = inputs(4, 7, 1)
    q, k, v = (x.double().requires_grad_() for x in (q, kv.k, kv.v))

    def f(q, k, v):
        return kept(run(kernel, q, KV(k, v, kv.pos, kv.mask, kv.free), q_pos), kv)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("mode", ["full", "local", "conv"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_left_padded_row_equals_the_row_alone(mode, causal):
    """Biases are read at each row's positions, not at its indices."""
    kernel = make(mode, causal)
    q, kv, q_pos = inputs()
    row = slice(1, 2)
    alone = KV(kv.k[row, :, 2:], kv.v[row, :, 2:], kv.pos[row, 2:], None)
    assert_close(run(kernel, q, kv, q_pos)[row, :, 2:], run(kernel, q[row, :, 2:], alone, q_pos[row, 2:]),
                 atol=1e-6, rtol=1e-5)


def test_bfloat16_stays_close_to_float32():
    kernel = make("local", causal=True)
    q, kv, q_pos = inputs()
    half = KV(kv.k.bfloat16(), kv.v.bfloat16(), kv.pos, kv.mask)
    out = run(kernel, q.bfloat16(), half, q_pos)
    assert out.dtype == torch.bfloat16
    assert_close(kept(out.float(), kv), kept(run(kernel, q, kv, q_pos), kv), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("keywords, match", [
    (dict(attn_aft="fast"), "attn_aft must be one of"),
    (dict(attn_aft="local", attn_aft_window=0, attn_aft_max_len=32), "attn_aft_window must be an integer >= 1"),
    (dict(attn_aft="conv", attn_aft_window=-2), "attn_aft_window must be an integer >= 1"),
    (dict(attn_aft="conv"), "attn_aft='conv' needs attn_aft_window"),
    (dict(attn_aft="full"), "attn_aft='full' needs attn_aft_max_len"),
    (dict(attn_aft="local", attn_aft_window=3), "attn_aft='local' needs attn_aft_max_len"),
    (dict(attn_aft="full", attn_aft_max_len=0), "attn_aft_max_len must be an integer >= 1"),
    (dict(attn_aft="simple", attn_aft_window=3), "attn_aft='simple' has no window"),
    (dict(attn_aft="full", attn_aft_window=3, attn_aft_max_len=32), "attn_aft='full' has no window"),
    (dict(attn_aft="conv", attn_aft_window=3, attn_aft_max_len=32), "attn_aft_max_len sizes"),
    (dict(attn_aft_window=3), "need.* attn_aft"),
    (dict(attn_aft="simple", attn_collab_heads=True), "attn_collab_heads"),
    (dict(attn_aft="simple", attn_dropout=0.1), "attn_dropout"),
    (dict(attn_aft="simple", alibi_pos_emb=True), "cannot take the stack.s score bias"),
])
def test_bad_options_are_refused_by_name(keywords, match):
    with pytest.raises(ValueError, match=match):
        Decoder(dim=32, depth=1, heads=4, **keywords)


@pytest.mark.parametrize("stack", [Decoder, Encoder])
def test_a_sequence_beyond_max_len_is_refused_by_name(stack):
    model = tiny_lm(stack, attn_aft="full", attn_aft_max_len=8)
    model(ids(2, 8))
    with pytest.raises(ValueError, match="attn_aft_max_len=8"):
        model(ids(2, 9))


def test_return_attn_is_refused_by_name():
    model = TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=Decoder(dim=32, depth=1, heads=4,
                                                                                  attn_aft="simple"))
    with pytest.raises(ValueError, match="attn_aft"):
        model(ids(1, 5), return_attn=True)
