"""Infini-attention (attention/kernels/infini.py, infini_core.py): equality with the paper's equations run
segment by segment in an explicit loop, exact retrieval under the delta rule with orthonormal keys, the gate's
extremes, the memory algebra against infini-transformer-pytorch's, causality across segments, a decode state
of constant size equal to the full forward (with rollback), and bad input named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder, Encoder, TransformerWrapper
from polyformer.attention.kernels import infini_core as core
from polyformer.attention.kernels.infini import Infini, InfiniOptions
from polyformer.interfaces import KV, KernelSpec
from tests.helpers import ids, tiny_lm

H, HK, D, DV = 4, 2, 8, 6


def kernel(segment: int = 4, delta: bool = False, gate: float | None = None, heads: int = H,
           kv_heads: int = HK) -> Infini:
    spec = KernelSpec(heads=heads, kv_heads=kv_heads, dim_qk=D, dim_v=DV, causal=True, layer=0, scale=D ** -0.5,
                      options=InfiniOptions(segment=segment, delta=delta))
    k = Infini(spec).double().eval()
    with torch.no_grad():
        k.gate.copy_(torch.linspace(-1.5, 1.5, heads) if gate is None else torch.full((heads,), gate))
    return k


def inputs(n: int, b: int = 2, free: int = 0, seed: int = 0, h: int = H, hk: int = HK):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, n + free, D, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, n + free, DV, generator=g, dtype=torch.float64)
    return q, k, v


def reference(q, k, v, pos, keep, gate, N, delta, free=0):
    """The paper's equations 3-10, one row, one head and one segment at a time (float64)."""
    b, h, n, _ = q.shape
    out = torch.zeros(b, h, n, DV, dtype=q.dtype)
    pos = pos.expand(b, n)
    keep = torch.ones(b, n, dtype=torch.bool) if keep is None else keep
    for row in range(b):
        for head in range(h):
            kh = head // (h // k.shape[1])
            pk, pv = k[row, kh, :free], v[row, kh, :free]
            M, z = torch.zeros(D, DV, dtype=q.dtype), torch.zeros(D, dtype=q.dtype)
            idx = keep[row].nonzero()[:, 0]
            segs = pos[row, idx] // N
            for s in segs.unique().tolist():
                t = idx[segs == s]
                Q, K, V = q[row, head, t], k[row, kh, free + t], v[row, kh, free + t]
                scores = Q @ torch.cat((pk, K)).T * D ** -0.5
                seen = torch.cat((torch.ones(len(t), free, dtype=torch.bool),
                                  pos[row, t][None, :] <= pos[row, t][:, None]), 1)
                local = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ torch.cat((pv, V))
                sq, sk = F.elu(Q) + 1, F.elu(K) + 1
                mem = (sq @ M) / (sq @ z)[:, None].clamp(min=1e-10)
                g = torch.sigmoid(gate[head])
                out[row, head, t] = g * mem + (1 - g) * local
                if delta:
                    M = M + sk.T @ (V - (sk @ M) / (sk @ z)[:, None].clamp(min=1e-10))
                else:
                    M = M + sk.T @ V
                z = z + sk.sum(0)
    return out


def run(kern, q, k, v, pos, keep=None, free=0):
    kv = KV(k, v, pos, keep, free)
    return kern(q, kv, q_pos=pos, causal=True, memory=None, need_weights=False).out


@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("n, segment, start", [(13, 4, 0), (12, 3, 0), (11, 4, 6), (5, 8, 0)])
def test_equals_the_explicit_segment_loop(delta, n, segment, start):
    kern = kernel(segment, delta)
    q, k, v = inputs(n)
    pos = torch.arange(start, start + n)[None]
    assert_close(run(kern, q, k, v, pos), reference(q, k, v, pos, None, kern.gate, segment, delta))


@pytest.mark.parametrize("delta", [False, True])
def test_padding_and_row_positions_and_memory_keys_equal_the_loop(delta):
    kern = kernel(4, delta)
    q, k, v = inputs(14, free=2)
    keep = torch.ones(2, 14, dtype=torch.bool)
    keep[0, :5] = False                                          # left padding, positions from the first kept
    keep[1, [3, 9]] = False                                      # holes
    pos = torch.stack(((keep[0].long().cumsum(0) - 1).clamp(min=0), torch.arange(14)))
    out = run(kern, q, k, v, pos, keep, free=2)
    ref = reference(q, k, v, pos, keep, kern.gate, 4, delta, free=2)
    assert_close(out, ref)
    assert (out[~keep[:, None, :].expand(-1, H, -1)] == 0).all()


def orthonormal_keys(n: int) -> torch.Tensor:
    """Keys whose σ(k) = elu(k) + 1 are the unit vectors e_0 .. e_(n-1): 0 at their index, -1e4 elsewhere."""
    k = torch.full((n, D), -1e4, dtype=torch.float64)
    k[torch.arange(n), torch.arange(n)] = 0.0
    return k


@pytest.mark.parametrize("delta", [False, True])
def test_orthonormal_keys_retrieve_their_values_exactly_from_memory(delta):
    # segment 0 stores (e_i, v_i); at gate +inf segment 1's queries e_j read the memory alone: exactly v_j
    kern = kernel(4, delta, gate=100.0, heads=1, kv_heads=1)
    keys = orthonormal_keys(4)
    values = torch.randn(4, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q = torch.cat((torch.randn(4, D, dtype=torch.float64), keys[[2, 0, 3, 1]]))[None, None]
    k = torch.cat((keys, torch.randn(4, D, dtype=torch.float64)))[None, None]
    v = torch.cat((values, torch.randn(4, DV, dtype=torch.float64)))[None, None]
    out = run(kern, q, k, v, torch.arange(8)[None])
    assert_close(out[0, 0, 4:], values[[2, 0, 3, 1]], rtol=0, atol=1e-12)
    assert (out[0, 0, :4] == 0).all()                             # nothing stored before segment 0


def test_the_delta_rule_overwrites_an_association_the_linear_rule_adds_to():
    keys = orthonormal_keys(4)
    sk = (F.elu(keys) + 1)[None, None]                            # (1, 1, N, d) = e_0 .. e_3
    g = torch.Generator().manual_seed(2)
    old, new = torch.randn(4, DV, dtype=torch.float64, generator=g), torch.randn(4, DV, dtype=torch.float64, generator=g)
    sks = torch.stack((sk, sk, sk), 2)                            # three segments over the same keys
    vs = torch.stack((old, new, new))[None, None]
    start = (torch.zeros(1, 1, D, DV, dtype=torch.float64), torch.zeros(1, 1, D, dtype=torch.float64))
    M_delta, z_delta = core.memories(sks, vs, start, delta=True)
    M_linear, _ = core.memories(sks, vs, start, delta=False)
    # before segment 2 the delta memory holds exactly the new values, the linear one their sum with the old
    assert_close(sk[0, 0] @ M_delta[0, 0, 2], new, rtol=0, atol=1e-12)
    assert_close(sk[0, 0] @ M_linear[0, 0, 2], old + new, rtol=0, atol=1e-12)
    # storing a value the memory already retrieves changes nothing but the normaliser
    assert_close(M_delta[0, 0, 2], M_delta[0, 0, 1] + sk[0, 0].T @ (new - old), rtol=0, atol=1e-12)
    assert_close(z_delta[0, 0, 2], 2 * sk[0, 0].sum(0))


@pytest.mark.parametrize("delta", [False, True])
def test_memory_algebra_equals_infini_transformer_pytorch(delta):
    ref = pytest.importorskip("infini_transformer_pytorch.infini_transformer")
    fast = ref.FastweightMemory(heads=HK, use_mem_delta_rule=delta)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, HK, 3, 4, D, generator=g), torch.randn(2, HK, 3, 4, DV, generator=g)
    memories, expected = None, []
    for s in range(3):
        memories = fast.create_new_memories(k[:, :, s], v[:, :, s], memories)
        expected.append(memories)
    start = (torch.zeros(2, HK, D, DV), torch.zeros(2, HK, D))
    M, z = core.memories(F.elu(k) + 1, v, start, delta)
    for s in (1, 2):                                             # ours: the memory before segment s
        assert_close(M[:, :, s], expected[s - 1].kv_mem, rtol=1e-5, atol=1e-5)
        assert_close(z[:, :, s], expected[s - 1].k_norm, rtol=1e-5, atol=1e-5)
    q = torch.randn(2, HK, 5, D, generator=g)
    assert_close(core.retrieve(F.elu(q) + 1, M[:, :, 2], z[:, :, 2]),
                 ref.retrieve_from_kv_memories(F.elu(q) + 1, expected[1]), rtol=1e-5, atol=1e-5)


def test_gate_extremes_give_memory_only_or_segment_local_softmax_attention():
    q, k, v = inputs(13)
    pos = torch.arange(13)[None]
    memory_only = run(kernel(4, gate=100.0), q, k, v, pos)
    assert_close(memory_only, reference(q, k, v, pos, None, torch.full((H,), 100.0), 4, False))
    # -inf: softmax attention under a causal, segment-diagonal mask, written densely
    local = run(kernel(4, gate=-100.0), q, k, v, pos)
    seg = pos[0] // 4
    seen = (pos[0][None, :] <= pos[0][:, None]) & (seg[None, :] == seg[:, None])
    kk, vv = k.repeat_interleave(H // HK, 1), v.repeat_interleave(H // HK, 1)
    dense = ((q @ kk.transpose(-1, -2)) * D ** -0.5).masked_fill(~seen, float("-inf")).softmax(-1) @ vv
    assert_close(local, dense)
    assert not torch.allclose(memory_only, local)


def test_causal_and_the_memory_carries_the_past_across_segments():
    kern = kernel(4, delta=True)
    q, k, v = inputs(13)
    pos = torch.arange(13)[None]
    out = run(kern, q, k, v, pos)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6] += 1.0
    v2[:, :, 6] -= 1.0
    changed = run(kern, q, k2, v2, pos)
    assert_close(changed[:, :, :6], out[:, :, :6])                # nothing before the change moves
    assert not torch.allclose(changed[:, :, 8:], out[:, :, 8:])   # later segments read it through the memory


def test_decode_state_has_a_constant_size_and_equals_the_full_forward():
    torch.manual_seed(0)
    net = tiny_lm(max_seq_len=256, attn_infini=True, attn_infini_segment=4, attn_infini_delta=True, attn_kv_heads=2)
    x = ids(2, 120)
    full = net(x)
    state = net.new_state(2, 120)
    assert state.k.numel() == 0 and state.kinds == ("recurrent", "recurrent")
    chunks = [net(x[:, :3], state=state)]                        # inside the first segment
    sizes = [sum(m.nbytes() for m in state.recurrent_layers.values())]
    for t in range(3, 60):
        chunks.append(net(x[:, t:t + 1], state=state))
        sizes.append(sum(m.nbytes() for m in state.recurrent_layers.values()))
    chunks.append(net(x[:, 60:], state=state))                   # fifteen segments at once
    sizes.append(sum(m.nbytes() for m in state.recurrent_layers.values()))
    assert len(set(sizes)) == 1
    summary = state.recurrent_layers[0].summary
    assert summary["k"].shape[:3] == (2, 2, 4) and summary["M"].shape[:2] == (2, 2)     # N keys per kv head
    assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)


def test_rollback_within_the_history_equals_the_shorter_prefix():
    torch.manual_seed(0)
    net = tiny_lm(attn_infini=True, attn_infini_segment=3)
    x = ids(2, 12)
    state = net.new_state(2, 12, history=2)
    net(x[:, :7], state=state)
    net(x[:, 7:9], state=state)                                  # crosses into segment 2
    state.rollback(2)
    out = net(x[:, 7:10], state=state)
    assert_close(out, net(x[:, :10])[:, 7:], atol=1e-5, rtol=1e-5)


def test_bfloat16_follows_float32():
    torch.manual_seed(0)
    net = tiny_lm(attn_infini=True, attn_infini_segment=4)
    x = ids(2, 13)
    ref = net(x)
    low = net.to(torch.bfloat16)(x)
    assert low.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("keywords, error, match", [
    (dict(attn_infini=True, attn_infini_segment=None), ValueError, "attn_infini_segment must be"),
    (dict(attn_infini=True, attn_infini_segment=0), ValueError, "attn_infini_segment must be an integer >= 1"),
    (dict(attn_infini_segment=4), ValueError, "attn_infini_segment need.*attn_infini"),
    (dict(attn_infini=True, attn_infini_segment=4, attn_infini_delta="yes"), ValueError, "attn_infini_delta must"),
    (dict(attn_infini=True, attn_infini_segment=4, alibi_pos_emb=True), ValueError, "attn_infini cannot take"),
    (dict(attn_infini=True, attn_infini_segment=4, attn_linear="elu"), ValueError, "conflict"),
])
def test_bad_options_are_refused_by_name(keywords, error, match):
    with pytest.raises(error, match=match):
        Decoder(dim=32, depth=1, heads=4, **keywords)


def test_an_encoder_is_refused_and_return_attn_too():
    with pytest.raises(ValueError, match="attn_infini needs a causal stack"):
        Encoder(dim=32, depth=1, heads=4, attn_infini=True, attn_infini_segment=4)
    net = TransformerWrapper(num_tokens=16, max_seq_len=16,
                             attn_layers=Decoder(dim=32, depth=1, heads=4, attn_infini=True, attn_infini_segment=4))
    with pytest.raises(ValueError, match="return_attn cannot show attn_infini"):
        net(ids(1, 5, num_tokens=16), return_attn=True)
