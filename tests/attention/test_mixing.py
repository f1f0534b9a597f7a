"""Stages around the kernel and the projection: talking heads (arXiv:2003.02436), value gating
(AlphaFold2), attention-on-attention (arXiv:1908.06954), collaborative heads (arXiv:2006.16362),
kv-heads (MQA arXiv:1911.02150 / GQA arXiv:2305.13245), persistent memory kv (arXiv:1907.01470).
polyformer/attention/mixing.py, projection.py, keys.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.attention.kernels.dense import DenseKernel
from polyformer.attention.mixing import Output, TalkingHeads
from polyformer.attention.normalize import Softmax
from polyformer.interfaces import KV
from tests.helpers import ids, tiny_lm


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def attention_blocks(model):
    return [b.branch for b in model.attn_layers.blocks if b.kind == "a"]


# --- talking heads --------------------------------------------------------------------------------

def test_talking_heads_mix_is_einsum_over_heads():
    th = TalkingHeads(4)
    with torch.no_grad():
        th.weight.copy_(torch.randn(4, 4))
    maps = torch.randn(2, 4, 5, 6)
    expected = torch.zeros_like(maps)
    for k in range(4):
        for h in range(4):
            expected[:, k] += maps[:, h] * th.weight[h, k]
    assert_close(th(maps), expected)


def test_talking_heads_identity_init_is_no_mixing():
    maps = torch.randn(2, 4, 5, 6)
    assert torch.equal(TalkingHeads(4)(maps), maps)
    kernel_mixed = DenseKernel(4, 0.25, 0.0, Softmax(), pre_mix=TalkingHeads(4), post_mix=TalkingHeads(4))
    kernel_plain = DenseKernel(4, 0.25, 0.0, Softmax(), fused=False)
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 16)
    mask = torch.rand(2, 1, 5, 6) > 0.3
    a = kernel_mixed(q, KV(k, v, None, None), mask=mask, bias=None, causal=False)
    b = kernel_plain(q, KV(k, v, None, None), mask=mask, bias=None, causal=False)
    assert_close(a.out, b.out)


def test_talking_heads_model_at_init_equals_plain_model():
    plain = tiny_lm()
    talking = tiny_lm(attn_talking_heads=True)
    missing, unexpected = talking.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("mix" in name for name in missing)
    x = ids()
    assert_close(talking(x), plain(x), atol=1e-5, rtol=1e-5)


def permutation(perm: list[int]) -> torch.Tensor:
    """W with W[h, perm[h]] = 1, so (maps W)[:, perm[h]] = maps[:, h]."""
    w = torch.zeros(len(perm), len(perm))
    w[torch.arange(len(perm)), torch.tensor(perm)] = 1.0
    return w


def test_talking_heads_permutation_permutes_maps():
    perm = [2, 0, 3, 1]
    th = TalkingHeads(4)
    with torch.no_grad():
        th.weight.copy_(permutation(perm))
    maps = torch.randn(2, 4, 5, 6)
    out = th(maps)
    for h in range(4):
        assert torch.equal(out[:, perm[h]], maps[:, h])


def test_talking_heads_permutation_in_a_model():
    """pre-softmax mix P: head perm[h] attends with head h's scores. Post-softmax mix P^T undoes
    it exactly, giving the plain model back."""
    perm = [2, 0, 3, 1]
    plain = tiny_lm(depth=1)
    talking = tiny_lm(depth=1, attn_talking_heads=True)
    talking.load_state_dict(plain.state_dict(), strict=False)
    kernel = attention_blocks(talking)[0].kernel
    with torch.no_grad():
        kernel.pre_mix.weight.copy_(permutation(perm))
    x = ids()
    _, plain_maps = plain(x, return_attn=True)
    _, maps = talking(x, return_attn=True)
    for h in range(4):
        assert_close(maps[0][:, perm[h]], plain_maps[0][:, h])
    with torch.no_grad():
        kernel.post_mix.weight.copy_(permutation(perm).t())
    logits, maps = talking(x, return_attn=True)
    assert_close(maps[0], plain_maps[0])
    assert_close(logits, plain(x), atol=1e-5, rtol=1e-5)


# --- value gating and attention-on-attention ------------------------------------------------------

def merged(out: torch.Tensor) -> torch.Tensor:
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


def test_gate_values_init_multiplies_by_sigmoid_one():
    gated = Output(32, 4, 8, gate_values=True, on_attn=False)
    plain = Output(32, 4, 8, gate_values=False, on_attn=False)
    plain.load_state_dict(gated.state_dict(), strict=False)
    out, x = torch.randn(2, 4, 5, 8), torch.randn(2, 5, 32)
    assert torch.equal(gated.gate.weight, torch.zeros_like(gated.gate.weight))
    assert_close(gated(out, x), torch.sigmoid(torch.tensor(1.0)) * plain(out, x))
    assert_close(gated(out, x), plain.proj(merged(out) * torch.sigmoid(torch.tensor(1.0))))


def test_gate_values_is_sigmoid_of_input_projection():
    gated = Output(32, 4, 8, gate_values=True, on_attn=False)
    with torch.no_grad():
        gated.gate.weight.normal_()
        gated.gate.bias.normal_()
    out, x = torch.randn(2, 4, 5, 8), torch.randn(2, 5, 32)
    gate = torch.sigmoid(x @ gated.gate.weight.t() + gated.gate.bias)            # (b, n, h*d)
    assert_close(gated(out, x), (merged(out) * gate) @ gated.proj.weight.t())


@pytest.mark.parametrize("keyword", ["gate_values", "attn_gate_values"])
def test_gated_model_at_init_equals_plain_model_with_scaled_output(keyword):
    """At init the gate is sigmoid(1) everywhere: a plain model whose output projections are scaled
    by sigmoid(1) gives the same logits."""
    gated = tiny_lm(**{keyword: True})
    plain = tiny_lm()
    plain.load_state_dict(gated.state_dict(), strict=False)
    with torch.no_grad():
        for attn in attention_blocks(plain):
            attn.output.proj.weight.mul_(torch.sigmoid(torch.tensor(1.0)))
    x = ids()
    assert_close(gated(x), plain(x), atol=1e-5, rtol=1e-5)


def test_attn_on_attn_is_a_glu_on_merged_heads():
    aoa = Output(32, 4, 8, gate_values=False, on_attn=True)
    out, x = torch.randn(2, 4, 5, 8), torch.randn(2, 5, 32)
    y = merged(out) @ aoa.proj.weight.t() + aoa.proj.bias                        # (b, n, 2 dim)
    value, gate = y[..., :32], y[..., 32:]
    assert_close(aoa(out, x), value * torch.sigmoid(gate))


def test_attn_on_attn_in_a_model_gates_every_attention_block():
    model = tiny_lm(depth=1, attn_on_attn=True)
    attn = attention_blocks(model)[0]
    seen = {}
    attn.output.register_forward_hook(lambda m, inp, out: seen.update(inp=inp, out=out))
    model(ids())
    out, x = seen["inp"]
    y = merged(out) @ attn.output.proj.weight.t() + attn.output.proj.bias
    assert_close(seen["out"], y[..., :32] * torch.sigmoid(y[..., 32:]))


# --- collaborative heads -------------------------------------------------------------------------

def test_collab_heads_have_fewer_parameters():
    plain = Decoder(dim=32, depth=2, heads=4, attn_dim_head=8)
    collab = Decoder(dim=32, depth=2, heads=4, attn_dim_head=8, attn_collab_heads=True,
                     attn_collab_compression=0.3)
    shared = 8                              # 0.3 * heads * dim_head = 9.6 -> 8 (even) shared features
    # per layer: q and k go from heads * dim_head = 32 outputs each to `shared`, plus heads x shared mixing
    assert count(plain) - count(collab) == 2 * (2 * (32 - shared) * 32 - 4 * shared)
    assert count(collab) < count(plain)


def test_collab_head_scores_are_mixed_shared_projections():
    """score_h(i, j) = ((x_i W_q) * m_h) . (x_j W_k) / sqrt(shared)."""
    model = tiny_lm(Encoder, depth=1, attn_dim_head=8, attn_collab_heads=True, attn_collab_compression=0.3,
                    use_abs_pos_emb=False)
    attn = attention_blocks(model)[0]
    proj = attn.project
    with torch.no_grad():
        proj.mixing.normal_()                                  # distinct heads
    x = ids(n=10)
    _, maps = model(x, return_attn=True)
    h_in = model.attn_layers.blocks[0].norm_in(model.token_emb(x))
    shared = proj.mixing.shape[1]
    w_q, w_k, _ = proj.to_qkv.weight.split(proj.split, dim=0)
    assert w_q.shape[0] == shared == 8
    xq, xk = h_in @ w_q.t(), h_in @ w_k.t()                   # (b, n, shared)
    for h in range(4):
        scores = (xq * proj.mixing[h]) @ xk.transpose(-1, -2) * shared ** -0.5
        assert_close(maps[0][:, h], scores.softmax(-1), atol=1e-5, rtol=1e-5)
    # heads with equal mixing vectors attend identically
    with torch.no_grad():
        proj.mixing[1] = proj.mixing[0]
    _, maps = model(x, return_attn=True)
    assert_close(maps[0][:, 1], maps[0][:, 0])


# --- kv heads --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_heads", [1, 2])
def test_kv_heads_have_fewer_parameters(kv_heads):
    plain = Decoder(dim=32, depth=2, heads=4, attn_dim_head=8)
    gqa = Decoder(dim=32, depth=2, heads=4, attn_dim_head=8, attn_kv_heads=kv_heads)
    # per layer: k and v lose (heads - kv_heads) * dim_head outputs each
    assert count(plain) - count(gqa) == 2 * 2 * (4 - kv_heads) * 8 * 32


def expand_gqa_state(state: dict, heads: int, kv_heads: int, d: int) -> dict:
    """A plain-heads state dict whose k / v weights (and memory kv) repeat each kv head for the
    heads // kv_heads query heads of its group."""
    g = heads // kv_heads
    out = {}
    for name, t in state.items():
        if name.endswith("project.to_qkv.weight"):
            q, k, v = t.split((heads * d, kv_heads * d, kv_heads * d), dim=0)
            k = k.unflatten(0, (kv_heads, d)).repeat_interleave(g, dim=0).flatten(0, 1)
            v = v.unflatten(0, (kv_heads, d)).repeat_interleave(g, dim=0).flatten(0, 1)
            t = torch.cat((q, k, v), dim=0)
        elif name.endswith("memory_kv.k") or name.endswith("memory_kv.v"):
            t = t.repeat_interleave(g, dim=0)
        out[name] = t
    return out


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("extra", [{}, {"attn_num_mem_kv": 2}, {"rotary_pos_emb": True},
                                   {"position_infused_attn": True}, {"alibi_pos_emb": True}],
                         ids=["plain", "mem_kv", "rotary", "infused", "alibi"])
def test_kv_heads_equal_plain_heads_with_repeated_weights(kv_heads, extra):
    gqa = tiny_lm(attn_dim_head=8, attn_kv_heads=kv_heads, **extra)
    plain = tiny_lm(attn_dim_head=8, **extra)
    plain.load_state_dict(expand_gqa_state(gqa.state_dict(), 4, kv_heads, 8))
    x = ids()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, :4] = False
    assert_close(gqa(x), plain(x), atol=1e-5, rtol=1e-5)
    assert_close(gqa(x, mask=mask), plain(x, mask=mask), atol=1e-5, rtol=1e-5)
    # the grouping matters: query heads 1 and 2 (different groups) trading keys changes the model
    if kv_heads == 2:
        swapped = expand_gqa_state(gqa.state_dict(), 4, kv_heads, 8)
        name = next(n for n in swapped if n.endswith("project.to_qkv.weight"))
        w = swapped[name]
        k = w[32:64].clone()
        w[32:64] = torch.cat((k[0:8], k[16:24], k[8:16], k[24:32]))
        plain.load_state_dict(swapped)
        assert not torch.allclose(gqa(x), plain(x), atol=1e-4)


# --- persistent memory key / values ---------------------------------------------------------------

def test_memory_kv_visible_to_every_query_of_a_decoder():
    model = tiny_lm(attn_num_mem_kv=4)
    _, maps = model(ids(n=10), return_attn=True)
    for a in maps:
        assert a.shape[-1] == 4 + 10
        assert (a[..., :4] > 0).all()                          # query 0 included
        assert (a[..., 0, :4].sum(-1) > 0).all()
        assert (a[..., 4:].triu(1) == 0).all()                 # real keys stay causal
        assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))


@pytest.mark.parametrize("stack", ["decoder", "encoder"])
def test_padding_never_hides_memory_kv(stack):
    model = tiny_lm(Decoder if stack == "decoder" else Encoder, attn_num_mem_kv=4)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 6:] = False
    mask[1, :3] = False
    _, maps = model(ids(n=10), mask=mask, return_attn=True)
    for a in maps:
        assert (a[..., :4] > 0).all()                          # memory seen by every query
        real = a[..., 4:]
        assert (real[0, ..., 6:] == 0).all() and (real[1, ..., :3] == 0).all()
        # rows whose real keys are all masked (decoder, batch 1, queries 0..2) sit on memory alone
        assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))
    if stack == "decoder":
        assert_close(maps[0][1, :, :3, :4].sum(-1), torch.ones(4, 3))


def test_memory_kv_values_are_averaged_into_the_output():
    """A decoder query that can see only memory keys outputs the memory values' weighted mean."""
    model = tiny_lm(depth=1, attn_num_mem_kv=4, attn_dim_head=8)
    attn = attention_blocks(model)[0]
    seen = {}
    attn.output.register_forward_hook(lambda m, inp, out: seen.update(inp=inp))
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[0, 0] = False                                         # query 0 sees only the memory
    _, maps = model(ids(batch=1, n=6), mask=mask, return_attn=True)
    out = seen["inp"][0]                                       # (b, h, n, d) before the output stage
    expected = torch.einsum("hm,hmd->hd", maps[0][0, :, 0, :4], attn.memory_kv.v)
    assert_close(out[0, :, 0], expected, atol=1e-5, rtol=1e-5)
