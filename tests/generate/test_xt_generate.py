"""x-transformers 2.x generation calls on polyformer (issue 24, "Calls"): list prompts, the filters
under both spellings and top_a, restrict_to_max_seq_len, contrastive decoding, beam_search().

x-transformers' own filter functions are the reference where both sides are deterministic."""

from __future__ import annotations

import math

import pytest
import torch
from x_transformers import autoregressive_wrapper as xt

from polyformer import AutoregressiveWrapper, Decoder, TransformerWrapper
from polyformer.generate.beam import beam_search
from polyformer.generate.contrastive import contrastive_logits, contrastive_steps
from polyformer.generate.sampling import min_p, top_a, top_k, top_p

VOCAB = 48
SEQ = 8          # max_seq_len, small so that generation outgrows it


def lm(seed: int = 0, dim: int = 16, depth: int = 2, vocab: int = VOCAB, **keywords) -> AutoregressiveWrapper:
    torch.manual_seed(seed)
    keywords = keywords or dict(rotary_pos_emb=True)
    use_abs = keywords.pop("use_abs_pos_emb", False)
    net = TransformerWrapper(num_tokens=vocab, max_seq_len=SEQ, use_abs_pos_emb=use_abs,
                             attn_layers=Decoder(dim=dim, depth=depth, heads=2, **keywords))
    for p in net.parameters():             # sharper logits than the default init, so greedy paths vary
        p.data.mul_(3.0)
    return AutoregressiveWrapper(net).eval()


def prompt(n: int, seed: int = 1, batch: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,) if batch is None else (batch, n), generator=g)


def recorder(log: list):
    def record(logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] > 1:            # not the (1, v) dry run that checks filters first
            log.append(logits.clone())
        return logits
    return record


@torch.no_grad()
def greedy_loop(step, seq: torch.Tensor, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Hand-written greedy decoding: step(seq (b, t)) -> next-token logits (b, v)."""
    logits_seen = []
    for _ in range(n):
        logits = step(seq)
        logits_seen.append(logits)
        seq = torch.cat((seq, logits.argmax(-1, keepdim=True)), dim=1)
    return seq[:, -n:], logits_seen


# ---------------------------------------------------------------------------------------- filters

LOGITS = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize("ours, theirs, kwargs", [
    (top_k, xt.top_k, {}), (top_k, xt.top_k, dict(k=7)), (top_k, xt.top_k, dict(frac_num_tokens=0.25)),
    (top_p, xt.top_p, {}), (top_p, xt.top_p, dict(thres=0.5)),
    (min_p, xt.min_p, {}), (min_p, xt.min_p, dict(min_p=0.3)),
    (top_a, xt.top_a, {}), (top_a, xt.top_a, dict(min_p_pow=1.0, min_p_ratio=0.2)),
])
def test_filters_equal_x_transformers(ours, theirs, kwargs):
    assert torch.equal(ours(LOGITS, **kwargs), theirs(LOGITS.clone(), **kwargs))


@pytest.mark.parametrize("fn, ours, theirs", [(top_p, "p", "thres"), (min_p, "p", "min_p")])
def test_both_spellings_write_one_setting(fn, ours, theirs):
    assert torch.equal(fn(LOGITS, **{ours: 0.4}), fn(LOGITS, **{theirs: 0.4}))
    assert not torch.equal(fn(LOGITS, **{ours: 0.4}), fn(LOGITS))
    with pytest.raises(ValueError, match=f"{ours} or {theirs}"):
        fn(LOGITS, **{ours: 0.4, theirs: 0.4})


@pytest.mark.parametrize("power, ratio", [(2.0, 0.02), (1.0, 0.3), (3.0, 0.9)])
def test_top_a_formula(power, ratio):
    probs = LOGITS.softmax(-1)
    keep = probs >= ratio * probs.amax(-1, keepdim=True) ** power
    out = top_a(LOGITS, min_p_pow=power, min_p_ratio=ratio)
    assert torch.equal(out.isfinite(), keep)
    assert torch.equal(out[keep], LOGITS[keep])


def test_top_a_tightens_with_confidence():
    """With p_max ** 2 the cut is relative to p_max squared: a flat distribution keeps everything."""
    flat = torch.zeros(1, VOCAB)
    peaked = flat.clone()
    peaked[0, 0] = 8.0
    assert bool(top_a(flat, min_p_ratio=0.5).isfinite().all())
    assert int(top_a(peaked, min_p_ratio=0.5).isfinite().sum()) == 1


def test_top_k_and_top_p_formulas():
    kept = top_k(LOGITS).isfinite()                    # default: ceil(0.1 * 48) = 5
    assert bool((kept.sum(-1) == math.ceil(0.1 * VOCAB)).all())
    assert torch.equal(kept, LOGITS >= LOGITS.topk(5, dim=-1).values[:, -1:])
    probs = LOGITS.softmax(-1)
    kept = top_p(LOGITS, thres=0.7).isfinite()
    mass = (probs * kept).sum(-1)
    smallest = probs.masked_fill(~kept, 2).amin(-1)
    assert bool((mass >= 0.7).all()) and bool((mass - smallest < 0.7).all())


@pytest.mark.parametrize("name, kwargs", [("top_k", dict(k=1)), ("top_a", dict(min_p_pow=1.0, min_p_ratio=1.0)),
                                          ("min_p", dict(min_p=1.0)), ("top_p", dict(thres=1e-6))])
def test_filters_by_name_in_generate(name, kwargs):
    """Each filter by name, set to keep only the most likely token, samples the greedy tokens."""
    model, x = lm(), prompt(4, batch=2)
    greedy = model.generate(x, 6, temperature=0)
    assert torch.equal(model.generate(x, 6, filter_logits_fn=name, filter_kwargs=kwargs), greedy)


@pytest.mark.parametrize("fn, kwargs, word", [("top_k", dict(thres=0.9), "thres"), ("top_p", dict(p=0.9, k=3), "'k'"),
                                              (top_a, dict(ratio=0.1), "ratio"), ("top_z", {}, "top_z")])
def test_unknown_filter_keywords_refused(fn, kwargs, word):
    with pytest.raises((TypeError, ValueError), match=word):
        lm().generate(prompt(3, batch=1), 2, filter_logits_fn=fn, filter_kwargs=kwargs)


# ----------------------------------------------------------------------------------- list prompts

@pytest.mark.parametrize("keywords", [dict(rotary_pos_emb=True), dict(use_abs_pos_emb=True)])
def test_list_prompts_equal_per_row_generation(keywords):
    model = lm(**keywords)
    prompts = [prompt(n, seed=n) for n in (2, 5, 3)]
    out = model.generate(prompts, 5, temperature=0)
    assert out.shape == (3, 5)                  # what x-transformers returns: the new tokens only
    for row, p in zip(out, prompts):
        alone = model.generate(p, 5, temperature=0)
        assert alone.shape == (5,)              # one (n,) prompt -> (seq_len,)
        assert torch.equal(row, alone)
    right_padded = torch.stack([torch.nn.functional.pad(p, (0, 5 - len(p)), value=7) for p in prompts])
    by_lens = model.generate(right_padded, 5, temperature=0, prompt_lens=torch.tensor([2, 5, 3]))
    assert torch.equal(by_lens, out)


def test_list_prompts_refusals():
    model = lm()
    with pytest.raises(ValueError, match="empty list"):
        model.generate([], 3)
    with pytest.raises(ValueError, match="prompt_lens"):
        model.generate([prompt(2)], 3, prompt_lens=torch.tensor([2]))
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        model.generate([prompt(2), prompt(2, batch=1)], 3)


# ------------------------------------------------------------------------- restrict_to_max_seq_len

@pytest.mark.parametrize("cache_kv", [True, False])
def test_restrict_keeps_exactly_the_last_max_seq_len_tokens(cache_kv):
    """True: every step sees exactly the last max_seq_len tokens (one layer, so a slid cache holds
    the same keys as a recomputation of the window)."""
    model, x = lm(depth=1 if cache_kv else 2), prompt(5, batch=2)
    log: list = []
    out = model.generate(x, 12, temperature=0, filter_logits_fn=recorder(log), restrict_to_max_seq_len=True,
                         cache_kv=cache_kv)
    ref, ref_logits = greedy_loop(lambda seq: model.net(seq[:, -SEQ:])[:, -1], x, 12)
    assert torch.equal(out, ref)
    torch.testing.assert_close(torch.stack(log), torch.stack(ref_logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_kv", [True, False])
def test_restrict_false_keeps_every_token(cache_kv):
    model, x = lm(), prompt(5, batch=2)
    log: list = []
    out = model.generate(x, 12, temperature=0, filter_logits_fn=recorder(log), restrict_to_max_seq_len=False,
                         cache_kv=cache_kv)
    ref, ref_logits = greedy_loop(lambda seq: model.net(seq)[:, -1], x, 12)
    windowed, _ = greedy_loop(lambda seq: model.net(seq[:, -SEQ:])[:, -1], x, 12)
    assert torch.equal(out, ref) and not torch.equal(ref, windowed)
    torch.testing.assert_close(torch.stack(log), torch.stack(ref_logits), atol=1e-4, rtol=1e-4)


def test_restrict_with_learned_positions():
    model, x = lm(use_abs_pos_emb=True), prompt(11, batch=2)     # a prompt longer than max_seq_len
    out = model.generate(x, 6, temperature=0, restrict_to_max_seq_len=True, cache_kv=False)
    ref, _ = greedy_loop(lambda seq: model.net(seq[:, -SEQ:])[:, -1], x, 6)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="restrict_to_max_seq_len=True with cache_kv=True"):
        model.generate(x, 6, restrict_to_max_seq_len=True)
    with pytest.raises(ValueError, match="restrict_to_max_seq_len=False"):
        model.generate(x[:, :4], 6, restrict_to_max_seq_len=False)
    model.generate(x[:, :4], 5, restrict_to_max_seq_len=False)             # 8 positions: fits
    with pytest.raises(ValueError, match="restrict_to_max_seq_len"):
        lm().generate(x, 3, restrict_to_max_seq_len=True, state=lm().new_state(2, 20))
    with pytest.raises(TypeError, match="restrict_to_max_seq_len"):
        lm().generate(x, 3, restrict_to_max_seq_len="yes")


# -------------------------------------------------------------------------- contrastive decoding

@pytest.mark.parametrize("alpha, beta", [(0.1, 0.5), (0.02, 1.0), (0.5, 0.0)])
def test_contrastive_logits_formula(alpha, beta):
    expert, amateur = LOGITS, torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    out = contrastive_logits(expert, amateur, alpha=alpha, beta=beta)
    probs = expert.softmax(-1)
    plausible = probs >= alpha * probs.amax(-1, keepdim=True)
    assert torch.equal(out.isfinite(), plausible)
    torch.testing.assert_close(out[plausible], ((1 + beta) * expert - beta * amateur)[plausible])
    theirs = xt.contrastive_decode_fn(expert, amateur, alpha=alpha, beta=beta)
    assert torch.equal(theirs > -torch.finfo(theirs.dtype).max, plausible)
    torch.testing.assert_close(out[plausible], theirs[plausible])


def test_contrastive_step_logits_on_own_decode_states():
    expert, amateur = lm(seed=0), lm(seed=5, dim=8, depth=1)
    x = prompt(4, batch=2)
    steps = contrastive_steps(expert._steps(x, None, 6, None, None), [amateur._steps(x, None, 6, None, None)],
                              [dict(alpha=0.1, beta=0.5)])
    seq, logits = x, next(steps)
    for _ in range(5):
        want = contrastive_logits(expert.net(seq)[:, -1], amateur.net(seq)[:, -1], alpha=0.1, beta=0.5)
        assert torch.equal(logits.isfinite(), want.isfinite())
        torch.testing.assert_close(logits[want.isfinite()], want[want.isfinite()], atol=1e-4, rtol=1e-4)
        token = torch.randint(0, VOCAB, (2,))               # any token: the states follow what is sent
        seq = torch.cat((seq, token[:, None]), dim=1)
        logits = steps.send(token)


@pytest.mark.parametrize("amateurs, kwargs", [(1, dict(alpha=0.2, beta=0.8)), (2, [dict(beta=0.3), dict(alpha=0.05)])])
def test_contrastive_greedy_equals_hand_loop(amateurs, kwargs):
    expert = lm(seed=0)
    others = [lm(seed=5 + i, dim=8, depth=1) for i in range(amateurs)]
    options = kwargs if isinstance(kwargs, list) else [kwargs]
    x = prompt(3, batch=2)

    def step(seq):
        logits = expert.net(seq)[:, -1]
        for other, kw in zip(others, options):
            logits = contrastive_logits(logits, other.net(seq)[:, -1], **{"alpha": 0.1, "beta": 0.5, **kw})
        return logits

    ref, _ = greedy_loop(step, x, SEQ - 2)             # within max_seq_len: no context limit applies
    amateur_model = others[0] if amateurs == 1 else tuple(others)
    out = expert.generate(x, SEQ - 2, temperature=0, amateur_model=amateur_model, contrastive_decode_kwargs=kwargs)
    assert torch.equal(out, ref)
    plain = expert.generate(x, SEQ - 2, temperature=0)
    assert not torch.equal(out, plain)


@pytest.mark.parametrize("kwargs, error, word", [
    (dict(contrastive_decode_kwargs=dict(beta=-0.1)), ValueError, "beta"),
    (dict(contrastive_decode_kwargs=dict(alpha=0.0)), ValueError, "alpha"),
    (dict(contrastive_decode_kwargs=dict(gamma=1.0)), TypeError, "gamma"),
    (dict(contrastive_decode_kwargs=[{}, {}]), ValueError, "one dict per amateur_model"),
    (dict(filter_logits_fn="top_k"), ValueError, "filter_logits_fn"),
])
def test_contrastive_refusals(kwargs, error, word):
    with pytest.raises(error, match=word):
        lm().generate(prompt(3, batch=1), 2, amateur_model=lm(seed=1, dim=8, depth=1), **kwargs)


def test_contrastive_refuses_another_vocabulary_or_no_amateur():
    with pytest.raises(ValueError, match="vocabulary"):
        lm().generate(prompt(3, batch=1), 2, amateur_model=lm(seed=1, vocab=VOCAB + 1).net)
    with pytest.raises(ValueError, match="amateur_model"):
        lm().generate(prompt(3, batch=1), 2, contrastive_decode_kwargs=dict(beta=0.5))


# ------------------------------------------------------------------------------------ beam_search

def test_beam_search_method_equals_function():
    model, x = lm(), prompt(4, batch=2)
    hypotheses, scores = model.beam_search(x, 5, beams=3, return_beams_and_scores=True)
    result = beam_search(model, x, 5, 3, length_penalty=0.0)
    assert hypotheses.shape == (3, 2, 5) and scores.shape == (3, 2)      # x-transformers: beams first
    assert torch.equal(hypotheses, result.beams.transpose(0, 1))
    assert torch.equal(scores, result.beam_scores.transpose(0, 1))
    assert torch.equal(model.beam_search(x, 5, beams=3), result.tokens)
    for j in range(3):                   # scores are summed log-probabilities, as x-transformers returns
        seq = torch.cat((x, hypotheses[j]), dim=1)
        logprobs = model.net(seq[:, :-1]).log_softmax(-1)[:, -5:]
        torch.testing.assert_close(logprobs.gather(-1, hypotheses[j][..., None]).sum((1, 2)), scores[j],
                                   atol=1e-4, rtol=1e-4)
    single = model.beam_search(x[0], 5, beams=3, eos_token=3)
    assert torch.equal(single, beam_search(model, x[:1], 5, 3, eos_token=3, length_penalty=0.0).tokens[0])


@pytest.mark.parametrize("kwargs, word", [(dict(stochastic=True), "stochastic"), (dict(temperature=0.5), "temperature"),
                                          (dict(filter_logits_fn="top_k"), "filter_logits_fn"),
                                          (dict(cache_kv=False), "cache_kv"),
                                          (dict(restrict_to_max_seq_len=True), "restrict_to_max_seq_len")])
def test_beam_search_refusals(kwargs, word):
    with pytest.raises(ValueError, match=word):
        lm().beam_search(prompt(6, batch=1), 5, **kwargs)


# ------------------------------------------------ README / examples, with the import changed

def test_x_transformers_readme_generate_calls():
    """The x-transformers README's XL generate block and its examples' generate calls (train_enwik8:
    one 1-D prime, cache_kv=True), with `x_transformers` -> `polyformer` and our sizes."""
    from polyformer import XLAutoregressiveWrapper

    model_xl = TransformerWrapper(num_tokens=VOCAB, max_seq_len=SEQ, max_mem_len=2 * SEQ,
                                  attn_layers=Decoder(dim=16, depth=2, heads=2, rel_pos_bias=True))
    xl_wrapper = XLAutoregressiveWrapper(model_xl)
    seg = torch.randint(0, VOCAB, (1, 4 * SEQ))
    loss = xl_wrapper(seg)
    loss.backward()
    prime = seg[:, :2 * SEQ]
    torch.manual_seed(0)
    generated = xl_wrapper.generate(prime, 3 * SEQ)
    assert generated.shape == (1, 3 * SEQ)
    torch.manual_seed(0)
    assert torch.equal(xl_wrapper.generate(prime, 3 * SEQ), generated)

    model = lm()
    inp = prompt(5)
    sample = model.generate(prompts=inp, seq_len=SEQ - 5, cache_kv=True, temperature=0)
    assert sample.shape == (SEQ - 5,)
    assert torch.equal(sample, model.generate(prompts=inp, seq_len=SEQ - 5, cache_kv=False, temperature=0))
    sample = model.generate(inp, 4, filter_logits_fn=xt.top_p.__name__, filter_kwargs=dict(thres=0.9))
    assert sample.shape == (4,) and bool(((sample >= 0) & (sample < VOCAB)).all())


def test_restrict_refused_where_a_cache_cannot_forget():
    """A recurrent summary (Infini-attention) cannot drop old tokens: True with a cache is refused
    once the sequence outgrows max_seq_len, and runs by recomputing the window."""
    model, x = lm(depth=1, attn_infini=True), prompt(5, batch=1)
    with pytest.raises(ValueError, match="recurrent summary"):
        model.generate(x, 6, restrict_to_max_seq_len=True)
    model.generate(x, 3, restrict_to_max_seq_len=True)          # 7 positions: nothing to drop
    out = model.generate(x, 6, temperature=0, restrict_to_max_seq_len=True, cache_kv=False)
    assert torch.equal(out, greedy_loop(lambda seq: model.net(seq[:, -SEQ:])[:, -1], x, 6)[0])
