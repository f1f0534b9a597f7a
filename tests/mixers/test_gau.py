"""FLASH's gated attention unit (gau, gau_chunk): the unit equals its equations written out here term by
term, mixed chunk attention equals its own equations and, with one chunk covering the sequence, the
quadratic unit; rotary scores depend on offsets only; cached decoding (keys, or the chunked recurrent
summary, with rollback) equals the parallel forward; padding is exact; bad keywords fail by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AttentionLayers, Decoder, Encoder
from polyformer.interfaces import Context
from polyformer.mixers import gau_chunked as chunked
from tests.options import perturb

DIM, S = 8, 6


def stack(causal: bool = True, depth: int = 1, **keywords) -> AttentionLayers:
    torch.manual_seed(0)
    cls = Decoder if causal else Encoder
    return perturb(cls(dim=DIM, depth=depth, gau=True, gau_qk_dim=S, **keywords), scale=0.3).double().eval()


def run(unit, x, pos, mask, causal, need_weights=False):
    return unit(x, Context(pos=pos, mask=mask, causal=causal, need_weights=need_weights))


def explicit(unit, x, pos, mask, causal, chunk=None):
    """The paper's equations, one query and one key at a time: U, V, Z = SiLU(X W + b), per-dimension
    scale and offset of Z for each query / key, relu² attention over the keys a query sees (its chunk
    only, when chunked, plus plain linear attention to the earlier chunks, or to all of them in an
    Encoder); the pseudo-code's scaling: relu²(score / N) unchunked, N the number of kept keys the query
    sees (the paper's length n), relu²(score / c) inside a chunk of c and the linear sum divided by N;
    O = (U ⊙ A V) W_o + b_o. With rotary_pos_emb every query / key pair is rotated (the unit's own
    rotation, tested in tests/position)."""
    e = unit.expand
    u, v, z = F.silu(x @ unit.hidden.weight.T + unit.hidden.bias).split((e, e, S), -1)
    parts = [z * unit.gamma[p] + unit.beta[p] for p in range(unit.gamma.shape[0])]
    if unit.rotary is not None:
        for p in range(0, len(parts), 2):
            rq, rk = unit.rotary(parts[p][:, None], parts[p + 1][:, None], pos, pos)
            parts[p], parts[p + 1] = rq[:, 0], rk[:, 0]
    out = torch.zeros_like(u)
    b, n = mask.shape
    for r in range(b):
        for i in range(n):
            seen = [j for j in range(n) if mask[r, j] and (not causal or pos[r, j] <= pos[r, i])]
            total = torch.zeros(e, dtype=x.dtype)
            count = max(len(seen), 1)
            for j in seen:
                if chunk is None:
                    total += F.relu(parts[0][r, i] @ parts[1][r, j] / count) ** 2 * v[r, j]
                elif pos[r, j] // chunk == pos[r, i] // chunk:
                    total += F.relu(parts[0][r, i] @ parts[1][r, j] / chunk) ** 2 * v[r, j]
                if chunk is not None and (not causal or pos[r, j] // chunk < pos[r, i] // chunk):
                    total += (parts[2][r, i] @ parts[3][r, j]) * v[r, j] / count
            out[r, i] = u[r, i] * total
    return out @ unit.out.weight.T + unit.out.bias


def padded(causal: bool, n: int):
    """Causal: row 1 left-padded, positions counted per row; bidirectional: a hole and right padding."""
    mask = torch.ones(2, n, dtype=torch.bool)
    if causal:
        mask[1, :3] = False
        return (mask.long().cumsum(-1) - 1).clamp(min=0), mask
    mask[0, 2:4] = False
    mask[1, n - 2:] = False
    return torch.arange(n).expand(2, n), mask


@pytest.mark.parametrize("causal", [True, False])
def test_unit_equals_its_equations(causal):
    unit = stack(causal).blocks[0].branch
    x = torch.randn(2, 7, DIM, dtype=torch.float64)
    pos, mask = padded(causal, 7)
    got = run(unit, x, pos, mask, causal, need_weights=True)
    assert_close(got.out[mask], explicit(unit, x, pos, mask, causal)[mask], rtol=1e-10, atol=1e-10)
    # the weights returned are A: relu² of the scores divided by the count of keys each query sees
    z = F.silu(x @ unit.hidden.weight.T + unit.hidden.bias)[..., -S:]
    q, k = z * unit.gamma[0] + unit.beta[0], z * unit.gamma[1] + unit.beta[1]
    seen = mask[:, None, :] & ((pos[:, None, :] <= pos[:, :, None]) if causal else True)
    a = torch.where(seen, F.relu(q @ k.transpose(1, 2) / seen.sum(-1, keepdim=True)) ** 2, 0.0)
    assert_close(got.weights[:, 0][mask], a[mask], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_mixed_chunk_attention_equals_its_equations(causal, rotary):
    unit = stack(causal, gau_chunk=3, **(dict(rotary_pos_emb=True) if rotary else {})).blocks[0].branch
    x = torch.randn(2, 11, DIM, dtype=torch.float64)          # 11 positions: the last chunk is partial
    pos, mask = padded(causal, 11)
    expected = explicit(unit, x, pos, mask, causal, chunk=3)
    assert_close(run(unit, x, pos, mask, causal).out[mask], expected[mask], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rotary", [False, True])
def test_one_chunk_covering_the_sequence_is_the_quadratic_unit(rotary):
    """A chunk of c = n positions divides the scores by c, the unchunked unit by the n keys each query
    sees in an Encoder: the same once the linear term (which reaches every chunk there) is off."""
    keywords = dict(rotary_pos_emb=True) if rotary else {}
    x = torch.randn(2, 11, DIM, dtype=torch.float64)
    pos = torch.arange(11)[None]
    enc_chunked, enc_plain = (stack(False, gau_chunk=11, **keywords).blocks[0].branch,
                              stack(False, **keywords).blocks[0].branch)
    with torch.no_grad():
        enc_plain.load_state_dict({k: v[:2] if k in ("gamma", "beta") else v
                                   for k, v in enc_chunked.state_dict().items()})
        assert not torch.allclose(run(enc_chunked, x, pos, None, False).out, run(enc_plain, x, pos, None, False).out)
        enc_chunked.gamma[2:] = 0.0
        enc_chunked.beta[2:] = 0.0
    assert_close(run(enc_chunked, x, pos, None, False).out, run(enc_plain, x, pos, None, False).out)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [9, 11])                 # whole chunks of 3 (views), and a partial last chunk
def test_unpadded_rows_from_position_zero_equal_the_placed_layout(causal, n):
    """mixed_chunk's shortcut for keep=None at positions 0 .. n - 1 (the layout is the input itself) gives
    the output and the decode summary of the general path, taken here by an all-True keep mask."""
    torch.manual_seed(0)
    qq, ql, kq, kl = (torch.randn(2, n, S, dtype=torch.float64) for _ in range(4))
    v, pos = torch.randn(2, n, 5, dtype=torch.float64), torch.arange(n)[None]
    fast, fast_summary = chunked.mixed_chunk(qq, ql, kq, kl, v, pos, None, 3, causal)
    general, summary = chunked.mixed_chunk(qq, ql, kq, kl, v, pos, torch.ones(2, n, dtype=torch.bool), 3, causal)
    assert_close(fast, general, rtol=1e-12, atol=1e-12)
    if causal:
        assert fast_summary.keys() == summary.keys()
        for name in summary:
            assert_close(fast_summary[name], summary[name], rtol=1e-12, atol=1e-12)
    else:
        assert fast_summary is None and summary is None


@pytest.mark.parametrize("chunk", [None, 3])
def test_rotary_scores_depend_on_offsets_only(chunk):
    unit = stack(gau_chunk=chunk, rotary_pos_emb=True).blocks[0].branch
    x = torch.randn(1, 9, DIM, dtype=torch.float64)
    pos = torch.arange(9)[None]
    base = run(unit, x, pos, None, True).out
    assert_close(run(unit, x, pos + 6, None, True).out, base)          # 6: whole chunks, same chunking
    no_rotary = stack(gau_chunk=chunk).blocks[0].branch
    no_rotary.load_state_dict(unit.state_dict())
    assert not torch.allclose(run(no_rotary, x, pos, None, True).out, base)


def steps(layers, x, mask, pos, sizes, history=0):
    """Decode x in steps of `sizes` positions, each step with its own padding and positions."""
    state = layers.new_state(x.shape[0], x.shape[1], history=history)
    outs, t = [], 0
    for size in sizes:
        outs.append(layers(x[:, t:t + size], mask=mask[:, t:t + size], pos=pos[:, t:t + size], state=state))
        t += size
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("sizes", [(1,) * 13, (5, 1, 3, 4), (13,)])
def test_cached_decoding_equals_the_parallel_forward(chunk, sizes):
    layers = stack(depth=2, gau_chunk=chunk, rotary_pos_emb=True).float()
    x = torch.randn(2, 13, DIM)
    pos, mask = padded(True, 13)
    full = layers(x, mask=mask, pos=pos)          # row 1: three steps of padding before its first token
    cached, state = steps(layers, x, mask, pos, sizes)
    assert_close(cached[mask], full[mask], rtol=1e-5, atol=1e-5)
    assert state.kinds == (("keys",) if chunk is None else ("recurrent",)) * 2


@pytest.mark.parametrize("chunk", [None, 3])
def test_rollback_across_a_chunk_boundary_equals_the_shorter_prefix(chunk):
    layers = stack(depth=2, gau_chunk=chunk).float()
    x = torch.randn(2, 11, DIM)
    ones = torch.ones(2, 11, dtype=torch.bool)
    _, state = steps(layers, x, ones, torch.arange(11).expand(2, 11), (4, 2, 1, 2), history=4)
    state.rollback(3)                                # forget positions 6, 7, 8: back into chunk 1
    resumed = layers(x[:, 9:11], state=state)
    fresh = layers(torch.cat((x[:, :6], x[:, 9:11]), 1))[:, -2:]
    assert_close(resumed, fresh, rtol=1e-5, atol=1e-5)
    if chunk is not None:
        with pytest.raises(ValueError, match="history"):
            state.rollback(5)


@pytest.mark.parametrize("chunk", [None, 3])
def test_padding_is_exact(chunk):
    # Decoder: a left-padded row with its own positions equals the row alone
    layers = stack(gau_chunk=chunk, rotary_pos_emb=True)
    x = torch.randn(2, 10, DIM, dtype=torch.float64)
    pos, mask = padded(True, 10)
    y = torch.where(mask[..., None], x, 100 * torch.randn_like(x))
    assert_close(layers(y, mask=mask, pos=pos)[1, 3:], layers(x[1:, 3:])[0])
    # Encoder: a right-padded row equals the row cut short (padded keys count for nothing, not even in N)
    enc = stack(False, gau_chunk=chunk)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    assert_close(enc(y, mask=mask)[1, :7], enc(y[1:, :7])[0])
    assert not torch.allclose(enc(y)[1, :7], enc(y[1:, :7])[0])


def test_a_stack_of_units_replaces_attention_and_feedforward():
    layers = Decoder(dim=DIM, depth=3, gau=True, gau_qk_dim=S, gau_expansion=1.5)
    assert layers.layout == ("a",) * 3
    assert layers.blocks[0].branch.out.in_features == 12          # e = expansion · dim


@pytest.mark.parametrize("keywords, match", [
    (dict(gau=True, gau_chunk=0), "gau_chunk"),
    (dict(gau=True, gau_chunk=2.5), "gau_chunk"),
    (dict(gau=True, gau_qk_dim=0), "gau_qk_dim"),
    (dict(gau=True, gau_expansion=0), "gau_expansion"),
    (dict(gau=True, custom_layers=("a", "f")), "custom_layers"),
    (dict(gau=True, macaron=True), "macaron"),
    (dict(gau=True, sandwich_coef=1), "sandwich_coef"),
    (dict(gau=True, cross_attend=True), "cross_attend"),
    (dict(gau_chunk=4), "gau"),
    (dict(gau=True, rel_pos_bias=True), "rel_pos_bias"),
    (dict(gau=True, ff_mult=2), "ff_mult"),
    (dict(gau=True, attn_kv_heads=2), "attn_kv_heads"),
    (dict(gau=True, attn_num_mem_kv=2), "attn_num_mem_kv"),
    (dict(gau=True, position_infused_attn=True), "position_infused_attn"),
    (dict(gau=True, gau_qk_dim=7, rotary_pos_emb=True), "gau_qk_dim"),
    (dict(gau=True, attn_fnet=True), "gau"),
])
def test_bad_keywords_fail_by_name(keywords, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Decoder(dim=DIM, depth=2, **keywords)


def test_bad_calls_fail_by_name():
    layers = stack(gau_chunk=3)
    x = torch.randn(1, 4, DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match="return_attn"):
        layers(x, return_attn=True)
    with pytest.raises(ValueError, match="gau_chunk"):
        layers(x, pos=torch.tensor([[0, 1, 1, 2]]))          # two kept tokens at one position
    with pytest.raises(ValueError, match="prefix_len"):
        layers(x, prefix_len=2)
