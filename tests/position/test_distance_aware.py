"""DA-Transformer (attention/kernels/distance_aware.py): f(0) = 1, f monotone and bounded, alpha = 0 is
ReLU attention without distance weighting, the kernel equals the paper's formula written out, and
bad input named."""

import math

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.attention.kernels.distance_aware import distance_weight
from polyformer.interfaces import KV
from tests.helpers import ids, tiny_lm
from tests.options import perturb

ALPHAS = torch.tensor([-2.0, -0.3, 0.0, 0.4, 3.0])
BETAS = torch.tensor([-1.0, 0.0, 0.5, 2.0, -3.0])


def test_f_is_one_at_distance_zero():
    f = distance_weight(torch.zeros(1, 1), ALPHAS, BETAS)
    assert_close(f, torch.ones_like(f))


def test_f_is_monotone_and_bounded_by_one_plus_exp_beta():
    distance = torch.arange(0, 200, dtype=torch.float32)[None]                  # (1, 200): one query row
    f = distance_weight(distance, ALPHAS, BETAS)[:, 0]                           # (h, 200)
    step = f.diff(dim=-1)
    rising, falling = ALPHAS > 0, ALPHAS < 0
    assert (step[rising] >= 0).all() and (step[falling] <= 0).all()
    assert (f >= 0).all() and (f[:, :20] > 0).all() and (f <= (1 + BETAS.exp())[:, None] + 1e-5).all()
    assert_close(f[rising, -1], 1 + BETAS[rising].exp(), atol=1e-4, rtol=1e-4)  # the bound is reached far away
    assert_close(f[ALPHAS == 0], torch.ones(1, 200))


def kernel_of(model):
    return model.attn_layers.blocks[0].branch.kernel


def written_out(q, k, v, q_pos, k_pos, alpha, beta, causal):
    """softmax(ReLU(q k^T) * (1 + e^b) / (1 + e^(b - a |i - j|)) / sqrt(d)) v."""
    r = alpha.view(-1, 1, 1) * (q_pos[:, None, :, None] - k_pos[:, None, None, :]).abs()
    f = (1 + beta.exp()).view(-1, 1, 1) / (1 + torch.exp(beta.view(-1, 1, 1) - r))
    scores = torch.relu(q @ k.transpose(-1, -2)) * f / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(k_pos[:, None, None, :] > q_pos[:, None, :, None], float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_the_kernel_is_the_papers_formula(causal):
    stack = Decoder if causal else Encoder
    model = perturb(tiny_lm(stack, attn_distance_aware=True, attn_dim_head=8, seed=0))
    kernel = kernel_of(model)
    q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)
    pos = torch.tensor([[0, 1, 2, 3, 4], [2, 5, 6, 9, 20]])
    out = kernel(q, KV(k, v, pos, None), q_pos=pos, causal=causal, memory=None, need_weights=False).out
    assert_close(out, written_out(q, k, v, pos, pos, kernel.alpha, kernel.beta, causal), atol=1e-5, rtol=1e-5)


def test_alpha_zero_is_relu_attention_without_distance_weighting():
    model = perturb(tiny_lm(Encoder, attn_distance_aware=True, attn_dim_head=8, seed=0))
    kernel = kernel_of(model)
    with torch.no_grad():
        kernel.alpha.zero_()
    q, k, v = torch.randn(3, 2, 4, 6, 8).unbind(0)
    near, far = torch.arange(6)[None], torch.tensor([[0, 10, 30, 31, 70, 200]])
    run = lambda pos: kernel(q, KV(k, v, pos, None), q_pos=pos, causal=False, memory=None, need_weights=True)
    a, b = run(near), run(far)
    relu_attention = (torch.relu(q @ k.transpose(-1, -2)) / math.sqrt(8)).softmax(-1)
    assert_close(a.weights, relu_attention)
    assert_close(b.weights, relu_attention)             # distances play no part
    assert_close(a.out, relu_attention @ v)


def test_memory_key_values_are_seen_without_distance_weighting():
    model = perturb(tiny_lm(Encoder, attn_distance_aware=True, attn_dim_head=8, seed=0))
    kernel = kernel_of(model)
    q, k, v = torch.randn(3, 1, 4, 3, 8).unbind(0)
    free_k, free_v = torch.randn(2, 1, 4, 2, 8).unbind(0)
    pos = torch.arange(3)[None]
    out = kernel(q, KV(torch.cat((free_k, k), 2), torch.cat((free_v, v), 2), pos, None, free=2), q_pos=pos,
                 causal=False, memory=None, need_weights=True)
    scores = torch.relu(q @ free_k.transpose(-1, -2)) / math.sqrt(8)             # f = 1 on the free keys
    weights = out.weights[..., :2] / out.weights[..., :2].sum(-1, keepdim=True)
    assert_close(weights, scores.softmax(-1))


def test_sequences_longer_than_max_seq_len_run():
    model = tiny_lm(attn_distance_aware=True, max_seq_len=8)
    assert model.pos_emb is None and model(ids(1, 20)).shape == (1, 20, 64)


@pytest.mark.parametrize("keywords, named", [
    (dict(attn_distance_aware_alpha=1.0), "attn_distance_aware_alpha need(s) attn_distance_aware"),
    (dict(attn_distance_aware=True, attn_distance_aware_alpha=float("inf")), "attn_distance_aware_alpha must be"),
    (dict(attn_distance_aware=True, attn_distance_aware_beta="1"), "attn_distance_aware_beta must be"),
    (dict(attn_distance_aware=True, rel_pos_bias=True), "attn_distance_aware cannot take .*rel_pos_bias"),
    (dict(attn_distance_aware=True, attn_talking_heads=True), "attn_distance_aware .* attn_talking_heads"),
    (dict(attn_distance_aware=True, attn_performer=True), "attn_performer and attn_distance_aware conflict"),
])
def test_bad_input_is_named(keywords, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        Decoder(dim=16, depth=1, heads=2, **keywords)
