"""Score normalisers, polyformer/attention/normalize.py: softmax, explicit top-k sparse softmax
(arXiv:1912.11637), entmax-1.5 (arXiv:1909.00015). Each is compared with an explicit computation
over the visible keys only; masked keys get weight zero and a row with no visible key is all zero."""

from __future__ import annotations

import pytest
import torch
from entmax import entmax15
from torch.testing import assert_close

from polyformer.attention.normalize import Entmax15, Softmax, TopK
from tests.helpers import ids, tiny_lm


NORMALIZERS = {"softmax": lambda: Softmax(), "topk": lambda: TopK(3), "entmax15": lambda: Entmax15()}


def explicit_row(name: str, s: torch.Tensor) -> torch.Tensor:
    """Weights over the visible scores s (1-D) of one row."""
    if name == "softmax":
        return s.softmax(-1)
    if name == "topk":
        out = torch.zeros_like(s)
        idx = s.topk(min(3, s.numel())).indices
        out[idx] = s[idx].softmax(-1)
        return out
    return entmax15(s, dim=-1)


def random_mask(shape, p_keep=0.6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < p_keep


@pytest.mark.parametrize("name", NORMALIZERS)
def test_equals_explicit_computation_over_visible_keys(name):
    scores = torch.randn(2, 3, 5, 9) * 3
    mask = random_mask((2, 1, 5, 9))
    mask[..., 0] = True                                       # every row sees a key here
    weights = NORMALIZERS[name]()(scores, mask)
    for b in range(2):
        for h in range(3):
            for i in range(5):
                keep = mask[b, 0, i]
                row = weights[b, h, i]
                assert torch.equal(row[~keep], torch.zeros_like(row[~keep]))
                assert_close(row[keep], explicit_row(name, scores[b, h, i][keep]))


@pytest.mark.parametrize("name", NORMALIZERS)
def test_rows_sum_to_one_and_fully_masked_rows_are_zero(name):
    scores = torch.randn(2, 4, 6, 8, requires_grad=True)
    mask = random_mask((2, 1, 6, 8))
    mask[:, :, 0] = False                                     # row 0 sees nothing
    mask[:, :, 1:, 3] = True                                  # the others see at least key 3
    weights = NORMALIZERS[name]()(scores, mask)
    assert torch.isfinite(weights).all()
    assert torch.equal(weights[:, :, 0], torch.zeros_like(weights[:, :, 0]))
    assert_close(weights[:, :, 1:].sum(-1), torch.ones(2, 4, 5))
    assert (weights[~mask.expand_as(weights)] == 0).all()
    weights.pow(2).sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert torch.equal(scores.grad[:, :, 0], torch.zeros_like(scores.grad[:, :, 0]))


@pytest.mark.parametrize("name", NORMALIZERS)
def test_without_mask_rows_sum_to_one(name):
    scores = torch.randn(2, 4, 6, 8)
    weights = NORMALIZERS[name]()(scores, None)
    assert_close(weights.sum(-1), torch.ones(2, 4, 6))
    assert (weights >= 0).all()


@pytest.mark.parametrize("k", [1, 2, 5])
def test_topk_keeps_exactly_k_per_row(k):
    scores = torch.randn(2, 4, 7, 10)                        # continuous: no ties
    weights = TopK(k)(scores, None)
    assert ((weights > 0).sum(-1) == k).all()
    # the kept ones are the k largest scores, weighted by a softmax over them
    top = scores.topk(k, dim=-1)
    assert_close(weights.gather(-1, top.indices), top.values.softmax(-1))


def test_topk_counts_only_visible_keys():
    scores = torch.randn(1, 2, 4, 10)
    mask = torch.zeros(1, 1, 4, 10, dtype=torch.bool)
    mask[..., 0, :2] = True                                   # fewer visible keys than k: keep them all
    mask[..., 1, :] = True
    mask[..., 2, ::2] = True                                  # 5 visible, k = 3
    weights = TopK(3)(scores, mask)
    nonzero = (weights > 0).sum(-1)[0]                        # (h, i)
    assert (nonzero[:, 0] == 2).all()
    assert (nonzero[:, 1] == 3).all()
    assert (nonzero[:, 2] == 3).all()
    assert (nonzero[:, 3] == 0).all()                         # fully masked row
    assert (weights[~mask.expand_as(weights)] == 0).all()


@pytest.mark.parametrize("k", [10, 11, 50])
def test_topk_with_k_at_least_row_length_is_softmax(k):
    scores = torch.randn(2, 3, 5, 10)
    mask = random_mask((2, 1, 5, 10), p_keep=0.8)
    assert_close(TopK(k)(scores, mask), Softmax()(scores, mask))
    assert_close(TopK(k)(scores, None), scores.softmax(-1))


def test_entmax15_is_sparse_on_peaked_scores():
    scores = torch.randn(2, 4, 6, 12)
    scores[..., 3] += 6.0                                     # a clear winner in every row
    weights = Entmax15()(scores, None)
    assert_close(weights, entmax15(scores, dim=-1))
    assert_close(weights.sum(-1), torch.ones(2, 4, 6))
    assert ((weights == 0).sum(-1) > 0).all()                 # exact zeros in every row
    assert (weights[..., 3] > 0.5).all()


def test_entmax15_equals_package_on_unmasked_input():
    scores = torch.randn(3, 2, 7, 9) * 2
    assert_close(Entmax15()(scores, None), entmax15(scores, dim=-1))
    ones = torch.ones(3, 1, 7, 9, dtype=torch.bool)
    assert_close(Entmax15()(scores, ones), entmax15(scores, dim=-1))


def test_low_precision_scores_keep_their_dtype_and_rows_sum_to_one():
    scores = torch.randn(1, 2, 4, 6).to(torch.bfloat16)
    mask = random_mask((1, 1, 4, 6), p_keep=0.7)
    mask[..., 0] = True
    for name, make in NORMALIZERS.items():
        weights = make()(scores, mask)
        assert weights.dtype == torch.bfloat16, name
        assert_close(weights.float().sum(-1), torch.ones(1, 2, 4), atol=1e-2, rtol=1e-2)


# --- through a model ---------------------------------------------------------------------------

def test_decoder_topk_maps_keep_min_k_causal_keys():
    model = tiny_lm(depth=1, attn_sparse_topk=3)
    _, maps = model(ids(n=10), return_attn=True)
    a = maps[0]
    n = a.shape[-1]
    expected = torch.tensor([min(3, i + 1) for i in range(n)])
    assert ((a > 0).sum(-1) == expected).all()
    assert (a.triu(1) == 0).all()
    assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))


def test_decoder_entmax15_maps_are_causal_distributions():
    model = tiny_lm(depth=1, attn_use_entmax15=True)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False
    _, maps = model(ids(n=10), mask=mask, return_attn=True)
    a = maps[0]
    assert torch.isfinite(a).all()
    assert (a.triu(1) == 0).all()
    assert (a[1, :, :, :3] == 0).all()
    assert_close(a[0].sum(-1), torch.ones(4, 10))
    assert_close(a[1, :, 3:].sum(-1), torch.ones(4, 7))
    assert (a[1, :, :3] == 0).all()                          # queries with no visible key
