"""The Memorizing Transformer's recall (attention/knn_memory.py `Recall`, memory/knn_store.py `search_scored`):
the search's scores are q . key at the slots it returns, over rows of unequal fill, and the recall's output and
gradient equal the explicit formula's (softmax over the gathered keys' scores, times the gathered values)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer.attention.knn_memory import Recall
from polyformer.memory.knn_store import KnnStore
from polyformer.memory.vector_index import IndexSpec, have_faiss

BACKENDS = ["torch"] + (["faiss"] if have_faiss() else [])


def filled(backend: str, dtype: torch.dtype = torch.float32, full: bool = False, size: int = 12) -> KnnStore:
    """16 entries written per row, the size 12 (FIFO-evicted) or 20 (empty slots left): rows of fill
    min(16, size), 3 (fewer than the top-k) and 0 (cleared); full: every row min(16, size)."""
    torch.manual_seed(0)
    store = KnnStore(size, IndexSpec(kind="flat", metric="ip", backend=backend))
    for n in (7, 9):
        keep = torch.ones(3, n, dtype=torch.bool)
        if not full:
            keep[1, 3:] = False
            keep[1] &= n == 7
        store.write(torch.randn(3, 2, n, 8, dtype=dtype), torch.randn(3, 2, n, 5, dtype=dtype), keep)
    if not full:
        store.clear(torch.tensor([False, False, True]))
    return store


@pytest.mark.parametrize("size", [12, 20])
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_search_scores_are_the_inner_products_at_the_returned_slots(backend, full, size):
    store = filled(backend, full=full, size=size)
    fills = [min(16, size)] * 3 if full else [min(16, size), 3, 0]
    assert store.fill.tolist() == fills
    q = torch.randn(3, 4, 6, 8)
    scores, slots, valid = store.search_scored(q, 5)
    keys, _ = store.entries(slots)
    assert valid.sum(-1).tolist() == [[[min(5, f)] * 6] * 4 for f in fills]
    assert_close(scores[valid], torch.einsum("bhid,bhikd->bhik", q, keys)[valid])
    assert bool(scores[~valid].eq(float("-inf")).all())
    assert bool((slots[valid] >= store.size - store.fill[:, None, None, None].expand_as(slots)[valid]).all())
    for r, h in ((0, 1), (1, 3)):                                   # the true top-k of the row's held keys
        held = store.keys[r, h // 2, store.size - int(store.fill[r]):]
        want = (q[r, h] @ held.T).topk(min(5, held.shape[0]), dim=-1).values
        assert_close(scores[r, h, :, :want.shape[1]], want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recall_output_and_gradient_equal_the_explicit_formula(backend):
    store = filled(backend, torch.float64 if backend == "torch" else torch.float32)
    dtype = store.keys.dtype
    q = torch.randn(3, 4, 6, 8, dtype=dtype, requires_grad=True)
    scores, slots, valid = store.search_scored(q.detach(), 5)
    keys, values = store.entries(slots)
    s = torch.einsum("bhid,bhikd->bhik", q, keys) * 0.3
    w = s.masked_fill(~valid, -1e30).softmax(dim=-1) * valid
    want = torch.einsum("bhik,bhikd->bhid", w, values)
    grad = torch.randn_like(want)
    (dq_want,) = torch.autograd.grad(want, q, grad)
    got = Recall.apply(q, scores, slots, valid, store, 0.3)
    (dq,) = torch.autograd.grad(got, q, grad)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-4)
    assert_close(got, want, **tol)
    assert_close(dq, dq_want, **tol)
    assert bool(got[2].eq(0).all()) and bool(dq[2].eq(0).all())        # an empty row recalls nothing
