"""x-transformers 2.31.10's README blocks left out of test_xt2_readme*.py until their keywords were built: the
simple RMSNorm, straight-through top-k, hard attention, ResiDual, NormFormer's head scale, scale_residual and
xVal, in README order (conventions: xt2_checks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyformer import Decoder, TransformerWrapper, XValAutoregressiveWrapper, XValTransformerWrapper
from polyformer.attention.normalize import TopK, masked_softmax
from tests.readme.xt2_checks import (DIM, NUM, SEQ, assert_cached_generation, assert_causal, assert_trains,
                                     copy_weights, ids, lm)


def grad_of(fn, s: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """d/ds of sum(fn(s) * up)."""
    s = s.clone().requires_grad_(True)
    (fn(s) * up).sum().backward()
    return s.grad


def first_normalizer(model: TransformerWrapper) -> torch.nn.Module:
    return model.attn_layers.blocks[0].branch.kernel.normalize


# ------------------------------------------------------------------------------------------------
# norms, attention normalisers

def test_simple_rmsnorm():
    model = lm(use_simple_rmsnorm = True) # set to true to use for all layers
    assert not [name for name, _ in model.attn_layers.named_parameters() if "norm" in name]    # no gains
    h = torch.randn(2, 5, DIM) * 3
    normed = model.attn_layers.blocks[0].norm_in(h)
    torch.testing.assert_close(normed.pow(2).mean(-1), torch.ones(2, 5), atol=1e-4, rtol=0)
    torch.testing.assert_close(model.attn_layers.final_norm(h), normed)
    assert_causal(model, ids())
    assert_cached_generation(model)


def test_sparse_topk_straight_through():
    model = lm(
        attn_sparse_topk = 8,                       # keep only the top 8 values before attention (softmax)
        attn_sparse_topk_straight_through = True    # straight through the original gradients
    )
    s, up = torch.randn(1, 8, SEQ, SEQ), torch.randn(1, 8, SEQ, SEQ)
    straight = first_normalizer(model)
    torch.testing.assert_close(straight(s, None), TopK(8)(s, None))                 # top-8 forward
    torch.testing.assert_close(grad_of(lambda t: straight(t, None), s, up),         # the full softmax's gradient
                               grad_of(lambda t: masked_softmax(t, None), s, up))
    topk_only = copy_weights(model, lm(attn_sparse_topk = 8))
    x = ids()
    torch.testing.assert_close(model.eval()(x), topk_only(x))
    assert_cached_generation(model)


def test_hard_attention():
    model = lm(
        attn_hard = True  # will only propagate the single value of the argmax of qk logit. offered in the case it addresses https://arxiv.org/abs/2410.01104
    )
    s, up = torch.randn(1, 8, SEQ, SEQ), torch.randn(1, 8, SEQ, SEQ)
    hard = first_normalizer(model)
    assert torch.equal(hard(s, None), F.one_hot(s.argmax(-1), SEQ).float())         # the argmax's value only
    torch.testing.assert_close(grad_of(lambda t: hard(t, None), s, up), grad_of(lambda t: t.softmax(-1), s, up))
    assert_trains(model(ids()).logsumexp(-1).mean(), model)      # queries and keys learn through the softmax
    assert_causal(model, ids())
    assert_cached_generation(model)


# ------------------------------------------------------------------------------------------------
# residual variants

def test_resi_dual():
    torch.manual_seed(0)
    model = lm(
        depth = 6,
        resi_dual = True,               # set this to True
        resi_dual_scale = 0.1           # in appendix, they said on fp16 the prenorm residual is prone to overflow. they claim by scaling it at each layer by a factor, it would prevent the overflow, and keep results the same (as layernorms are invariant to scaling of the input)
    )

    x = torch.randint(0, NUM, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, NUM)
    unscaled = copy_weights(model, lm(depth = 6, resi_dual = True))
    with torch.no_grad():          # the scale keeps the results: the stream's layernorm undoes it, up to its eps
        model.eval().attn_layers.resi_dual.norm.eps = 1e-5 * 0.1 ** 2
        torch.testing.assert_close(model(x), unscaled(x), atol=1e-4, rtol=1e-4)
        model.attn_layers.resi_dual.norm.eps = 1e-5
    assert_causal(model, x)
    assert_cached_generation(model)


def test_attn_head_scale():
    torch.manual_seed(0)
    model = lm(
        attn_head_scale = True  # set this to True
    )

    x = torch.randint(0, NUM, (1, SEQ))
    out = model(x)
    assert_trains(out.logsumexp(-1).mean(), model)
    torch.manual_seed(0)
    plain = lm().eval()            # the same weights: gamma's init draws nothing
    with torch.no_grad():          # a learned scale per head, init 1: the plain model until it moves
        torch.testing.assert_close(model.eval()(x), plain(x))
        gamma = model.attn_layers.blocks[0].branch.output.gamma
        assert gamma.shape == (8,)
        gamma[4:] = 0.0            # heads 4-7 of the first block silenced: as their value weights at zero
        v = plain.attn_layers.blocks[0].branch.project
        heads_off(v, range(4, 8))
        torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-5)
    assert_cached_generation(model)


def heads_off(project: torch.nn.Module, heads: range) -> None:
    """Zero the value projection rows of `heads` in a block's fused q / k / v projection."""
    q_out, k_out, _ = project.split
    start = q_out + k_out
    for h in heads:
        project.to_qkv.weight[start + h * project.dim_head:start + (h + 1) * project.dim_head] = 0.0


def test_scale_residual():
    model = lm(
        scale_residual = True # set this to True
    )

    x = torch.randint(0, NUM, (1, SEQ))
    out = model(x)
    assert_trains(out.logsumexp(-1).mean(), model)
    plain = copy_weights(model, lm(), strict = False)
    with torch.no_grad():          # a learned per-feature scale of the stream, init 1
        torch.testing.assert_close(model.eval()(x), plain(x))
        scales = [p for name, p in model.named_parameters() if "scale" in name]
        assert scales and all(p.shape == (DIM,) for p in scales)
        scales[0].mul_(2.0)
        assert not torch.allclose(model(x), plain(x))
    assert_cached_generation(model)


# ------------------------------------------------------------------------------------------------
# xVal

def test_xval():
    torch.manual_seed(0)
    model = XValTransformerWrapper(
        num_tokens = 4,
        numerical_token_id = 3,
        max_seq_len = 32,
        attn_layers = Decoder(
            dim = DIM,
            depth = 2,
            heads = 8
        )
    )

    # wrap it with the xval autoregressive wrapper

    model = XValAutoregressiveWrapper(model)

    # mock data

    ids_ = torch.randint(0, 4, (1, 24))
    nums = torch.randn(1, 24)

    # train on a lot of data above

    loss, parts = model(ids_, nums, return_loss_breakdown = True)
    is_num = ids_[:, 1:] == 3           # CE on every next token, plus the squared error at [NUM] targets
    torch.testing.assert_close(loss, (parts.cross_entropy_loss + parts.numerical_mse_loss).mean())
    assert (parts.numerical_mse_loss[~is_num] == 0).all()
    model.zero_grad()
    assert_trains(model(ids_, nums), model)

    # the [NUM] embedding carries the value: v times the [NUM] embedding
    net = model.net
    three = torch.tensor([[3]])
    torch.testing.assert_close(net.embed(three, torch.tensor([[2.5]])), 2.5 * net.embed(three, torch.ones(1, 1)))

    # then generate

    start_ids = torch.randint(0, 4, (1, 1))
    start_nums = torch.randn(1, 1)

    ids_out, num_out, is_number_mask = model.generate(start_ids, start_nums, 17)

    # (1, 17), (1, 17), (1, 17)
    assert ids_out.shape == num_out.shape == is_number_mask.shape == (1, 17)

    # discrete, continuous, mask for discrete / continuous
    assert torch.equal(is_number_mask, ids_out == 3)
    assert torch.isnan(num_out[~is_number_mask]).all() and torch.isfinite(num_out[is_number_mask]).all()
    cached = model.generate(start_ids, start_nums, 17, temperature = 0.0, cache_kv = True)
    uncached = model.generate(start_ids, start_nums, 17, temperature = 0.0, cache_kv = False)
    assert torch.equal(cached.sampled_token_ids, uncached.sampled_token_ids)
    assert torch.equal(cached.is_number_mask, uncached.is_number_mask)
    torch.testing.assert_close(cached.sampled_numbers, uncached.sampled_numbers, equal_nan = True)
