"""Numerics (issue 7): bf16 / fp16 autocast forward and backward stay finite on long sequences and with
large logits; masking uses the dtype's own minimum; softmax, scores and norms run in float32; fully
masked rows, contexts of length zero and batches of one work."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import (AutoregressiveWrapper, ContinuousTransformerWrapper, CrossAttender, Decoder, Encoder,
                        TransformerWrapper, ViTransformerWrapper, XTransformer)
from polyformer.attention.normalize import Entmax15, Softmax, TopK, fill_masked
from polyformer.norm import LayerNorm, RMSNorm, ScaleNorm
from tests.helpers import ids, tiny_lm
from tests.options import perturb

HALF = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]

# the configurations the issue names; "masked" is the plain stack under a padding mask
CONFIGS = {
    "plain": {},
    "rotary": dict(rotary_pos_emb=True),
    "alibi": dict(alibi_pos_emb=True),
    "t5": dict(rel_pos_bias=True),
    "mem_kv": dict(attn_num_mem_kv=4),
    "masked": {},
    "reference_path": dict(attn_talking_heads=True, residual_attn=True),
}


def lm(stack=Decoder, max_seq_len: int = 512, depth: int = 1, **keywords) -> TransformerWrapper:
    """`tiny_lm` with seed 0, one block and room for long sequences (callers set the mode)."""
    return tiny_lm(stack, max_seq_len=max_seq_len, depth=depth, seed=0, **keywords)


def padding(b: int, n: int) -> torch.Tensor:
    """Row 0 left-padded by a quarter, row 1 fully masked, the rest kept."""
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, : n // 4] = False
    if b > 1:
        mask[1] = False
    return mask


def assert_finite_step(model: torch.nn.Module, out: torch.Tensor) -> None:
    assert torch.isfinite(out).all(), "non-finite output"
    out.float().square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{name}: non-finite gradient"


# ---------------------------------------------------------------------------------------------
# long sequences and large logits under autocast


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_autocast_long_sequence_with_large_logits_is_finite(name, dtype):
    model = lm(**CONFIGS[name]).train()
    with torch.no_grad():
        model.token_emb.weight.mul_(100)               # large activations and logits
    n = 512
    x = ids(2, n, seed=0)
    mask = padding(2, n) if name == "masked" else None
    with torch.autocast("cpu", dtype=dtype):
        logits = model(x, mask=mask)
        loss = F.cross_entropy(logits.transpose(1, 2).float(), x)
    assert logits.dtype == dtype
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{pname}: non-finite gradient"


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("options", [{}, dict(attn_flash=False), dict(attn_talking_heads=True),
                                     dict(attn_sparse_topk=3), dict(alibi_pos_emb=True, attn_flash=False)],
                         ids=["fused", "reference", "talking_heads", "topk", "alibi_reference"])
def test_attention_scores_beyond_the_half_range_stay_finite(options, dtype):
    """Regression: the reference path computed q.k in half precision, which overflows to inf (and the
    softmax to NaN) once |scores| pass 65504, where the fused kernel accumulates in float32."""
    model = lm(max_seq_len=64, attn_dim_head=8, **options).train()
    with torch.no_grad():
        model.attn_layers.blocks[0].branch.project.to_qkv.weight[:64].mul_(300)   # q and k rows: scores ~ 1e5
    x = ids(2, 64, seed=1)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    assert_finite_step(model, out)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_reference_path_agrees_with_the_fused_path_under_autocast(dtype):
    fused, reference = lm(max_seq_len=64).eval(), lm(max_seq_len=64, attn_flash=False).eval()
    reference.load_state_dict(fused.state_dict())
    x = ids(2, 64, seed=2)
    mask = padding(2, 64)
    with torch.autocast("cpu", dtype=dtype):
        a, b = fused(x, mask=mask), reference(x, mask=mask)
    assert_close(a.float(), b.float(), atol=0.1, rtol=0.05)


# ---------------------------------------------------------------------------------------------
# masking, softmax and norms in half precision


@pytest.mark.parametrize("dtype", HALF + [torch.float32], ids=HALF_IDS + ["fp32"])
def test_masking_fills_with_the_dtypes_own_minimum(dtype):
    scores = torch.randn(2, 2, 3, 5).to(dtype)
    mask = torch.rand(2, 1, 3, 5, generator=torch.Generator().manual_seed(0)) > 0.5
    filled = fill_masked(scores, mask)
    assert filled.dtype == dtype
    assert torch.isfinite(filled).all()
    assert (filled[~mask.expand_as(filled)] == torch.finfo(dtype).min).all()


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("normalize", [Softmax(), TopK(2), Entmax15()], ids=["softmax", "topk", "entmax15"])
def test_normalisers_in_half_precision_give_zero_rows_for_fully_masked_queries(normalize, dtype):
    scores = (torch.randn(1, 2, 4, 6) * 1e3).to(dtype)       # large scores: exp overflows without float32
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[..., 1, :] = False                                  # query 1 sees nothing
    mask[..., 2, :3] = False
    weights = normalize(scores, mask)
    assert weights.dtype == dtype and torch.isfinite(weights).all()
    assert (weights[:, :, 1] == 0).all()
    assert (weights[:, :, 2, :3] == 0).all()
    assert_close(weights[:, :, [0, 2, 3]].float().sum(-1), torch.ones(1, 2, 3), atol=1e-2, rtol=0)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("norm_cls", [LayerNorm, RMSNorm, ScaleNorm])
def test_norms_compute_in_float32_and_keep_the_dtype(norm_cls, dtype):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)) * 1e3    # squares overflow fp16
    norm = norm_cls(32)
    expected = norm(x)
    out = norm(x.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert_close(out.float(), expected, atol=0.05, rtol=0.02)
    half = norm_cls(32).to(dtype)                             # half parameters too (model.to(dtype))
    out = half(x.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("options", [{}, dict(rotary_pos_emb=True, attn_talking_heads=True, residual_attn=True),
                                     dict(use_rmsnorm=True, alibi_pos_emb=True), dict(use_scalenorm=True, rel_pos_bias=True)],
                         ids=["plain", "reference_path", "rms_alibi", "scale_t5"])
def test_a_model_converted_to_half_runs_and_generates(options, dtype):
    """Regression: LayerNorm computed in float32 but handed F.layer_norm half weights (model.to(bf16))."""
    model = lm(max_seq_len=32, depth=2, **options).to(dtype).eval()
    x = ids(2, 12, seed=0)
    logits = model(x, mask=padding(2, 12))
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    tokens = AutoregressiveWrapper(model).generate(x[:, :4], 4, temperature=0.0)
    assert tokens.shape == (2, 4)


# ---------------------------------------------------------------------------------------------
# fully masked rows


FULL_MASK_OPTIONS = {
    "fused": {}, "alibi_fused": dict(alibi_pos_emb=True), "t5_fused": dict(rel_pos_bias=True),
    "reference": dict(attn_flash=False), "talking_heads": dict(attn_talking_heads=True),
    "topk": dict(attn_sparse_topk=2), "entmax15": dict(attn_use_entmax15=True), "gqa": dict(attn_kv_heads=1),
    "shift_tokens": dict(shift_tokens=1),
}


@pytest.mark.parametrize("dtype", [torch.float32] + HALF, ids=["fp32"] + HALF_IDS)
@pytest.mark.parametrize("stack", [Decoder, Encoder], ids=["decoder", "encoder"])
@pytest.mark.parametrize("name", FULL_MASK_OPTIONS)
def test_fully_masked_rows_are_finite_and_see_nothing(name, stack, dtype):
    model = perturb(lm(stack, max_seq_len=16, depth=2, **FULL_MASK_OPTIONS[name])).train()
    x = ids(2, 10, seed=0)
    mask = padding(2, 10)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = model(x, mask=mask)
    assert_finite_step(model, out)
    model.eval()
    _, weights = model(x, mask=mask, return_attn=True)
    for w in weights:                                    # the fully masked row attends to no key
        assert (w[1] == 0).all()
    assert_close(model(x[:1], mask=mask[:1]), model(x, mask=mask)[:1])   # the neighbour row is unaffected


# ---------------------------------------------------------------------------------------------
# contexts of length zero


EMPTY_CONTEXT_OPTIONS = {
    "fused": {}, "reference": dict(attn_flash=False), "talking_heads": dict(attn_talking_heads=True),
    "topk": dict(attn_sparse_topk=2), "entmax15": dict(attn_use_entmax15=True),
    "collab_heads": dict(attn_collab_heads=True), "gqa": dict(attn_kv_heads=1),
    "cross_residual_attn": dict(cross_residual_attn=True), "mem_kv": dict(attn_num_mem_kv=2),
}


@pytest.mark.parametrize("name", EMPTY_CONTEXT_OPTIONS)
def test_an_empty_context_acts_as_a_fully_masked_one(name):
    """Regression: a (b, 0, dim) context crashed in the head split ('cannot reshape tensor of 0
    elements', projection.split_heads) and in entmax15 (max over an empty dimension). Cross-attention
    to no key gives a zero output, exactly as a context whose every position is masked."""
    keywords = EMPTY_CONTEXT_OPTIONS[name]
    model = perturb(lm(max_seq_len=16, depth=2, cross_attend=True, **keywords)).train()
    x = ids(2, 6, seed=0)
    empty = torch.randn(2, 0, 32)
    out = model(x, context=empty)
    assert_finite_step(model, out)
    model.eval()
    hidden = torch.randn(2, 3, 32)
    assert_close(model(x, context=empty),
                 model(x, context=hidden, context_mask=torch.zeros(2, 3, dtype=torch.bool)))
    assert_close(model(x, context=empty, context_mask=torch.zeros(2, 0, dtype=torch.bool)), model(x, context=empty))
    ar = AutoregressiveWrapper(model)                     # cached generation keeps the empty context keys
    cached = ar.generate(x[:, :3], 4, context=empty, temperature=0.0)
    assert torch.equal(cached, ar.generate(x[:, :3], 4, context=empty, temperature=0.0, cache_kv=False))


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_cross_attender_with_an_empty_context_under_autocast(dtype):
    torch.manual_seed(0)
    model = perturb(CrossAttender(dim=32, depth=2, heads=4))
    x = torch.randn(1, 4, 32)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x, context=torch.randn(1, 0, 32))
    assert_finite_step(model, out)


# ---------------------------------------------------------------------------------------------
# batches of one


def _token_decoder():
    return lm(max_seq_len=16, depth=2, rotary_pos_emb=True, attn_num_mem_kv=2, shift_tokens=1).eval()


def _token_encoder():
    return lm(Encoder, max_seq_len=16, depth=2, rel_pos_bias=True).eval()


def _continuous():
    torch.manual_seed(0)
    return ContinuousTransformerWrapper(dim_in=5, dim_out=3, max_seq_len=16,
                                        attn_layers=Decoder(dim=32, depth=2, heads=4, alibi_pos_emb=True)).eval()


@pytest.mark.parametrize("make, batch", [
    (_token_decoder, lambda b: (ids(b, 9, seed=0),)),
    (_token_encoder, lambda b: (ids(b, 9, seed=0),)),
    (_continuous, lambda b: (torch.randn(b, 9, 5, generator=torch.Generator().manual_seed(0)),)),
], ids=["decoder", "encoder", "continuous"])
def test_a_batch_of_one_equals_its_row_in_a_larger_batch(make, batch):
    model = make()
    (x,) = batch(3)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[0, :2] = False
    alone = model(x[:1], mask=mask[:1])
    assert alone.shape[0] == 1
    assert_close(alone, model(x, mask=mask)[:1])
    model.train()
    assert_finite_step(model, model(x[:1]))


def test_a_batch_of_one_generates_cached_as_uncached():
    ar = AutoregressiveWrapper(_token_decoder())
    prompt = ids(1, 3, seed=0)
    cached = ar.generate(prompt, 6, temperature=0.0)
    assert cached.shape == (1, 6)
    assert torch.equal(cached, ar.generate(prompt, 6, temperature=0.0, cache_kv=False))
    beams = ar.generate(prompt, 6, num_beams=3)
    assert beams.shape == (1, 6)


def test_a_batch_of_one_for_images_and_encoder_decoder():
    torch.manual_seed(0)
    vit = ViTransformerWrapper(image_size=8, patch_size=4, num_classes=5, attn_layers=Encoder(dim=32, depth=1, heads=4))
    img = torch.randn(3, 3, 8, 8)
    assert_close(vit.eval()(img[:1]), vit(img)[:1])
    xt = XTransformer(dim=32, enc_num_tokens=16, enc_max_seq_len=8, enc_depth=1, dec_num_tokens=16,
                      dec_max_seq_len=8, dec_depth=1)
    src, tgt = torch.randint(0, 16, (1, 8)), torch.randint(0, 16, (1, 8))
    loss = xt(src, tgt)
    assert torch.isfinite(loss)
    loss.backward()
    out = xt.generate(src, tgt[:, :1], 4, temperature=0.0)
    assert torch.equal(out, xt.generate(src, tgt[:, :1], 4, temperature=0.0, cache_kv=False))


# ---------------------------------------------------------------------------------------------
# generation refuses a prompt that keeps no token


def test_a_prompt_mask_that_keeps_no_token_is_refused():
    """Regression: such a row generated different tokens cached and uncached (its first token took
    position 1 after the padding in the cache, position 0 when recomputed)."""
    ar = AutoregressiveWrapper(_token_decoder())
    prompts = torch.randint(0, 64, (2, 3))
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match="without any kept token"):
        ar.generate(prompts, 4, mask=mask)
    with pytest.raises(ValueError, match="without any kept token"):
        ar.generate(prompts, 4, mask=mask, cache_kv=False)
