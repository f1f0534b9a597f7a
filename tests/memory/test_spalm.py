"""SPALM (arXiv:2102.02557): the logits equal the paper's equations computed per position; the gate's
extremes give the XL model alone or the long-term memory alone; the aggregation is a softmax of y_iᵀh
with no distance term; gradients reach W through m_t and never the keys or the key model; the training
text never retrieves its own neighbourhood; causality; cached decoding equals the full forward; named
errors; and on text whose duplicate the datastore holds, SPALM's loss falls far below the XL model's."""

import copy

import pytest
import torch

from polyformer import Decoder, TransformerWrapper, XLAutoregressiveWrapper
from polyformer.memory.datastore import Datastore, model_fingerprint
from polyformer.memory.knn_lm import build_datastore, forward_keys
from polyformer.memory.spalm import Spalm

VOCAB, SEQ, MEM = 64, 16, 16
STEPS = 100


def tiny(seed: int = 0, dim: int = 32, **kw) -> TransformerWrapper:
    torch.manual_seed(seed)
    kw = {"tie_embedding": True, "max_mem_len": MEM, **kw}
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=SEQ, **kw,
                              attn_layers=Decoder(dim=dim, depth=2, heads=2, rotary_pos_emb=True))


def stream(seed: int, n: int = 400) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def store(key_model: TransformerWrapper, tokens: torch.Tensor, key: str = "ffn_input") -> Datastore:
    return build_datastore(key_model, tokens, key=key, key_dtype="float32",
                           meta={"model": {"fingerprint": model_fingerprint(key_model)}})


def spalm(k: int = 4, dtype: torch.dtype = torch.float32, **kw) -> Spalm:
    net = tiny(0).to(dtype)
    key_model = tiny(1).to(dtype).eval()
    return Spalm(net, store(key_model, stream(7)), key_model, k=k, **kw).to(dtype)


def explicit_logits(model: Spalm, x: torch.Tensor) -> torch.Tensor:
    """The paper's equations position by position: brute-force neighbours of the key model's query,
    y_i = W[token_i], m = Σ softmax(y_iᵀh) y_i, g = σ(w_gᵀh + b), z = (1 - g) h + g m, logits W z."""
    W = model.net.token_emb.weight
    h = model.net(x, return_embeddings=True)
    q = forward_keys(model.key_model, x, model.key)[1]
    keys, values = model.datastore.keys.to(q.dtype), model.datastore.values
    out = torch.empty(*x.shape, VOCAB, dtype=h.dtype)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            near = ((keys - q[b, t]) ** 2).sum(-1).argsort()[:model.k]
            y = W[values[near]]                                       # (k, dim)
            a = torch.softmax(y @ h[b, t], dim=0)
            m = a @ y
            g = torch.sigmoid(model.gate.weight[0] @ h[b, t] + model.gate.bias[0])
            out[b, t] = W @ ((1 - g) * h[b, t] + g * m)
    return out


def test_logits_are_the_papers_equations_per_position_in_float64():
    model = spalm(dtype=torch.float64)
    torch.manual_seed(3)
    with torch.no_grad():
        model.gate.weight.normal_(std=3.0)
        model.gate.bias.fill_(0.3)
    x = stream(11, 2 * SEQ).view(2, SEQ)
    got = model.logits(x)
    torch.testing.assert_close(got, explicit_logits(model, x), atol=1e-10, rtol=0)
    g = torch.sigmoid(model.gate(model.net(x, return_embeddings=True)))
    assert g.std() > 0.1                       # the gate really varies across positions


def test_closed_gate_is_the_xl_model_and_open_gate_is_the_long_term_memory_alone():
    model = spalm()
    x = stream(12, 3 * SEQ + 1)[None]
    with torch.no_grad():
        model.gate.bias.fill_(-1e4)
    assert torch.equal(model.logits(x[:, :SEQ]), model.net(x[:, :SEQ]))
    assert torch.equal(model(x), XLAutoregressiveWrapper(model.net)(x))     # the segments carry XL memories
    with torch.no_grad():
        model.gate.bias.fill_(1e4)
    W = model.net.token_emb.weight
    h = model.net(x[:, :SEQ], return_embeddings=True)
    tokens, _ = model.neighbours(model.queries(x[:, :SEQ]))
    y = W[tokens]                                                                # (1, n, k, dim)
    m = (torch.softmax((y @ h[..., None])[..., 0], -1)[..., None] * y).sum(-2)
    torch.testing.assert_close(model.logits(x[:, :SEQ]), m @ W.T, atol=1e-5, rtol=1e-5)


def test_aggregation_is_a_softmax_of_embedding_scores_without_distances():
    model = spalm()
    W = model.net.token_emb.weight.detach()
    h = torch.randn(3, 32)
    tokens = torch.tensor([[5, 9, 2, -1], [7, 7, 1, 3], [-1, -1, -1, -1]])      # padding, a repeat, none found
    m = model.memory(h, tokens)
    for row in range(2):
        kept = tokens[row][tokens[row] >= 0]
        want = torch.softmax(W[kept] @ h[row], 0) @ W[kept]
        torch.testing.assert_close(m[row], want)
    assert torch.equal(m[2], torch.zeros(32))
    # the neighbours' rank (their distance order) does not enter: reversed, the same m
    torch.testing.assert_close(model.memory(h[1:2], tokens[1:2].flip(-1)), m[1:2])


def test_gradients_reach_the_word_embedding_through_m_and_never_the_keys():
    model = spalm()
    x = stream(13, 2 * SEQ + 1)[None]
    tokens, _ = model.neighbours(model.queries(x[:, :SEQ]))
    h = model.net(x[:, :SEQ], return_embeddings=True).detach()
    (grad,) = torch.autograd.grad(model.memory(h, tokens).square().sum(), model.net.token_emb.weight)
    touched = grad.abs().sum(-1) > 0
    assert touched.nonzero()[:, 0].tolist() == sorted(set(tokens.flatten().tolist()))
    model(x, starts=torch.tensor([0])).backward()
    assert model.gate.weight.grad.abs().sum() > 0 and model.net.token_emb.weight.grad.abs().sum() > 0
    assert not model.datastore.keys.requires_grad
    assert all(p.grad is None and not p.requires_grad for p in model.key_model.parameters())


def test_the_training_text_never_retrieves_its_own_neighbourhood():
    net, key_model = tiny(0), tiny(1).eval()
    text = stream(14, 8 * SEQ + 1)
    model = Spalm(net, store(key_model, text), key_model, k=4, exclude_radius=5)
    x = text[: 4 * SEQ].view(4, SEQ)                       # rows aligned with the datastore's windows
    starts = torch.arange(4) * SEQ
    q = model.queries(x)
    own = starts[:, None] + torch.arange(SEQ)
    _, leaked = model.neighbours(q)
    assert (leaked[..., 0] == own).float().mean() > 0.9    # unguarded, a stored context finds itself first
    _, ids = model.neighbours(q, own)
    assert (ids >= 0).all() and ((ids - own[..., None]).abs() > 5).all()
    tokens, _ = model.neighbours(q, own)
    logits = model.logits(x, starts=starts)
    with torch.no_grad():
        want = model.mix(model.net(x, return_embeddings=True), tokens)
    torch.testing.assert_close(logits, want)


def test_perturbing_a_later_token_never_changes_earlier_logits():
    model = spalm()
    x = stream(15, SEQ)[None]
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % VOCAB
    a, b = model.logits(x), model.logits(y)
    torch.testing.assert_close(a[:, :10], b[:, :10], atol=0, rtol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_cached_decoding_equals_the_full_forward():
    model = spalm().eval()
    x = stream(16, 2 * SEQ).view(2, SEQ)
    with torch.no_grad():
        model.gate.bias.fill_(0.5)
        full = model.logits(x)
    torch.testing.assert_close(model.stepwise_logits(x, 5), full[:, 4:], atol=1e-5, rtol=1e-5)
    out = model.generate(x[:, :5], 6, temperature=0.0)
    seq = torch.cat((x[:, :5], out), 1)
    with torch.no_grad():
        again = model.logits(seq[:, :-1])[:, 4:].argmax(-1)
    assert torch.equal(out, again)


def test_bad_input_fails_by_name():
    net, key_model = tiny(0), tiny(1).eval()
    ds = store(key_model, stream(7, 100))
    with pytest.raises(ValueError, match="Spalm k"):
        Spalm(net, ds, key_model, k=0)
    with pytest.raises(ValueError, match="tie_embedding"):
        Spalm(tiny(0, tie_embedding=False), ds, key_model)
    with pytest.raises(ValueError, match="dim 32.*has 48"):
        Spalm(net, ds, tiny(1, dim=48))
    with pytest.raises(ValueError, match="built with another model"):
        Spalm(net, ds, tiny(2).eval())                     # same shape, other weights: another fingerprint
    with pytest.raises(ValueError, match="records no model fingerprint"):
        Spalm(net, Datastore(ds.keys, ds.values), key_model)
    with pytest.raises(ValueError, match="key_model must be a frozen copy"):
        Spalm(net, ds, net)
    with pytest.raises(ValueError, match="starts"):
        Spalm(net, ds, key_model).logits(stream(1, 8)[None], starts=torch.tensor([0, 1]))


@pytest.mark.slow
def test_long_term_memory_beats_the_xl_model_on_held_out_text_the_datastore_holds():
    # random documents: those trained on appear twice, far apart; the held-out ones once, never trained on
    train_docs = [stream(1000 + d, 2 * SEQ + 1) for d in range(64)]
    held_docs = [stream(2000 + d, 2 * SEQ + 1) for d in range(8)]
    text = torch.cat([d[:-1] for d in train_docs + train_docs + held_docs] + [held_docs[0][:1]])
    key_model = tiny(1).eval()
    ds = store(key_model, text)
    train, held = torch.stack(train_docs), torch.stack(held_docs)       # (docs, 33): a document and one more token
    base_net = tiny(0)
    model = Spalm(copy.deepcopy(base_net), ds, key_model, k=2)
    base = XLAutoregressiveWrapper(base_net)
    losses = {}
    for name, fit, score, params in (
            ("spalm", lambda i: model(train[i], starts=i * 2 * SEQ), lambda: model(held), model.parameters()),
            ("base", lambda i: base(train[i]), lambda: base(held), base.parameters())):
        torch.manual_seed(0)
        opt = torch.optim.Adam([p for p in params if p.requires_grad], lr=3e-2)
        for _ in range(STEPS):
            opt.zero_grad()
            fit(torch.randperm(64)[:8]).backward()
            opt.step()
        with torch.no_grad():
            losses[name] = score().item()
    assert losses["spalm"] < losses["base"] - 1.5, losses
