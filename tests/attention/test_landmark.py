"""Landmark attention (attention/kernels/landmark.py, landmark.py): the grouped softmax against the paper's
formula written out, top-k retrieval against the full forward and a restricted reference, the wrapper's
landmark placement, causality, cached == uncached, and bad input named."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper
from polyformer.attention.kernels.landmark import Landmark, LandmarkOptions
from polyformer.interfaces import KV, KernelSpec
from tests.helpers import ids, stepped, tiny_lm

L = 3                       # tokens per block; a block with its landmark spans L + 1 positions


def kernel(topk: int | None = None, heads: int = 4, kv_heads: int = 2, d: int = 8) -> Landmark:
    spec = KernelSpec(heads=heads, kv_heads=kv_heads, dim_qk=d, dim_v=d, causal=True, layer=0, scale=d ** -0.5,
                      options=LandmarkOptions(block=L, topk=topk))
    return Landmark(spec).eval()


def inputs(i: int, j: int, b: int = 2, h: int = 4, hk: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, i, d, generator=g)
    kv = KV(torch.randn(b, hk, j, d, generator=g), torch.randn(b, hk, j, d, generator=g),
            torch.arange(j)[None], None)
    return q, kv, torch.arange(j - i, j)[None]


def paper_weights(q, kv, q_pos, chosen=None) -> torch.Tensor:
    """The paper's a_tj, entry by entry: grouped softmax σ with g_tj = p_t for landmarks and the current block,
    p_j for earlier blocks' tokens; a = 0 (landmark), σ (current block), σ_tj σ_t,L(p_j) (earlier block).
    `chosen[b][h][t]`: the earlier blocks query t keeps (top-k); None: all of them."""
    b, h, i, d = q.shape
    k = kv.k.repeat_interleave(h // kv.k.shape[1], 1)
    pos = kv.pos[0].tolist()
    out = torch.zeros(b, h, i, k.shape[2], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for t in range(i):
                pt = int(q_pos[0, t])
                c = pt // (L + 1)
                s = {r: float(q[bi, hi, t] @ k[bi, hi, r]) * d ** -0.5 for r, p in enumerate(pos) if p <= pt}
                block = {r: pos[r] // (L + 1) for r in s}
                mark = {r: pos[r] % (L + 1) == L for r in s}
                keep = chosen[bi][hi][t] if chosen is not None else set(range(c))
                seen = [r for r in s if not (mark[r] and block[r] == c) and (block[r] == c or block[r] in keep)]
                group = {r: c if mark[r] or block[r] == c else block[r] for r in seen}
                sigma = {r: torch.tensor(s[r]).exp() / sum(torch.tensor(s[x]).exp() for x in seen
                                                           if group[x] == group[r]) for r in seen}
                landmark_of = {block[r]: r for r in seen if mark[r]}
                for r in seen:
                    if mark[r]:
                        continue
                    a = sigma[r] if block[r] == c else sigma[r] * sigma[landmark_of[block[r]]]
                    out[bi, hi, t, r] = float(a)
    return out


def test_grouped_softmax_equals_the_paper_formula():
    torch.manual_seed(0)
    q, kv, q_pos = inputs(14, 14)                      # blocks 0-2 complete with landmarks, block 3 open
    attn = kernel()
    got = attn(q, kv, q_pos=q_pos, causal=True, memory=None, need_weights=True)
    want = paper_weights(q, kv, q_pos)
    assert_close(got.weights.double(), want, atol=1e-6, rtol=1e-5)
    assert_close(got.weights.sum(-1), torch.ones(2, 4, 14))
    landmarks = torch.arange(14) % (L + 1) == L
    assert (got.weights[..., landmarks] == 0).all()    # a landmark only gates its block
    v = kv.v.repeat_interleave(2, 1)
    assert_close(got.out, torch.einsum("bhij,bhjd->bhid", want.float(), v), atol=1e-5, rtol=1e-5)
    # and it is not plain causal softmax attention
    dense = torch.softmax((q @ kv.k.repeat_interleave(2, 1).transpose(-1, -2)) * 8 ** -0.5
                          + torch.full((14, 14), float("-inf")).triu(1), -1)
    assert not torch.allclose(got.weights, dense, atol=1e-3)


@pytest.mark.parametrize("i", [1, 2, 14])
def test_topk_covering_every_block_equals_the_full_forward(i):
    q, kv, q_pos = inputs(i, 14, seed=1)
    full = kernel()(q, kv, q_pos=q_pos, causal=True, memory=None, need_weights=False).out
    for k in (3, 10):                                   # 3 complete blocks before the last query's own
        covered = kernel(topk=k)(q, kv, q_pos=q_pos, causal=True, memory=None, need_weights=False).out
        assert_close(covered, full, atol=1e-6, rtol=1e-5)


def test_topk_reads_only_the_chosen_blocks_and_equals_the_restricted_formula(monkeypatch):
    q, kv, q_pos = inputs(1, 26, seed=2)               # 6 complete blocks, the query in block 6
    attn = kernel(topk=2)
    monkeypatch.setattr(Landmark, "grouped", lambda *a: pytest.fail("a decode step read every key"))
    out = attn(q, kv, q_pos=q_pos, causal=True, memory=None, need_weights=False).out
    marks = kv.k.repeat_interleave(2, 1)[:, :, L::L + 1][:, :, :6]
    top = torch.einsum("bhid,bhnd->bhin", q, marks).topk(2, dim=-1).indices       # (b, h, 1, 2)
    chosen = [[[set(top[b, h, 0].tolist())] for h in range(4)] for b in range(2)]
    want = torch.einsum("bhij,bhjd->bhid", paper_weights(q, kv, q_pos, chosen).float(), kv.v.repeat_interleave(2, 1))
    assert_close(out, want, atol=1e-5, rtol=1e-5)
    # the tokens of a block no head of a row chose are never read: changing them changes nothing
    for row in range(2):
        unread = sorted(set(range(6)) - set(top[row].flatten().tolist()))
        assert unread, "every block was chosen somewhere; pick another seed"
        k2, v2 = kv.k.clone(), kv.v.clone()
        for blk in unread:
            k2[row, :, blk * (L + 1): blk * (L + 1) + L] = 100.0
            v2[row, :, blk * (L + 1): blk * (L + 1) + L] = 100.0
        again = attn(q, KV(k2, v2, kv.pos, None), q_pos=q_pos, causal=True, memory=None, need_weights=False).out
        assert torch.equal(again, out)
        read = int(top[row, 0, 0, 0])
        k2[row, :, read * (L + 1)] = 100.0
        moved = attn(q, KV(k2, v2, kv.pos, None), q_pos=q_pos, causal=True, memory=None, need_weights=False).out
        assert not torch.allclose(moved[row], out[row])


def test_topk_of_many_queries_equals_the_restricted_formula():
    q, kv, q_pos = inputs(14, 14, seed=3)
    out = kernel(topk=1)(q, kv, q_pos=q_pos, causal=True, memory=None, need_weights=True)
    marks = kv.k.repeat_interleave(2, 1)[:, :, L::L + 1]
    scores = torch.einsum("bhid,bhnd->bhin", q, marks)
    chosen = [[[{int(scores[b, h, t, :t // (L + 1)].argmax())} if t >= L + 1 else set() for t in range(14)]
               for h in range(4)] for b in range(2)]
    assert_close(out.weights.double(), paper_weights(q, kv, q_pos, chosen), atol=1e-6, rtol=1e-5)


def stack_input(model: TransformerWrapper, x: torch.Tensor) -> torch.Tensor:
    """The token embeddings with the landmark embedding after every L tokens, built by hand."""
    h = model.token_emb(x)
    parts = []
    for start in range(0, x.shape[1], L):
        parts.append(h[:, start:start + L])
        if start + L <= x.shape[1]:
            parts.append(model.landmarks.embedding.expand(x.shape[0], 1, -1))
    return torch.cat(parts, 1)


def test_landmarks_are_placed_after_every_block_and_removed_from_the_logits():
    model = tiny_lm(landmark_block=L, rotary_pos_emb=True, seed=0)
    x = ids(2, 11)
    h = stack_input(model, x)                                              # 11 tokens + 3 landmarks
    out = model.attn_layers(h)
    tokens = torch.tensor([p % (L + 1) != L for p in range(h.shape[1])])
    assert_close(model(x), model.head(out[:, tokens]))
    assert model(x).shape == (2, 11, 64)
    state = model.new_state(2, 11)
    model(x, state=state)
    assert state.length == 11 + 11 // L
    loss = AutoregressiveWrapper(model)(ids(2, 12))
    assert loss.ndim == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("topk", [None, 1])
def test_causal(topk):
    model = tiny_lm(landmark_block=L, landmark_topk=topk, rotary_pos_emb=True, seed=1)
    x = ids(2, 16)
    out = model(x)
    for t in (2, 7, 12):
        y = x.clone()
        y[:, t + 1:] = (x[:, t + 1:] + 1) % 64
        out_y = model(y)
        assert_close(out_y[:, :t + 1], out[:, :t + 1])
        assert not torch.allclose(out_y[:, t + 1:], out[:, t + 1:])


@pytest.mark.parametrize("topk", [None, 1, 2])
def test_cached_steps_equal_the_uncached_forward(topk):
    model = tiny_lm(landmark_block=L, landmark_topk=topk, rotary_pos_emb=True, attn_kv_heads=2, seed=2)
    x = ids(2, 20)
    assert_close(stepped(model, x, 5, 17), model(x), atol=1e-5, rtol=1e-5)


def test_topk_covering_every_block_equals_the_full_model():
    full = tiny_lm(landmark_block=L, rotary_pos_emb=True, seed=3)
    covered = tiny_lm(landmark_block=L, landmark_topk=8, rotary_pos_emb=True, seed=4)
    covered.load_state_dict(full.state_dict())
    x = ids(2, 24)                                      # 8 blocks: 7 before the last token's
    assert_close(covered(x), full(x), atol=1e-5, rtol=1e-5)
    few = tiny_lm(landmark_block=L, landmark_topk=1, rotary_pos_emb=True, seed=5)
    few.load_state_dict(full.state_dict())
    assert not torch.allclose(few(x), full(x), atol=1e-4)


def test_left_padded_rows_equal_their_text_alone_cached_and_uncached():
    ar = AutoregressiveWrapper(tiny_lm(landmark_block=L, landmark_topk=2, rotary_pos_emb=True, seed=6))
    prompts = ids(3, 7)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, :3] = False
    mask[2, :5] = False
    cached = ar.generate(prompts, 9, temperature=0.0, mask=mask)
    assert torch.equal(cached, ar.generate(prompts, 9, temperature=0.0, mask=mask, cache_kv=False))
    for row, start in ((0, 0), (1, 3), (2, 5)):
        assert torch.equal(cached[row], ar.generate(prompts[row:row + 1, start:], 9, temperature=0.0)[0])


@pytest.mark.parametrize("keywords, named", [
    (dict(landmark_block=0), "landmark_block"),
    (dict(landmark_block=2.5), "landmark_block"),
    (dict(landmark_block=4, landmark_topk=0), "landmark_topk"),
    (dict(landmark_topk=2), "landmark_block"),
    (dict(landmark_block=4, attn_num_mem_kv=2), "attn_num_mem_kv"),
    (dict(landmark_block=4, alibi_pos_emb=True), "alibi_pos_emb"),
])
def test_bad_options_are_named(keywords, named):
    with pytest.raises((ValueError, TypeError), match=named):
        Decoder(dim=32, depth=1, heads=4, **keywords)


def test_bad_combinations_are_named():
    with pytest.raises(ValueError, match="landmark_block"):
        Encoder(dim=32, depth=1, heads=4, landmark_block=4)
    for wrap in (dict(num_memory_tokens=2), dict(max_mem_len=8)):
        with pytest.raises(ValueError, match="landmark_block|max_mem_len"):
            tiny_lm(landmark_block=4, **wrap)


def test_queries_in_chunks_equal_one_pass(monkeypatch):
    q, kv, q_pos = inputs(14, 14, seed=4)
    kv = KV(kv.k, kv.v, kv.pos, torch.ones(2, 14, dtype=torch.bool))     # a mask: the general (chunked) path
    for topk in (None, 1):
        attn = kernel(topk=topk)
        whole = attn(q, kv, q_pos=q_pos, causal=True, memory=None, need_weights=True).out
        monkeypatch.setattr(Landmark, "CHUNK", 4)
        assert_close(attn(q, kv, q_pos=q_pos, causal=True, memory=None, need_weights=False).out, whole)
        monkeypatch.undo()


@pytest.mark.parametrize("i, j", [(14, 14), (9, 14), (6, 16), (12, 12)])
@pytest.mark.parametrize("topk", [None, 1, 2])
def test_blockwise_forward_equals_the_grouped_softmax_without_scores(monkeypatch, i, j, topk):
    # keys at slots 0 .. j - 1 and more queries than a decode step: block by block, never the (i, j) scores
    q, kv, q_pos = inputs(i, j, seed=5)
    attn = kernel(topk=topk)
    want = attn(q, kv, q_pos=q_pos, causal=True, memory=None, need_weights=True)
    monkeypatch.setattr(Landmark, "grouped", lambda *a: pytest.fail("the forward built the full score matrix"))
    got = attn(q, kv, q_pos=q_pos, causal=True, memory=None, need_weights=False).out
    assert_close(got, want.out, atol=1e-6, rtol=1e-5)
    v = kv.v.repeat_interleave(2, 1)
    chosen = None
    if topk is not None:                                # the restricted formula, as in the tests above
        marks = kv.k.repeat_interleave(2, 1)[:, :, L::L + 1]
        scores = torch.einsum("bhid,bhnd->bhin", q, marks)
        chosen = [[[set(scores[b, h, t, :p // (L + 1)].topk(min(topk, p // (L + 1))).indices.tolist())
                    for t, p in enumerate(q_pos[0].tolist())] for h in range(4)] for b in range(2)]
    assert_close(got, torch.einsum("bhij,bhjd->bhid", paper_weights(q, kv, q_pos, chosen).float(), v),
                 atol=1e-5, rtol=1e-5)


def test_bfloat16_cached_steps_choose_the_blocks_of_the_full_forward():
    # one landmark layer: cached and uncached read the same bfloat16 q and k, so top-k picks alike and the logits
    # differ by rounding only (deeper layers may flip near-tied choices: docs/memories/landmark.md)
    model = tiny_lm(landmark_block=L, landmark_topk=2, rotary_pos_emb=True, attn_kv_heads=2, depth=1,
                    max_seq_len=128, seed=7).to(torch.bfloat16)
    x = ids(2, 60)
    assert (stepped(model, x, 5, dtype=torch.bfloat16).float() - model(x).float()).abs().max() < 0.05
