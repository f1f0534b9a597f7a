"""The dense kernel, polyformer/attention/kernels/dense.py: the fused scaled_dot_product_attention
path equals the explicit reference path on every input the fused path accepts, at kernel level and
for whole models; the fused path is taken by default and avoided where it cannot be exact."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.attention.kernels import cpu
from polyformer.attention.kernels.dense import DenseKernel
from polyformer.attention.normalize import Softmax
from polyformer.interfaces import KV
from tests.helpers import ids, tiny_lm

B, H, I, D = 2, 4, 7, 8



def kernels(dropout: float = 0.0) -> tuple[DenseKernel, DenseKernel]:
    fused = DenseKernel(H, D ** -0.5, dropout, Softmax())
    reference = DenseKernel(H, D ** -0.5, dropout, Softmax(), fused=False)
    assert fused.can_fuse and not reference.can_fuse
    return fused, reference


def make_mask(kind: str, j: int) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(2)
    if kind == "none":
        return None
    if kind == "padding":                                      # (b, 1, 1, j), as the stack builds it
        keep = torch.ones(B, 1, 1, j, dtype=torch.bool)
        keep[1, ..., :2] = False
        return keep
    keep = torch.rand(B, 1, I, j, generator=g) > 0.3           # arbitrary (b, 1, i, j)
    keep[..., 0] = True
    return keep


def make_bias(kind: str, j: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    shape = (1, H, I, j) if kind == "shared" else (B, H, I, j)
    return torch.randn(shape)


MASKS = ["none", "padding", "full"]
BIASES = ["none", "shared", "batched"]


@pytest.mark.parametrize("mask_kind, bias_kind, causal", list(itertools.product(MASKS, BIASES, [False, True])))
@pytest.mark.parametrize("kv_heads, dv", [(H, D), (2, D), (1, D), (H, 12), (2, 5)])
def test_fused_equals_reference(mask_kind, bias_kind, causal, kv_heads, dv):
    fused, reference = kernels()
    j = I                                                      # causal is top-left: square
    q = torch.randn(B, H, I, D)
    kv = KV(k=torch.randn(B, kv_heads, j, D), v=torch.randn(B, kv_heads, j, dv), pos=None, mask=None)
    args = dict(mask=make_mask(mask_kind, j), bias=make_bias(bias_kind, j), causal=causal)
    out = fused(q, kv, **args).out
    assert_close(out, reference(q, kv, **args).out, atol=1e-5, rtol=1e-5)
    assert out.shape == (B, H, I, dv)


@pytest.mark.parametrize("bias_kind", ["none", "batched"])
def test_fused_equals_reference_with_more_keys_than_queries(bias_kind):
    """Non-causal, j != i (memory kv, XL memories, cross-attention)."""
    fused, reference = kernels()
    q = torch.randn(B, H, I, D)
    kv = KV(k=torch.randn(B, H, 11, D), v=torch.randn(B, H, 11, D), pos=None, mask=None)
    bias = torch.randn(B, H, I, 11) if bias_kind == "batched" else None
    mask = torch.rand(B, 1, I, 11) > 0.4
    for m in (None, mask):
        assert_close(fused(q, kv, mask=m, bias=bias, causal=False).out,
                     reference(q, kv, mask=m, bias=bias, causal=False).out, atol=1e-5, rtol=1e-5)


def test_explicit_reference_is_softmax_attention():
    """The reference itself against a by-hand computation: softmax(q k^T * scale + bias) v over the
    kept, causal keys."""
    _, reference = kernels()
    q, k, v = torch.randn(B, H, I, D), torch.randn(B, H, I, D), torch.randn(B, H, I, D)
    bias, mask = make_bias("batched", I), make_mask("full", I)
    out = reference(q, KV(k, v, None, None), mask=mask, bias=bias, causal=True).out
    keep = mask & torch.ones(I, I, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) * D ** -0.5 + bias
    expected = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v
    assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias_kind", ["none", "batched"])
@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_give_zeros_and_finite_grads(bias_kind, causal):
    fused, reference = kernels()
    mask = make_mask("full", I)
    mask[0, :, 2] = False                                      # query 2 of batch 0 sees nothing
    mask[1, :, 5] = False
    bias = make_bias(bias_kind, I)
    q0, k0, v0 = torch.randn(B, H, I, D), torch.randn(B, H, I, D), torch.randn(B, H, I, D)
    results = []
    for kernel in (fused, reference):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        bias_g = bias.clone().requires_grad_() if bias is not None else None
        out = kernel(q, KV(k, v, None, None), mask=mask, bias=bias_g, causal=causal).out
        assert torch.equal(out[0, :, 2], torch.zeros(H, D))
        assert torch.equal(out[1, :, 5], torch.zeros(H, D))
        out.pow(2).sum().backward()
        grads = [q.grad, k.grad, v.grad] + ([bias_g.grad] if bias_g is not None else [])
        assert all(torch.isfinite(g).all() for g in grads)
        results.append((out, grads))
    (out_f, grads_f), (out_r, grads_r) = results
    assert_close(out_f, out_r, atol=1e-5, rtol=1e-5)
    for gf, gr in zip(grads_f, grads_r):
        assert_close(gf, gr, atol=1e-5, rtol=1e-5)


def test_gradients_agree():
    fused, reference = kernels()
    q0, k0, v0 = torch.randn(B, H, I, D), torch.randn(B, 2, I, D), torch.randn(B, 2, I, D)
    bias0, mask = torch.randn(1, H, I, I), make_mask("padding", I)
    grads = []
    for kernel in (fused, reference):
        q, k, v, bias = (t.clone().requires_grad_() for t in (q0, k0, v0, bias0))
        kernel(q, KV(k, v, None, None), mask=mask, bias=bias, causal=True).out.sum().backward()
        grads.append([q.grad, k.grad, v.grad, bias.grad])
    for gf, gr in zip(*grads):
        assert_close(gf, gr, atol=1e-5, rtol=1e-5)


def test_training_mode_with_zero_dropout_agrees():
    fused, reference = kernels(dropout=0.0)
    fused.train(), reference.train()
    q, k, v = torch.randn(B, H, I, D), torch.randn(B, H, I, D), torch.randn(B, H, I, D)
    args = dict(mask=make_mask("padding", I), bias=make_bias("shared", I), causal=True)
    assert_close(fused(q, KV(k, v, None, None), **args).out,
                 reference(q, KV(k, v, None, None), **args).out, atol=1e-5, rtol=1e-5)


def count_sdpa(monkeypatch) -> list[int]:
    """Counts calls of either fused path: scaled_dot_product_attention and, where autograd records
    a float32 CPU call without mask or bias, our compiled kernel."""
    calls = [0]

    def counted(real):
        def counting(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)
        return counting

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        counted(F.scaled_dot_product_attention))
    monkeypatch.setattr(cpu, "attention", counted(cpu.attention))
    return calls


def test_kernel_fused_path_calls_sdpa(monkeypatch):
    calls = count_sdpa(monkeypatch)
    fused, reference = kernels()
    q, k, v = torch.randn(B, H, I, D), torch.randn(B, H, I, D), torch.randn(B, H, I, D)
    fused(q, KV(k, v, None, None), mask=None, bias=None, causal=True)
    assert calls[0] == 1
    reference(q, KV(k, v, None, None), mask=None, bias=None, causal=True)
    fused(q, KV(k, v, None, None), mask=None, bias=None, causal=True, need_weights=True)
    fused(q, KV(k, v, None, None), mask=None, bias=None, causal=True, prev_scores=torch.zeros(B, H, I, I))
    assert calls[0] == 1


# --- whole models: attn_flash=True and attn_flash=False give the same logits ---------------------

OPTIONS = {
    "default": {},
    "rotary": dict(rotary_pos_emb=True),
    "rotary_partial_interleaved": dict(rotary_pos_emb=True, rotary_emb_dim=4, rotary_interleaved=True),
    "alibi": dict(alibi_pos_emb=True),
    "alibi_num_heads": dict(alibi_pos_emb=True, alibi_num_heads=2),
    "rel_pos_bias": dict(rel_pos_bias=True),
    "mem_kv": dict(attn_num_mem_kv=3),
    "mem_kv_alibi": dict(attn_num_mem_kv=3, alibi_pos_emb=True),
    "mem_kv_rel_pos": dict(attn_num_mem_kv=3, rel_pos_bias=True),
    "kv_heads": dict(attn_kv_heads=2),
    "one_kv_head": dict(attn_one_kv_head=True),
    "collab_heads": dict(attn_collab_heads=True, attn_collab_compression=0.3),
    "gate_values": dict(gate_values=True),
    "attn_on_attn": dict(attn_on_attn=True),
    "position_infused": dict(position_infused_attn=True),
    "memory_tokens": dict(num_memory_tokens=3),
    "memory_tokens_rotary": dict(num_memory_tokens=2, rotary_pos_emb=True),
}


def padding_mask(x: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, -3:] = False                                       # right padding
    mask[1, :4] = False                                        # left padding: fully masked rows in a decoder
    return mask


def flash_pair(stack: str, options: dict):
    cls = Decoder if stack == "decoder" else Encoder
    fast = tiny_lm(cls, attn_dim_head=8, attn_flash=True, **options)
    slow = tiny_lm(cls, attn_dim_head=8, attn_flash=False, **options)
    slow.load_state_dict(fast.state_dict())
    return fast, slow


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("stack", ["decoder", "encoder"])
@pytest.mark.parametrize("option", OPTIONS)
def test_flash_and_reference_models_agree(option, stack, masked):
    fast, slow = flash_pair(stack, OPTIONS[option])
    x = ids(n=12)
    mask = padding_mask(x) if masked else None
    out_fast = fast(x, mask=mask)
    assert torch.isfinite(out_fast).all()
    assert_close(out_fast, slow(x, mask=mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_flash_and_reference_agree_with_cross_attention(masked):
    fast = tiny_lm(attn_dim_head=8, cross_attend=True, rotary_pos_emb=True, attn_flash=True)
    slow = tiny_lm(attn_dim_head=8, cross_attend=True, rotary_pos_emb=True, attn_flash=False)
    slow.load_state_dict(fast.state_dict())
    x, context = ids(n=10), torch.randn(2, 7, 32)
    context_mask = torch.ones(2, 7, dtype=torch.bool)
    context_mask[1, 4:] = False
    kwargs = dict(mask=padding_mask(x), context=context, context_mask=context_mask) if masked \
        else dict(context=context)
    assert_close(fast(x, **kwargs), slow(x, **kwargs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("option", ["default", "rotary", "alibi", "rel_pos_bias", "mem_kv", "kv_heads",
                                    "collab_heads", "position_infused", "memory_tokens"])
def test_default_model_takes_the_fused_path(option, monkeypatch):
    model = tiny_lm(attn_dim_head=8, **OPTIONS[option])

    def refuse(*args, **kwargs):
        raise AssertionError("the reference path was taken")

    calls = count_sdpa(monkeypatch)
    monkeypatch.setattr(DenseKernel, "reference", refuse)
    x = ids()
    model(x)
    model(x, mask=padding_mask(x))
    assert calls[0] == 2 * 2                                   # depth 2, two forwards


@pytest.mark.parametrize("options", [dict(attn_talking_heads=True), dict(attn_sparse_topk=3),
                                     dict(residual_attn=True), dict(attn_use_entmax15=True)],
                         ids=["talking_heads", "topk", "residual_attn", "entmax15"])
def test_options_the_fused_path_cannot_express_avoid_it(options, monkeypatch):
    model = tiny_lm(attn_dim_head=8, **options)
    calls = count_sdpa(monkeypatch)
    x = ids()
    model(x, mask=padding_mask(x))
    assert calls[0] == 0
    with pytest.raises(ValueError, match="attn_flash"):
        Decoder(dim=32, depth=1, heads=4, attn_flash=True, **options)


def test_return_attn_takes_the_reference_path_and_agrees(monkeypatch):
    model = tiny_lm(attn_dim_head=8, rel_pos_bias=True)
    x = ids()
    expected = model(x, mask=padding_mask(x))
    calls = count_sdpa(monkeypatch)
    logits, maps = model(x, mask=padding_mask(x), return_attn=True)
    assert calls[0] == 0
    assert len(maps) == 2
    assert_close(logits, expected, atol=1e-5, rtol=1e-5)
