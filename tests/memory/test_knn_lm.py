"""kNN-LM (arXiv:1911.00172): the interpolation equals its formula, λ = 0 is the LM (scores and
generation), a stored context retrieves its own entry, text the datastore holds gets a far lower
perplexity, cached generation equals recomputing, and a datastore on disk refuses another model or
tokenizer and any damaged file."""

import math

import pytest
import torch
import torch.nn.functional as F

from polyformer import Decoder, TransformerWrapper
from polyformer.generate.decode import AutoregressiveWrapper
from polyformer.memory.datastore import Datastore, model_fingerprint
from polyformer.memory.knn_lm import (KnnLM, build_datastore, forward_keys, interpolate, knn_log_probs,
                                      sliding_windows)
from polyformer.memory.vector_index import IndexSpec, have_faiss
from polyformer.train.scoring import windows

needs_faiss = pytest.mark.skipif(not have_faiss(), reason="faiss-cpu not installed")
VOCAB, SEQ = 64, 32


def tiny(seed: int = 0, **kw) -> TransformerWrapper:
    torch.manual_seed(seed)
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=SEQ,
                              attn_layers=Decoder(dim=32, depth=2, heads=2, **kw)).eval()


def stream(seed: int, n: int = 600) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_aggregation_is_the_formula_on_a_hand_example():
    d = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    tokens = torch.tensor([[2, 2, 0, -1]])            # the last neighbour is padding
    got = knn_log_probs(d, tokens, vocab=4, temperature=2.0)
    w = [math.exp(-1.0 / 2), math.exp(-2.0 / 2), math.exp(-3.0 / 2)]
    z = sum(w)
    assert got[0, 2].item() == pytest.approx(math.log((w[0] + w[1]) / z), abs=1e-6)
    assert got[0, 0].item() == pytest.approx(math.log(w[2] / z), abs=1e-6)
    assert got[0, 1].item() == -math.inf and got[0, 3].item() == -math.inf
    lm = torch.log_softmax(torch.tensor([[0.3, -1.0, 2.0, 0.1]]), -1)
    mixed = interpolate(lm, got, 0.3)
    want = torch.log(0.3 * got.exp() + 0.7 * lm.exp())
    torch.testing.assert_close(mixed, want, atol=1e-6, rtol=0)
    assert torch.equal(interpolate(lm, got, 0.0), lm) and torch.equal(interpolate(lm, got, 1.0), got)


def test_far_apart_logits_stay_finite_in_log_space():
    d = torch.tensor([[1e4, 1e4 + 1.0]])              # exp(-d) underflows in float32
    got = knn_log_probs(d, torch.tensor([[1, 3]]), vocab=4, temperature=1.0)
    assert got[0, 1].item() == pytest.approx(math.log(1 / (1 + math.exp(-1))), abs=1e-5)
    lm = torch.full((1, 4), -200.0)
    assert torch.isfinite(interpolate(lm, got, 0.5)[0, [1, 3]]).all()


def test_ffn_input_key_is_the_normed_input_of_the_last_feedforward():
    net = tiny()
    x = stream(1, 20)[None]
    logits, keys = forward_keys(net, x, "ffn_input")
    _, record = net(x, return_intermediates=True)
    last = net.attn_layers.blocks[-1]
    assert last.kind == "f"
    torch.testing.assert_close(keys, last.norm_in(record.hiddens[-2]))
    torch.testing.assert_close(logits, net(x))
    logits, final = forward_keys(net, x, "final")
    torch.testing.assert_close(final, net(x, return_embeddings=True))


def test_sliding_windows_score_every_target_once():
    tokens = stream(2, 101)
    assert [w.tolist() for w, _ in sliding_windows(tokens, 8)] == [w.tolist() for w in windows(tokens, 8)]
    for stride in (1, 3, 8):
        targets = []
        for w, skip in sliding_windows(tokens, 8, stride):
            start = next(s for s in range(101) if tokens[s: s + w.numel()].equal(w))
            targets += list(range(start + 1 + skip, start + w.numel()))
            assert skip == 0 or w.numel() - 1 - skip <= stride   # a later window adds at most `stride` targets
        assert targets == list(range(1, 101))


def test_lambda_zero_is_the_lm():
    net = tiny()
    tokens = stream(3)
    store = build_datastore(net, tokens, key_dtype="float32")
    knn = KnnLM(net, store, lam=0.0, k=8)
    x = tokens[None, :SEQ]
    torch.testing.assert_close(knn.log_probs(x), torch.log_softmax(net(x).float(), -1), atol=1e-6, rtol=0)
    total = sum(F.cross_entropy(net(w[None, :-1])[0], w[1:], reduction="sum").item() for w in windows(tokens, SEQ))
    result = knn.score(tokens, batch_size=4)
    assert result["count"] == tokens.numel() - 1
    assert result["loss"] == result["lm_loss"] == pytest.approx(total / (tokens.numel() - 1), rel=1e-6)


@pytest.mark.parametrize("key_dtype", ["float32", "float16"])
def test_a_stored_context_retrieves_its_own_entry_first(key_dtype):
    net = tiny()
    tokens = stream(4)
    store = build_datastore(net, tokens, stride=16, key_dtype=key_dtype)
    assert len(store) == tokens.numel() - 1
    # entry i: the context ending at token i, then token i + 1; with stride 16, the window starting at
    # 16 m (m >= 1) made the entries of its last 16 positions
    for start in (0, 16 * 12, 16 * 30):
        _, keys = forward_keys(net, tokens[None, start: start + SEQ], store.meta["key"])
        rows = torch.arange(16 if start else 4, SEQ)        # at start 0, contexts of 5+ random tokens: unique
        distances, nexts, ids = store.search(keys[0, rows], k=3)
        assert torch.equal(ids[:, 0], rows + start)
        assert torch.equal(nexts[:, 0], tokens[rows + start + 1])
        assert (distances[:, 0] < distances[:, 1]).all()


def test_a_later_token_moves_no_earlier_distribution():
    net = tiny()
    knn = KnnLM(net, build_datastore(net, stream(12, 300), key_dtype="float32"), lam=0.6, k=8, temperature=10.0)
    x = stream(15, SEQ)[None]                                    # unseen text, a soft p_kNN: every key counts
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 1) % VOCAB
    got, moved = knn.log_probs(x), knn.log_probs(y)
    torch.testing.assert_close(got[:, :20], moved[:, :20])
    assert not torch.allclose(got[:, 20:], moved[:, 20:])


@pytest.mark.parametrize("stride", [None, 8])
def test_score_is_the_mean_of_each_windows_interpolated_targets(stride):
    net = tiny()
    tokens = stream(13, 200)
    knn = KnnLM(net, build_datastore(net, stream(14, 300)), lam=0.4, k=8)
    nll, lm_nll, count = 0.0, 0.0, 0
    for w, skip in sliding_windows(tokens, SEQ, stride):               # one window at a time, the explicit way
        target = w[None, 1 + skip:, None]
        nll -= knn.log_probs(w[None, :-1])[:, skip:].gather(-1, target).sum().item()
        lm_nll -= torch.log_softmax(net(w[None, :-1])[:, skip:], -1).gather(-1, target).sum().item()
        count += target.numel()
    result = knn.score(tokens, stride=stride, batch_size=3)
    assert result["count"] == count == tokens.numel() - 1
    assert result["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert result["lm_loss"] == pytest.approx(lm_nll / count, rel=1e-5)
    assert result["loss"] != pytest.approx(result["lm_loss"], rel=1e-3)


def test_the_datastore_memorises_its_text_and_not_other_text():
    net = tiny()
    seen, unseen = stream(5, 800), stream(6, 800)
    store = build_datastore(net, seen)
    knn = KnnLM(net, store, lam=0.25, k=32)
    on_seen, on_unseen = knn.score(seen), knn.score(unseen)
    assert math.exp(on_seen["loss"]) < 0.3 * math.exp(on_seen["lm_loss"])      # large and unambiguous
    assert on_unseen["loss"] > on_unseen["lm_loss"] - 0.05                       # no gain on text it never held


def test_cached_generation_equals_recomputed_and_lambda_zero_equals_the_lm():
    net = tiny(rotary_pos_emb=True)
    store = build_datastore(net, stream(7, 300))
    prompt = stream(7, 300)[None, 10:15]
    greedy = AutoregressiveWrapper(net).generate(prompt, 12, temperature=0.0)
    assert torch.equal(KnnLM(net, store, lam=0.0, k=8).generate(prompt, 12, temperature=0.0), greedy)
    knn = KnnLM(net, store, lam=0.6, k=8)
    got = knn.generate(prompt, 40, temperature=0.0)            # runs past max_seq_len: the state slides
    seq = prompt
    for _ in range(12):                                           # recomputed on the whole text (within the window)
        seq = torch.cat((seq, knn.log_probs(seq)[:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(got[:, :12], seq[:, 5:])
    assert not torch.equal(got[:, :12], greedy)                 # the datastore changed what was chosen


def test_generation_past_learned_positions_recomputes_the_window_as_the_lm_does():
    net = tiny()                                                 # learned absolute positions: bounded
    store = build_datastore(net, stream(11, 300))
    prompt = stream(11, 300)[None, :20]
    greedy = AutoregressiveWrapper(net).generate(prompt, 30, temperature=0.0)
    assert torch.equal(KnnLM(net, store, lam=0.0, k=8).generate(prompt, 30, temperature=0.0), greedy)
    knn = KnnLM(net, store, lam=0.6, k=8)
    seq = prompt
    for _ in range(30):
        seq = torch.cat((seq, knn.log_probs(seq[:, -SEQ:])[:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(knn.generate(prompt, 30, temperature=0.0), seq[:, 20:])


def test_bad_knn_settings_are_refused_by_name():
    net = tiny()
    store = build_datastore(net, stream(8, 100))
    for kwargs, name in (({"lam": 1.5}, "lambda"), ({"lam": -0.1}, "lambda"), ({"k": 0}, "k must"),
                         ({"temperature": 0.0}, "temperature"), ({"key": "attn"}, "key")):
        with pytest.raises(ValueError, match=name):
            KnnLM(net, store, **kwargs)
    with pytest.raises(ValueError, match="k must"):
        store.search(torch.zeros(1, 32), 0)
    with pytest.raises(ValueError, match="key dtype"):
        build_datastore(net, stream(8, 100), key_dtype="int8")


def test_saved_datastore_refuses_another_model_tokenizer_or_damage(tmp_path):
    net = tiny()
    store = build_datastore(net, stream(9, 300),
                            meta={"model": {"fingerprint": model_fingerprint(net), "source": "run A"},
                                  "tokenizer": {"fingerprint": "tok-a", "source": "A/tokenizer.json"}})
    out = store.save(tmp_path / "ds")
    back = Datastore.load(out, model=model_fingerprint(net), tokenizer="tok-a")
    q = torch.randn(5, 32)
    assert all(torch.equal(a, b) for a, b in zip(store.search(q, 4), back.search(q, 4)))
    with pytest.raises(ValueError, match="another model"):
        Datastore.load(out, model=model_fingerprint(tiny(seed=1)), tokenizer="tok-a")
    with pytest.raises(ValueError, match="another tokenizer"):
        Datastore.load(out, model=model_fingerprint(net), tokenizer="tok-b")
    with pytest.raises(FileExistsError):
        store.save(out)                                      # nothing overwritten
    keys = out / "keys.safetensors"
    data = keys.read_bytes()
    keys.write_bytes(data[:-10])
    with pytest.raises(ValueError, match="corrupted: keys.safetensors has .* bytes"):
        Datastore.load(out)
    keys.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ValueError, match="keys.safetensors does not match its sha256"):
        Datastore.load(out)
    keys.write_bytes(data)
    Datastore.load(out)                                  # whole again
    (out / "values.safetensors").unlink()
    with pytest.raises(ValueError, match="values.safetensors is missing"):
        Datastore.load(out)


@needs_faiss
@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_indexes_mostly_agree_with_exact_and_round_trip(kind, tmp_path):
    net = tiny()
    tokens = stream(10, 1200)
    exact = build_datastore(net, tokens, key_dtype="float32")
    approx = Datastore(exact.keys, exact.values, IndexSpec(kind=kind, train_size=256, nprobe=4))
    q = exact.keys[::7].float()
    agree = (approx.search(q, 1)[2][:, 0] == exact.search(q, 1)[2][:, 0]).float().mean()
    assert agree > 0.9
    back = Datastore.load(approx.save(tmp_path / kind))
    assert torch.equal(back.search(q, 5)[2], approx.search(q, 5)[2])
