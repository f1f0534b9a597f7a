"""The vector index: exact search equals brute force (torch and faiss give the same neighbours),
approximate indexes find most true neighbours, FIFO eviction keeps the newest, saving round-trips."""

import math

import pytest
import torch

from polyformer.memory.vector_index import IndexSpec, VectorIndex, exact_search, have_faiss

needs_faiss = pytest.mark.skipif(not have_faiss(), reason="faiss-cpu not installed")


def brute(db, q, k, metric):
    s = -torch.cdist(q, db) ** 2 if metric == "l2" else q @ db.T
    return s.topk(k, dim=1).indices


def clustered(n, d, gen):
    centres = torch.randn(32, d, generator=gen) * 4
    return centres[torch.randint(0, 32, (n,), generator=gen)] + torch.randn(n, d, generator=gen)


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_exact_search_is_brute_force_across_chunks(metric):
    gen = torch.Generator().manual_seed(0)
    db, q = torch.randn(1000, 16, generator=gen), torch.randn(20, 16, generator=gen)
    scores, ids = exact_search(db, q, 7, metric, chunk=128)
    assert torch.equal(ids, brute(db, q, 7, metric))
    want = ((q[:, None] - db[ids]) ** 2).sum(-1) if metric == "l2" else (q[:, None] * db[ids]).sum(-1)
    torch.testing.assert_close(scores, want, atol=1e-4, rtol=1e-4)


def test_fewer_vectors_than_k_pad_with_minus_one():
    index = VectorIndex(4)
    index.add(torch.eye(4)[:2])
    scores, ids = index.search(torch.eye(4)[:1], 3)
    assert ids.tolist() == [[0, 1, -1]] and scores[0, 2] == math.inf and scores[0, 0] == 0


@needs_faiss
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_faiss_flat_gives_the_torch_neighbours(metric):
    gen = torch.Generator().manual_seed(1)
    db, q = torch.randn(3000, 32, generator=gen), torch.randn(50, 32, generator=gen)
    mine, theirs = VectorIndex(32, IndexSpec(backend="torch", metric=metric)), VectorIndex(
        32, IndexSpec(backend="faiss", metric=metric))
    for part in db.split(700):
        mine.add(part)
        theirs.add(part)
    assert torch.equal(mine.search(q, 10)[1], theirs.search(q, 10)[1])
    assert torch.equal(theirs.search(q, 10)[1], brute(db, q, 10, metric))


@needs_faiss
@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_indexes_find_most_true_neighbours(kind):
    gen = torch.Generator().manual_seed(2)
    db = clustered(8000, 32, gen)
    q = db[:200] + 0.05 * torch.randn(200, 32, generator=gen)
    index = VectorIndex(32, IndexSpec(kind=kind, nprobe=8, train_size=4096))
    index.add(db[:2000])
    assert not index.approximate or kind == "hnsw"          # an IVF searches exactly until trained
    index.add(db[2000:])
    assert index.approximate and len(index) == 8000
    truth = brute(db, q, 10, "l2")
    found = index.search(q, 10)[1]
    recall = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(found, truth)) / truth.numel()
    assert recall > 0.9
    assert (found[:, 0] == torch.arange(200)).float().mean() > 0.95


@needs_faiss
def test_hnsw_with_half_its_entries_stale_recalls_as_well_as_a_fresh_index():
    gen = torch.Generator().manual_seed(6)
    db, q = torch.randn(4000, 32, generator=gen), torch.randn(200, 32, generator=gen)
    spec = IndexSpec(kind="hnsw", ef_search=16)
    index, fresh = VectorIndex(32, spec), VectorIndex(32, spec)
    for part in db.split(250):
        index.add(part)
        index.keep_last(2000)
    assert index._faiss.ntotal == 4000                     # 2000 stale: the most before a rebuild
    fresh.add(db[2000:])
    truth = brute(db[2000:], q, 10, "l2")
    recall = [sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(i.search(q, 10)[1], truth)) / truth.numel()
              for i in (index, fresh)]
    assert recall[0] >= recall[1] - 0.02


@pytest.mark.parametrize("backend", ["torch", pytest.param("faiss", marks=needs_faiss)])
def test_keep_last_evicts_the_oldest_and_renumbers(backend):
    gen = torch.Generator().manual_seed(3)
    db = torch.randn(100, 8, generator=gen)
    index = VectorIndex(8, IndexSpec(backend=backend))
    index.add(db)
    index.keep_last(30)
    assert len(index) == 30 and torch.equal(index.vectors(), db[70:])
    assert index.search(db[70:75], 1)[1][:, 0].tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(index.search(db[:5], 1)[1], brute(db[70:], db[:5], 1, "l2"))


@needs_faiss
@pytest.mark.parametrize("spec", [IndexSpec(backend="faiss"), IndexSpec(kind="hnsw", ef_search=256),
                                  IndexSpec(kind="ivf", train_size=160, nlist=4, nprobe=4)])
def test_a_sliding_window_of_evictions_stays_exact_with_bounded_storage(spec):
    """Evicted vectors stay in the faiss index, skipped by search, until they outnumber the live ones."""
    gen = torch.Generator().manual_seed(5)
    db, q = torch.randn(1200, 8, generator=gen), torch.randn(6, 8, generator=gen)
    index, window = VectorIndex(8, spec), 200
    for end in range(40, 1201, 40):
        index.add(db[end - 40:end])
        index.keep_last(window)
        live = db[max(0, end - window):end]
        assert len(index) == live.shape[0] and torch.equal(index.vectors(), live)
        assert torch.equal(index.search(q, 5)[1], brute(live, q, 5, "l2"))
        assert index._faiss is None or index._faiss.ntotal <= 2 * window    # an IVF held in torch until 160
    assert index._faiss is not None
    again = VectorIndex.from_state(8, spec, index.state())
    assert torch.equal(again.search(q, 5)[1], index.search(q, 5)[1]) and torch.equal(again.vectors(), live)


@pytest.mark.parametrize("spec", [IndexSpec(), pytest.param(IndexSpec(kind="hnsw"), marks=needs_faiss),
                                  pytest.param(IndexSpec(kind="ivf", train_size=500), marks=needs_faiss)])
def test_state_round_trips(spec):
    gen = torch.Generator().manual_seed(4)
    db, q = clustered(1000, 16, gen), torch.randn(10, 16, generator=gen)
    index = VectorIndex(16, spec)
    index.add(db)
    again = VectorIndex.from_state(16, spec, index.state())
    assert len(again) == 1000
    assert torch.equal(index.search(q, 5)[1], again.search(q, 5)[1])


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="kind"):
        IndexSpec(kind="annoy")
    with pytest.raises(ValueError, match="faiss backend"):
        IndexSpec(kind="hnsw", backend="torch")
    with pytest.raises(ValueError, match="nprobe"):
        IndexSpec(nprobe=0)
    index = VectorIndex(4)
    with pytest.raises(ValueError, match=r"\(n, 4\)"):
        index.add(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="k must"):
        index.search(torch.zeros(1, 4), 0)
    state = index.state() | {"count": torch.tensor(3)}
    with pytest.raises(ValueError, match="inconsistent"):
        VectorIndex.from_state(4, IndexSpec(), state)
