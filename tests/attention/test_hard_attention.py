"""attn_hard and attn_gumbel_softmax (attention/hard_attention.py), by their defining properties: hard attention is
one-hot on the largest score with softmax's gradient (as x-transformers' attend.py); Gumbel-softmax draws
softmax((s + g) / tau), its hard form picks key j with probability softmax(s)_j whatever tau (the Gumbel-max
trick) and carries the soft draw's gradient. Cache parity of attn_hard: tests/options.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper
from polyformer.attention import hard_attention
from polyformer.attention.hard_attention import GumbelOptions, GumbelSoftmax, HardMax
from polyformer.attention.kernels.dense import DenseKernel, causal_keep
from polyformer.attention.normalize import masked_softmax
from polyformer.interfaces import KV

SMALL = dict(dim=16, depth=2, heads=2, attn_dim_head=8)


def scores(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2


def grad_of(fn, s: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """d/ds of sum(fn(s) * weights)."""
    s = s.clone().requires_grad_(True)
    (fn(s) * weights).sum().backward()
    return s.grad


# --- attn_hard -------------------------------------------------------------------------------------------------

def test_hard_is_one_hot_on_the_largest_kept_score_with_softmax_gradient():
    s = scores(2, 3, 5, 7)
    keep = causal_keep(5, 7, s.device)                     # (i, j): the last query row sees every key
    w = HardMax()(s, keep)
    best = s.masked_fill(~keep, float("-inf")).argmax(-1)
    assert torch.equal(w, F.one_hot(best, 7).to(w.dtype))
    assert not w[..., ~keep].any()
    up = scores(2, 3, 5, 7, seed=1)
    assert_close(grad_of(lambda t: HardMax()(t, keep), s, up), grad_of(lambda t: masked_softmax(t, keep), s, up))


def test_hard_row_without_keys_is_zero():
    s, keep = scores(1, 1, 2, 4), torch.tensor([[False] * 4, [True, False, True, False]])
    w = HardMax()(s, keep)
    assert not w[..., 0, :].any() and w[..., 1, :].sum() == 1


def test_hard_dense_kernel_equals_x_transformers_attend():
    """Our dense kernel with HardMax against x-transformers' Attend(hard=True, causal=True): same output, same
    gradient to q, k and v."""
    from x_transformers.attend import Attend

    q, k, v = (scores(2, 4, 6, 8, seed=i, dtype=torch.float32).requires_grad_(True) for i in range(3))
    kernel = DenseKernel(heads=4, scale=8 ** -0.5, dropout=0.0, normalize=HardMax())
    ours = kernel(q, KV(k=k, v=v, pos=None, mask=None), mask=None, bias=None, causal=True).out
    theirs, _ = Attend(hard=True, causal=True)(q, k, v)
    assert_close(ours, theirs)
    mine = torch.autograd.grad(ours.square().sum(), (q, k, v))
    other = torch.autograd.grad(theirs.square().sum(), (q, k, v))
    for a, b in zip(mine, other):
        assert_close(a, b)
        assert a.abs().sum() > 0


def test_hard_stack_trains_queries_and_keys_through_the_straight_through():
    """One-hot weights alone give q and k no gradient; the straight-through gives them softmax's."""
    torch.manual_seed(0)
    model = Decoder(**SMALL, attn_hard=True)
    model(torch.randn(2, 6, 16)).square().sum().backward()
    project = model.blocks[0].branch.project
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in project.parameters())


def test_hard_encoder_and_bfloat16():
    torch.manual_seed(0)
    model = Encoder(**SMALL, attn_hard=True).to(torch.bfloat16)
    x = torch.randn(1, 6, 16, dtype=torch.bfloat16)
    y = x.clone()
    y[:, -1] += 1
    out = model(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert not torch.equal(out[:, 0], model(y)[:, 0])          # the first position sees the last


# --- attn_gumbel_softmax ---------------------------------------------------------------------------------------

def test_gumbel_soft_draw_is_softmax_of_noised_scores(monkeypatch):
    s, g = scores(2, 2, 3, 5), scores(2, 2, 3, 5, seed=4).abs()
    monkeypatch.setattr(hard_attention, "gumbel_noise", lambda like: g.to(like.dtype))
    w = GumbelSoftmax(GumbelOptions(temp=0.5, hard=False))(s, None)
    assert_close(w, ((s + g) / 0.5).softmax(-1))


def test_gumbel_equals_torch_gumbel_softmax_on_the_same_seed():
    """x-transformers calls F.gumbel_softmax(tau, hard): the same draws from the same seed, soft and hard."""
    s = scores(2, 3, 4, 6, dtype=torch.float32)
    for hard in (False, True):
        torch.manual_seed(7)
        ours = GumbelSoftmax(GumbelOptions(temp=0.7, hard=hard))(s, None)
        torch.manual_seed(7)
        assert_close(ours, F.gumbel_softmax(s, tau=0.7, hard=hard))


@pytest.mark.parametrize("temp", [0.5, 2.0])
def test_gumbel_hard_picks_follow_softmax_of_scores_whatever_tau(temp):
    """Gumbel-max: argmax(s + g) is distributed as softmax(s); tau does not change which key wins."""
    s = torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=torch.float64)
    rows = s.expand(1, 1, 40000, 4)
    torch.manual_seed(0)
    w = GumbelSoftmax(GumbelOptions(temp=temp))(rows, None)
    assert ((w == 0) | (w == 1)).all() and (w.sum(-1) == 1).all()
    assert_close(w.mean(dim=(0, 1, 2)), s.softmax(-1), atol=0.01, rtol=0)   # 4 sigma at 40000 draws


def test_gumbel_hard_forward_is_one_hot_with_the_soft_draws_gradient(monkeypatch):
    s, g, up = scores(1, 2, 3, 5), scores(1, 2, 3, 5, seed=2).abs(), scores(1, 2, 3, 5, seed=3)
    keep = torch.tensor([True, True, False, True, True])
    monkeypatch.setattr(hard_attention, "gumbel_noise", lambda like: g.to(like.dtype))
    hard = GumbelSoftmax(GumbelOptions(temp=0.5, hard=True))
    soft = GumbelSoftmax(GumbelOptions(temp=0.5, hard=False))
    w = hard(s, keep)
    best = ((s + g) / 0.5).masked_fill(~keep, float("-inf")).argmax(-1)
    assert torch.equal(w, F.one_hot(best, 5).to(w.dtype))
    assert_close(grad_of(lambda t: hard(t, keep), s, up), grad_of(lambda t: soft(t, keep), s, up))


def lm(**kw) -> TransformerWrapper:
    torch.manual_seed(0)
    return TransformerWrapper(num_tokens=32, max_seq_len=24, attn_layers=Decoder(**SMALL, **kw)).eval()


def test_gumbel_draws_in_eval_too_as_x_transformers():
    model = lm(attn_gumbel_softmax=True)
    x = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(model(x), model(x))


@pytest.mark.parametrize("hard", [True, False])
def test_gumbel_cached_decoding_equals_uncached_for_the_same_noise(monkeypatch, hard):
    """The draws are the only randomness: with them fixed (zero noise), the decode state changes nothing."""
    monkeypatch.setattr(hard_attention, "gumbel_noise", torch.zeros_like)
    model = lm(attn_gumbel_softmax=True, attn_gumbel_softmax_temp=0.5, attn_gumbel_softmax_hard=hard,
               attn_kv_heads=1, attn_num_mem_kv=2, rotary_pos_emb=True)
    prompt = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    wrapper = AutoregressiveWrapper(model)
    cached = wrapper.generate(prompt, 6, temperature=0.0, cache_kv=True)
    assert torch.equal(cached, wrapper.generate(prompt, 6, temperature=0.0, cache_kv=False))
    x = torch.cat([prompt, cached], dim=1)
    with torch.no_grad():                                     # causal: a later token leaves earlier logits
        y = x.clone()
        y[:, 7:] = (y[:, 7:] + 1) % 32
        assert_close(model(x)[:, :7], model(y)[:, :7])


# --- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, words", [
    (dict(attn_hard=True, attn_sparse_topk=2), ["attn_sparse_topk", "attn_hard"]),
    (dict(attn_hard=True, attn_use_entmax15=True), ["attn_hard", "attn_use_entmax15"]),
    (dict(attn_hard=True, attn_gumbel_softmax=True), ["attn_hard", "attn_gumbel_softmax"]),
    (dict(attn_gumbel_softmax=True, attn_sigmoid=True), ["attn_sigmoid", "attn_gumbel_softmax"]),
    (dict(attn_hard=True, attn_flash=True), ["attn_flash", "attn_hard"]),
    (dict(attn_hard=True, attn_linear="elu"), ["attn_linear", "attn_hard"]),
    (dict(attn_gumbel_softmax_temp=0.5), ["attn_gumbel_softmax_temp", "attn_gumbel_softmax=True"]),
    (dict(attn_gumbel_softmax=False, attn_gumbel_softmax_hard=False), ["attn_gumbel_softmax_hard"]),
    (dict(attn_gumbel_softmax=True, attn_gumbel_softmax_temp=0.0), ["attn_gumbel_softmax_temp", "> 0"]),
    (dict(attn_gumbel_softmax=True, attn_gumbel_softmax_hard="yes"), ["attn_gumbel_softmax_hard", "True or False"]),
    (dict(attn_hard=1), ["attn_hard", "True or False"]),
])
def test_bad_input_is_refused_by_name(kw, words):
    with pytest.raises((ValueError, TypeError)) as err:
        Decoder(**SMALL, **kw)
    assert all(w in str(err.value) for w in words), str(err.value)
