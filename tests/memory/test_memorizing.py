"""Memorizing Transformer (attention/knn_memory.py, memory/knn_store.py): the store's exact top-k and
FIFO, kNN attention against its formula, the gate's extremes, per-row clearing, causality, saving,
faiss against torch, generation reading without writing, and bad input named."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, TransformerWrapper, XLAutoregressiveWrapper
from polyformer.attention.knn_memory import clear_knn_memories, memories, read_only
from polyformer.interfaces import Source
from polyformer.memory.knn_store import KnnStore, normalise_keys
from polyformer.memory.vector_index import IndexSpec, have_faiss
from tests.helpers import ids

needs_faiss = pytest.mark.skipif(not have_faiss(), reason="faiss-cpu is not installed")


def lm(seed: int = 0, depth: int = 1, max_seq_len: int = 32, **keywords) -> TransformerWrapper:
    torch.manual_seed(seed)
    layers = dict(dim=32, depth=depth, heads=4, attn_kv_heads=2, knn_memory_layers=(depth - 1,),
                  knn_memory_size=16, knn_topk=4)
    wrap = {k: keywords.pop(k) for k in ("max_mem_len",) if k in keywords}
    return TransformerWrapper(num_tokens=64, max_seq_len=max_seq_len, attn_layers=Decoder(**{**layers, **keywords}),
                              **wrap).eval()


def block(model: TransformerWrapper, layer: int = 0):
    return [b.branch for b in model.attn_layers.blocks if b.kind == "a"][layer]


def projected(attn, h: torch.Tensor, pos: torch.Tensor):
    """q, k, v of a block's (normalised) input h, before positions."""
    return attn.project(h, Source(h, pos, None), pos)


def held(store: KnnStore, row: int, head: int) -> torch.Tensor:
    fill = int(store.fill[row])
    return store.keys[row, head, store.size - fill:]


def test_exact_search_returns_the_true_top_k_per_row_and_key_head():
    torch.manual_seed(0)
    store = KnnStore(12, IndexSpec(kind="flat", metric="ip", backend="torch"))
    for n in (5, 7, 4):                              # fills past the size: FIFO eviction on the way
        keep = torch.rand(3, n) > 0.3
        store.write(torch.randn(3, 2, n, 8), torch.randn(3, 2, n, 6), keep)
    q = torch.randn(3, 4, 5, 8)                      # 4 query heads over 2 key heads
    slots, valid = store.search(q, 4)
    keys, _ = store.entries(slots)
    for r in range(3):
        for h in range(4):
            db = held(store, r, h // 2)
            want = (q[r, h] @ db.T).topk(min(4, db.shape[0]), dim=-1)
            got = torch.einsum("id,ikd->ik", q[r, h], keys[r, h])
            assert valid[r, h].sum(-1).eq(min(4, db.shape[0])).all()
            assert_close(got[:, :want.values.shape[1]], want.values)


def test_fifo_keeps_exactly_the_newest_kept_entries_in_order():
    torch.manual_seed(0)
    store = KnnStore(10, IndexSpec(kind="flat", metric="ip", backend="torch"))
    written = [[], []]
    for step in range(4):
        k = torch.randn(2, 1, 6, 4)
        keep = torch.ones(2, 6, dtype=torch.bool)
        keep[1, : step + 1] = False                   # row 1 writes fewer positions each time
        store.write(k, -k, keep)
        for r in range(2):
            written[r] += list(k[r, 0][keep[r]])
    for r in range(2):
        newest = torch.stack(written[r][-10:])
        assert int(store.fill[r]) == 10
        assert torch.equal(held(store, r, 0), newest)
        assert torch.equal(store.values[r, 0], -newest)


@needs_faiss
@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_faiss_indexes_retrieve_what_the_exact_search_retrieves(kind):
    torch.manual_seed(0)
    exact = KnnStore(16, IndexSpec(kind="flat", metric="ip", backend="torch"))
    other = KnnStore(16, IndexSpec(kind=kind, metric="ip", backend="faiss"))
    for n in (6, 9, 5):
        k, v, keep = torch.randn(2, 2, n, 8), torch.randn(2, 2, n, 3), torch.rand(2, n) > 0.2
        exact.write(k, v, keep)
        other.write(k, v, keep)
    q = torch.randn(2, 2, 7, 8)
    (a, va), (b, vb) = exact.search(q, 4), other.search(q, 4)
    assert torch.equal(va, vb) and torch.equal(a, b)


def test_knn_attention_equals_dense_attention_over_the_previous_segment():
    """topk = the memory's size = one segment: the memory term is softmax(scale q . k^) v over it."""
    model = lm(knn_topk=8, knn_memory_size=8)
    attn = block(model)
    with torch.no_grad():
        attn.knn.gate.fill_(30.0)                     # memory only
    a, b = ids(2, 8, seed=1), ids(2, 8, seed=2)
    _, rec_a = model(a, return_intermediates=True)
    seen = {}
    attn.output.register_forward_hook(lambda m, args, out: seen.update(out=args[0]))
    _, rec_b = model(b, return_intermediates=True)
    pos = torch.arange(8)[None]
    _, kv_a = projected(attn, rec_a.mems[0], pos)
    q_b, _ = projected(attn, rec_b.mems[0], pos)
    k = normalise_keys(kv_a.k).repeat_interleave(2, dim=1)
    v = kv_a.v.repeat_interleave(2, dim=1)
    want = torch.softmax(q_b @ k.transpose(-1, -2) * 64 ** -0.5, dim=-1) @ v
    assert_close(seen["out"], want, atol=1e-5, rtol=1e-4)


def test_the_gate_at_its_extremes_gives_local_only_or_memory_only():
    model = lm(rotary_pos_emb=True)
    attn = block(model)
    x, y = ids(2, 10, seed=1), ids(2, 10, seed=2)
    model(x)                                          # fills the memory
    knn = attn.knn
    with read_only(model), torch.no_grad():
        knn.gate.fill_(-30.0)
        local_only = model(y)
        knn.gate.fill_(30.0)
        seen = {}
        hook = attn.output.register_forward_hook(lambda m, args, out: seen.update(out=args[0]))
        _, rec = model(y, return_intermediates=True)
        hook.remove()
        attn.knn = None                               # the same block without its memory
        plain = model(y)
        attn.knn = knn
    assert_close(local_only, plain, atol=1e-5, rtol=1e-5)
    q, _ = projected(attn, rec.mems[0], torch.arange(10)[None])
    assert_close(seen["out"], knn.recall(q, 8))
    assert seen["out"].abs().amax() > 0.1                      # the memory was read


def test_knn_clear_empties_exactly_the_flagged_row():
    model = lm()
    a, b = ids(2, 10, seed=1), ids(2, 10, seed=2)
    model(a)
    store = block(model).knn.store
    row1_before = held(store, 1, 0).clone()
    cleared = model(b, knn_clear=torch.tensor([True, False]))
    assert store.fill.tolist() == [10, 16]
    assert torch.equal(held(store, 1, 0)[:6], row1_before[4:])      # 10 + 10 > 16: the oldest 4 left
    fresh = lm()                                      # row 0 read an empty memory, as a new model's does
    assert_close(cleared[0], fresh(b)[0])
    assert not torch.allclose(cleared[1], fresh(b)[1])
    clear_knn_memories(model, torch.tensor([False, True]))
    assert store.fill.tolist() == [10, 0]


def test_a_segment_never_retrieves_itself_and_stays_causal():
    model = lm(depth=2)
    model(ids(2, 12, seed=1))
    saved = model.state_dict()
    x = ids(2, 12, seed=2)
    out = model(x)                                     # reads segment 1, then writes x
    for t in (0, 5):
        model.load_state_dict(saved)                   # the memory as after segment 1
        y = x.clone()
        y[:, t + 1:] = (x[:, t + 1:] + 1) % 64
        out_y = model(y)
        assert_close(out_y[:, :t + 1], out[:, :t + 1])
        assert not torch.allclose(out_y[:, t + 1:], out[:, t + 1:])


def test_saved_memory_loads_equal_into_a_fresh_model_and_a_checkpoint(tmp_path):
    from polyformer.train.checkpoint import load_checkpoint, save_checkpoint

    model = lm(depth=2)
    for s in range(3):
        model(ids(2, 9, seed=s), knn_clear=torch.tensor([s == 2, False]))
    for target in ("state_dict", "checkpoint"):
        other = lm(seed=5, depth=2)
        if target == "state_dict":
            other.load_state_dict(model.state_dict())
        else:
            save_checkpoint(tmp_path, 1, model, None, None)
            load_checkpoint(tmp_path / "checkpoints" / "step-000001", other, rng=False)
        mine, theirs = block(model, 1).knn.store, block(other, 1).knn.store
        assert torch.equal(mine.fill, theirs.fill)
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        x = ids(2, 9, seed=9)
        with read_only(model), read_only(other):
            assert_close(other(x), model(x), rtol=0, atol=0)


@needs_faiss
@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_faiss_and_torch_searches_give_the_same_outputs(kind):
    exact, approx = lm(depth=2, knn_index_backend="torch"), lm(depth=2, knn_index=kind, knn_index_backend="faiss")
    approx.load_state_dict(exact.state_dict())
    for s in range(4):                                 # past the memory's size: eviction
        x = ids(2, 7, seed=s)
        assert_close(approx(x), exact(x), atol=1e-5, rtol=1e-5)


def test_generation_reads_the_memory_and_cached_equals_uncached():
    model = lm(depth=2, rotary_pos_emb=True)
    for s in range(2):
        model(ids(2, 10, seed=s))
    before = [m.get_extra_state().clone() for m in memories(model)]
    ar = AutoregressiveWrapper(model)
    prompts = ids(2, 5, seed=7)
    cached = ar.generate(prompts, 8, temperature=0.0)
    uncached = ar.generate(prompts, 8, temperature=0.0, cache_kv=False)
    assert torch.equal(cached, uncached)
    assert all(torch.equal(a, m.get_extra_state()) for a, m in zip(before, memories(model)))
    clear_knn_memories(model)
    assert not torch.equal(ar.generate(prompts, 8, temperature=0.0), cached)   # the memory mattered


def test_cached_steps_equal_the_uncached_forward_over_a_filled_memory():
    model = lm(depth=2, rotary_pos_emb=True)
    for s in range(2):                                 # 20 written, 16 kept: the memory evicted
        model(ids(2, 10, seed=s))
    x = ids(2, 9, seed=3)
    with read_only(model):
        full = model(x)
        state = model.new_state(2, 9)
        cached = torch.cat([model(x[:, :4], state=state)] + [model(x[:, t:t + 1], state=state) for t in range(4, 9)], 1)
    assert_close(cached, full, atol=1e-5, rtol=1e-5)
    clear_knn_memories(model)
    with read_only(model):
        assert not torch.allclose(model(x), full, atol=1e-3)    # the memory was read


def test_xl_segments_write_the_memory_once_each():
    model = lm(depth=2, max_seq_len=8, max_mem_len=8, knn_memory_size=64)
    xl = XLAutoregressiveWrapper(model)
    xl(ids(2, 21, seed=1))                             # 20 inputs: segments of 8, 8 and 4
    assert block(model, 1).knn.store.fill.tolist() == [20, 20]
    clear_knn_memories(model)
    small = lm(depth=2, max_seq_len=4, max_mem_len=4, knn_memory_size=64)
    XLAutoregressiveWrapper(small).generate(ids(2, 6, seed=2), 7, temperature=0.0)
    # the prompt's full segment, then the segments completed while generating: 3 x 4 positions, once each
    assert block(small, 1).knn.store.fill.tolist() == [12, 12]


@pytest.mark.parametrize("keywords, match", [
    (dict(knn_memory_layers=(2,)), "knn_memory_layers must name distinct self-attention blocks in \\[0, 2\\)"),
    (dict(knn_memory_layers=(0, 0)), "knn_memory_layers must name distinct"),
    (dict(knn_memory_layers=(0,), knn_topk=0), "knn_topk must be an integer >= 1"),
    (dict(knn_memory_layers=(0,), knn_topk=8, knn_memory_size=4), "knn_memory_size must be an integer >= knn_topk"),
    (dict(knn_memory_layers=(0,), knn_index="annoy"), "knn_index must be one of flat, ivf, hnsw"),
    (dict(knn_memory_layers=(0,), knn_index="hnsw", knn_index_backend="torch"), "knn_index_backend='torch'"),
    (dict(knn_topk=4), "knn_topk need"),
    (dict(knn_memory_layers=(0,), gradient_checkpointing=True), "cannot combine with gradient_checkpointing"),
    (dict(knn_memory_layers=(1,), attn_performer=True), "block 1 uses attn_performer"),
    (dict(knn_memory_layers="0"), "knn_memory_layers"),
])
def test_bad_options_are_refused_by_name(keywords, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Decoder(dim=32, depth=2, heads=4, **keywords)


def test_bad_forward_input_is_refused_by_name():
    model = lm()
    with pytest.raises(ValueError, match="knn_clear must be a bool tensor of shape \\(2,\\)"):
        model(ids(2, 6), knn_clear=torch.tensor([1, 0]))
    model(ids(2, 6))
    with pytest.raises(ValueError, match="holds 2 batch rows, this forward has 3"):
        model(ids(3, 6))
    model(ids(3, 6), knn_clear=torch.ones(3, dtype=torch.bool))     # a new memory of 3 rows
    with pytest.raises(ValueError, match="no kNN memory"):
        TransformerWrapper(num_tokens=64, max_seq_len=32, attn_layers=Decoder(dim=32, depth=1, heads=4))(
            ids(2, 6), knn_clear=torch.zeros(2, dtype=torch.bool))
    state = model.new_state(3, 8)
    with pytest.raises(ValueError, match="knn_clear cannot combine with a decode state"):
        model(ids(3, 2), state=state, knn_clear=torch.zeros(3, dtype=torch.bool))
