"""Speculative decoding: greedy equals the target's own greedy output, sampled tokens follow the
target's exact distribution (Pearson chi-square), the counts it reports, bad input."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from polyformer import AutoregressiveWrapper, Encoder
from polyformer.generate import speculative
from polyformer.generate.sampling import top_k
from polyformer.generate.speculative import speculative_generate
from tests.helpers import ids, tiny_lm

SEQ_LEN = 12
ALPHA = 1e-3                      # significance of every chi-square check


def noisy_copy(net, sigma, seed):
    """The same model with noise (sigma times the weights' std) on its output projection: a draft
    whose argmax agrees part of the time."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(net)
    with torch.no_grad():
        w = draft.to_logits.weight
        w.add_(torch.randn_like(w) * sigma * w.std())
    return draft


def left_padded(batch=2, n=5, num_tokens=64):
    prompts = ids(batch, n, num_tokens)
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[1, :2] = False
    return prompts, mask


def greedy(net, prompts, seq_len, mask=None, **kwargs):
    return AutoregressiveWrapper(net).generate(prompts, seq_len, temperature=0.0, mask=mask, **kwargs)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = tiny_lm(depth=2)
    torch.manual_seed(1)
    unrelated = tiny_lm(depth=1)
    return {"self": target, "noisy": noisy_copy(target, 0.3, seed=2), "unrelated": unrelated}


# ---------------------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize("which", ["self", "noisy", "unrelated"])
def test_greedy_equals_target_greedy(models, which, gamma):
    target, draft = models["self"], models[which]
    prompts, mask = left_padded()
    out = speculative_generate(target, draft, prompts, SEQ_LEN, gamma=gamma, temperature=0.0, mask=mask)
    assert torch.equal(out.tokens, greedy(target, prompts, SEQ_LEN, mask))
    if which == "self":       # every draft accepted: gamma + 1 tokens per round, fewer in the last
        assert out.acceptance_rate == 1.0
        assert out.target_calls == 1 + math.ceil(SEQ_LEN / (gamma + 1))   # the prompt, then the rounds
    else:
        assert out.acceptance_rate < 1.0
    assert out.tokens_per_target_call == SEQ_LEN / out.target_calls


def test_drafts_span_acceptance(models):
    """The fixtures cover what they claim: a partly agreeing draft and a hardly agreeing one."""
    prompts, mask = left_padded()
    rate = {w: speculative_generate(models["self"], models[w], prompts, SEQ_LEN, gamma=3, temperature=0.0,
                                    mask=mask).acceptance_rate for w in ("noisy", "unrelated")}
    assert 0.2 < rate["noisy"] < 0.9 and rate["unrelated"] < rate["noisy"]


@pytest.mark.parametrize("option", [dict(rotary_pos_emb=True), dict(alibi_pos_emb=True),
                                    dict(num_memory_tokens=2), dict(shift_tokens=1), dict(attn_kv_heads=2),
                                    dict(attn_performer=True, attn_performer_chunk=2),
                                    dict(attn_rfa=True, attn_rfa_gate=True, attn_rfa_chunk=3)],
                         ids=["rotary", "alibi", "memory_tokens", "shift_tokens", "gqa", "performer", "rfa_gate"])
def test_greedy_equals_target_greedy_across_decoders(option):
    """Rollback must leave every kind of cached state (rotated keys, memory tokens, shifted inputs,
    recurrent summaries) valid."""
    target = tiny_lm(**option)
    draft = noisy_copy(target, 1.0, seed=3)
    prompts, mask = left_padded()
    out = speculative_generate(target, draft, prompts, SEQ_LEN, gamma=3, temperature=0.0, mask=mask)
    assert torch.equal(out.tokens, greedy(target, prompts, SEQ_LEN, mask))
    assert 0 < out.acceptance_rate < 1


def test_greedy_with_eos_and_wrappers(models):
    target = AutoregressiveWrapper(models["self"], pad_value=0)
    draft = AutoregressiveWrapper(models["noisy"])
    prompts, mask = left_padded()
    eos = int(greedy(models["self"], prompts, SEQ_LEN, mask)[0, 3])
    expected = greedy(models["self"], prompts, SEQ_LEN, mask, eos_token=eos)
    out = speculative_generate(target, draft, prompts, SEQ_LEN, gamma=3, temperature=0.0, mask=mask, eos_token=eos)
    assert torch.equal(out.tokens, expected)


def test_greedy_with_filter_and_short_outputs(models):
    prompts, mask = left_padded()
    for seq_len in (1, 2, 5):
        out = speculative_generate(models["self"], models["noisy"], prompts, seq_len, gamma=4, temperature=0.0,
                                   mask=mask, filter_logits_fn=top_k, filter_kwargs=dict(k=5))
        assert out.tokens.shape == (2, seq_len)
        assert torch.equal(out.tokens, greedy(models["self"], prompts, seq_len, mask))
        if seq_len == 1:      # the prompt's logits give the only token: nothing is proposed
            assert (out.target_calls, out.draft_calls, out.proposed) == (1, 1, 0)
            assert math.isnan(out.acceptance_rate)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_counts_match_an_independent_replay(models, gamma):
    """Replay greedy speculation from outputs alone: each round the draft's own greedy `generate`
    proposes k tokens per row, a row accepts the leading ones that equal the target's greedy tokens,
    the batch keeps the fewest, and a row's extra token counts as a draft if it accepted past them."""
    target, draft = models["self"], models["noisy"]
    prompts, mask = left_padded()
    b = prompts.shape[0]
    out = speculative_generate(target, draft, prompts, SEQ_LEN, gamma=gamma, temperature=0.0, mask=mask)
    ref = greedy(target, prompts, SEQ_LEN, mask)
    t = proposed = accepted = draft_calls = rounds = 0
    while t < SEQ_LEN:
        k = min(gamma, SEQ_LEN - t - 1)
        n = 0
        if k:
            prefix = torch.cat((prompts, ref[:, :t]), dim=1)
            guess = greedy(draft, prefix, k, F.pad(mask, (0, t), value=True))
            run = (guess == ref[:, t:t + k]).long().cumprod(dim=1).sum(dim=1)
            n = int(run.min())
            proposed += k * b
            accepted += int((n + (run > n).long()).sum())
            draft_calls += k - (rounds == 0)       # the first round's first step reuses the prompt's logits
        t += n + 1
        rounds += 1
    assert (out.proposed, out.accepted) == (proposed, accepted)
    assert out.acceptance_rate == accepted / proposed
    assert 0 < accepted < proposed
    assert out.target_calls == 1 + rounds
    assert out.draft_calls == 1 + draft_calls


# -------------------------------------------------------------------------------------- sampling

VOCAB = 8
PROMPT = torch.tensor([[3, 1, 4]])


def sharp_lm(seed):
    """A tiny model whose next-token distributions are far from uniform (logits scaled up)."""
    torch.manual_seed(seed)
    net = tiny_lm(num_tokens=VOCAB, depth=1, max_seq_len=16)
    with torch.no_grad():
        net.to_logits.weight.mul_(3.0)
    return net


def flattened(net, factor):
    """The same model with its logits multiplied by `factor`: a draft that mostly agrees."""
    draft = copy.deepcopy(net)
    with torch.no_grad():
        draft.to_logits.weight.mul_(factor)
        draft.to_logits.bias.mul_(factor)
    return draft


@torch.no_grad()
def exact_joint(net, steps, temperature=1.0, k=None):
    """The target's exact distribution over its next `steps` tokens after PROMPT, (VOCAB,) * steps,
    from uncached forwards over every continuation."""
    cont = torch.cartesian_prod(*[torch.arange(VOCAB)] * (steps - 1)).view(-1, steps - 1) if steps > 1 else \
        torch.zeros(1, 0, dtype=torch.long)
    logits = net(torch.cat((PROMPT.expand(cont.shape[0], -1), cont), dim=1))[:, PROMPT.shape[1] - 1:]
    if k is not None:
        logits = top_k(logits.reshape(-1, VOCAB), k=k).view(logits.shape)
    probs = (logits.double() / temperature).softmax(dim=-1)        # (VOCAB^(steps-1), steps, VOCAB)
    joint = torch.ones(())
    for i in range(steps):
        # p(t_i | t_<i) depends only on the first i continuation tokens: take the rows with later ones 0
        step = probs[:, i].view((VOCAB,) * (steps - 1) + (VOCAB,))
        index = (slice(None),) * i + (0,) * (steps - 1 - i)
        joint = joint[..., None] * step[index]
    return joint.double()


def chi_square_pvalue(samples, probs):
    """Pearson's test of token tuples (N, d) against probs (VOCAB,) * d."""
    counts = torch.zeros(VOCAB ** samples.shape[1], dtype=torch.float64)
    index = (samples * VOCAB ** torch.arange(samples.shape[1] - 1, -1, -1)).sum(dim=1)
    counts.index_add_(0, index, torch.ones(len(index), dtype=torch.float64))
    return chi_square_counts(counts, probs.reshape(-1))


def chi_square_counts(counts, probs):
    """Pearson's test of counts (cells,) against probs (cells,); cells expecting fewer than 5 are
    pooled into one. Outcomes of probability 0 must never occur."""
    counts, expected = counts.double(), probs.double() * counts.sum()
    assert counts[expected == 0].sum() == 0, "a token of probability 0 under the target was produced"
    small = expected < 5
    observed = torch.cat((counts[~small], counts[small].sum()[None]))
    expected = torch.cat((expected[~small], expected[small].sum()[None]))
    stat = ((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum()
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def marginal(joint, dims):
    drop = [d for d in range(joint.ndim) if d not in dims]
    return joint.sum(dim=drop) if drop else joint


def run_big_batch(temperature=1.0, k=None, rows=4000, seed=0):
    """One call, rows as independent samples: draft and target unrelated, so rounds mostly stop at
    the first draft and its accept / resample rule carries the test."""
    target, draft = sharp_lm(1), sharp_lm(2)
    generator = torch.Generator().manual_seed(seed)
    kwargs = dict(filter_logits_fn=top_k, filter_kwargs=dict(k=k)) if k is not None else {}
    out = speculative_generate(target, draft, PROMPT.expand(rows, -1), 2, gamma=2, temperature=temperature,
                               generator=generator, **kwargs)
    return out, exact_joint(target, 2, temperature, k)


def test_sampling_matches_target_distribution():
    out, joint = run_big_batch()
    assert 0.05 < out.acceptance_rate < 0.5            # the rule both accepts and rejects
    assert chi_square_pvalue(out.tokens[:, :1], marginal(joint, [0])) > ALPHA
    assert chi_square_pvalue(out.tokens, joint) > ALPHA


def test_sampling_matches_filtered_tempered_distribution():
    out, joint = run_big_batch(temperature=0.7, k=3)
    assert chi_square_pvalue(out.tokens, joint) > ALPHA


def test_sampling_matches_target_deep_in_a_round():
    """A draft that mostly agrees and small batches, so rounds keep several drafts and the bonus
    token: the joint of every pair of adjacent tokens follows the target."""
    target = sharp_lm(1)
    draft = flattened(target, 0.9)
    generator = torch.Generator().manual_seed(0)
    rows, calls, seq_len = 8, 250, 4
    results = [speculative_generate(target, draft, PROMPT.expand(rows, -1), seq_len, gamma=3, generator=generator)
               for _ in range(calls)]
    tokens = torch.cat([r.tokens for r in results])
    assert sum(r.target_calls for r in results) < calls * seq_len   # fewer than plain decoding needs
    joint = exact_joint(target, seq_len)
    for first in range(seq_len - 1):
        assert chi_square_pvalue(tokens[:, first:first + 2], marginal(joint, [first, first + 1])) > ALPHA


def test_verify_keeps_every_position_distributed_as_p():
    """The rule alone, one row at a time, fixed p_i / q_i per position: the token at position i of a
    round that reaches it (accepted draft, residual draw, or the bonus at i = k) follows p_i."""
    torch.manual_seed(0)
    v, k, rounds = 5, 3, 3000
    p = torch.softmax(torch.randn(1, k + 1, v) * 1.5, dim=-1)
    p[0, 1] = F.normalize(p[0, 1].masked_fill(torch.arange(v) == 0, 0.0), p=1, dim=0)   # a filtered token
    q = torch.softmax(torch.randn(1, k, v) * 1.5, dim=-1)
    generator = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q[0], rounds, replacement=True, generator=generator).T[:, None]   # (rounds, 1, k)
    done = torch.zeros(1, dtype=torch.bool)
    counts = torch.zeros(k + 1, v)
    for x in drafts:
        tokens, _ = speculative.verify(p, q, x, done, generator)
        counts[torch.arange(tokens.shape[1]), tokens[0]] += 1
    assert counts[k].sum() > 200                        # the bonus position is reached often enough
    for i in range(k + 1):
        assert chi_square_counts(counts[i], p[0, i]) > ALPHA


def always_accept(p, q, x, generator):
    return torch.ones_like(x, dtype=torch.bool)


def resample_from_target(p, q):
    return p


@pytest.mark.parametrize("part, wrong", [("accept_draft", always_accept), ("residual", resample_from_target)])
def test_chi_square_rejects_a_wrong_rule(monkeypatch, part, wrong):
    """The check has teeth: keeping every draft, or redrawing from p after a rejection instead of
    from norm(max(0, p - q)), leaves the target's distribution and fails it."""
    monkeypatch.setattr(speculative, part, wrong)
    out, joint = run_big_batch()
    assert chi_square_pvalue(out.tokens[:, :1], marginal(joint, [0])) < 1e-6


def test_sampling_is_reproducible_with_a_generator():
    a, _ = run_big_batch(rows=64, seed=5)
    b, _ = run_big_batch(rows=64, seed=5)
    assert torch.equal(a.tokens, b.tokens)


# ------------------------------------------------------------------------------------- bad input

def test_draft_with_another_vocabulary(models):
    draft = tiny_lm(num_tokens=32)
    with pytest.raises(ValueError, match=r"draft has num_tokens=32 but target has num_tokens=64"):
        speculative_generate(models["self"], draft, ids(n=3), 4)


@pytest.mark.parametrize("kwargs, name", [
    (dict(gamma=0), "gamma"), (dict(gamma=-2), "gamma"), (dict(gamma=1.5), "gamma"),
    (dict(seq_len=0), "seq_len"), (dict(seq_len=2.0), "seq_len"), (dict(temperature=-0.1), "temperature"),
    (dict(prompts=ids(n=33)), "prompts"), (dict(seq_len=31), "seq_len"),
    (dict(prompts=ids(n=3) + 64), "prompts"), (dict(mask=torch.ones(2, 4, dtype=torch.bool)), "mask"),
    (dict(filter_kwargs=dict(k=3)), "filter_kwargs"),
    (dict(filter_logits_fn=top_k, filter_kwargs=dict(k=0)), "top_k needs k"),
])
def test_bad_arguments_fail_before_any_compute(models, kwargs, name):
    target = models["self"]
    calls = []
    hook = target.register_forward_pre_hook(lambda *_: calls.append(1))
    args = dict(prompts=ids(n=3), seq_len=4) | kwargs
    try:
        with pytest.raises(ValueError, match=name):
            speculative_generate(target, models["noisy"], **args)
    finally:
        hook.remove()
    assert not calls


def test_bad_models(models):
    with pytest.raises(ValueError, match="draft needs a causal stack"):
        speculative_generate(models["self"], tiny_lm(stack=Encoder), ids(n=3), 4)
    with pytest.raises(TypeError, match="target must be a TransformerWrapper"):
        speculative_generate("model", models["self"], ids(n=3), 4)
    short = tiny_lm(max_seq_len=8)            # learned positions: 3 prompt tokens + 8 new need 10
    with pytest.raises(ValueError, match="seq_len=8 after 3 prompt tokens .* the draft's learned positions"):
        speculative_generate(models["self"], short, ids(n=3), 8)
