"""DPO (arXiv:2305.18290): the loss against eq. 7 computed by hand in float64, log 2 at the start, the
gradient's direction, the frozen reference, and which tokens count."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import DPO, AutoregressiveWrapper
from tests.helpers import ids, tiny_encoder, tiny_lm

V, PAD = 32, 0


def pair(seed: int = 0):
    """Two right-padded rows: prompt of 3 / 2 tokens, responses, then padding."""
    w, l = ids(2, 9, num_tokens=V - 1, seed=seed) + 1, ids(2, 9, num_tokens=V - 1, seed=seed + 1) + 1
    w[:, :3] = l[:, :3]                             # one prompt, two responses
    w[0, 7:], l[0, 6:], l[1, 8:] = PAD, PAD, PAD
    prompt = torch.zeros(2, 9, dtype=torch.bool)
    prompt[0, :3], prompt[1, :2] = True, True
    return w, l, prompt


def nudged(dpo: DPO, seed: int = 1) -> DPO:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in dpo.policy_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return dpo


def seq_log_prob(net, seq, counted, mean):
    logp = net(seq[:, :-1]).double().log_softmax(-1)
    total = torch.zeros(seq.shape[0], dtype=torch.float64)
    for b in range(seq.shape[0]):
        terms = [logp[b, t - 1, seq[b, t]] for t in range(1, seq.shape[1]) if counted[b, t]]
        total[b] = sum(terms) / (len(terms) if mean else 1)
    return total


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_loss_is_equation_7(reduction):
    dpo = nudged(DPO(tiny_lm(seed=0, num_tokens=V), beta=0.3, pad_id=PAD, reduction=reduction))
    w, l, prompt = pair()
    cw, cl = (w != PAD) & ~prompt, (l != PAD) & ~prompt
    mean = reduction == "mean"
    pol = [seq_log_prob(dpo.policy_model, s, c, mean) for s, c in ((w, cw), (l, cl))]
    ref = [seq_log_prob(dpo.ref_model, s, c, mean) for s, c in ((w, cw), (l, cl))]
    want = -F.logsigmoid(0.3 * ((pol[0] - ref[0]) - (pol[1] - ref[1]))).mean()
    assert_close(dpo(w, l, prompt_mask=prompt).double(), want, rtol=1e-5, atol=1e-6)
    # explicit masks in place of pad_id give the same
    assert_close(dpo(w, l, prompt_mask=prompt, preferred_seq_mask=w != PAD, unpreferred_seq_mask=l != PAD).double(),
                 want, rtol=1e-5, atol=1e-6)


def test_starts_at_log_2_and_tokens_past_the_response_do_not_count():
    dpo = DPO(tiny_lm(seed=0, num_tokens=V), pad_id=PAD)
    w, l, prompt = pair()
    assert_close(dpo(w, l, prompt_mask=prompt), torch.tensor(math.log(2)))
    nudged(dpo)
    loss = dpo(w, l, prompt_mask=prompt)
    kept_w, kept_l = w != PAD, l != PAD
    w2, l2 = w.clone(), l.clone()
    w2[0, 8], l2[0, 7] = 5, 6          # past the kept tokens: what stands there is never counted
    assert_close(dpo(w2, l2, prompt_mask=prompt, preferred_seq_mask=kept_w, unpreferred_seq_mask=kept_l), loss)
    assert not torch.allclose(dpo(w2, l2, prompt_mask=prompt), loss)      # with pad_id alone they count
    without_pad = DPO(tiny_lm(seed=0, num_tokens=V))          # pad tokens counted as response tokens
    without_pad.policy_model.load_state_dict(dpo.policy_model.state_dict())
    assert not torch.allclose(without_pad(w, l, prompt_mask=prompt), loss)


def test_a_step_raises_the_preferred_margin_and_leaves_the_reference():
    dpo = nudged(DPO(AutoregressiveWrapper(tiny_lm(seed=0, num_tokens=V)), beta=0.5, pad_id=PAD))
    ref_before = {k: v.clone() for k, v in dpo.ref_model.state_dict().items()}
    params = list(dpo.parameters())
    assert len(params) == len(list(dpo.policy_model.parameters()))
    assert not any(p.requires_grad for p in dpo.ref_model.parameters())
    w, l, prompt = pair()
    opt = torch.optim.SGD(dpo.parameters(), lr=0.5)
    before = dpo(w, l, prompt_mask=prompt)
    before.backward()
    opt.step()
    assert dpo(w, l, prompt_mask=prompt) < before
    for k, v in dpo.ref_model.state_dict().items():
        assert torch.equal(v, ref_before[k])
    dpo.train()
    assert not dpo.ref_model.training


def test_bad_input():
    lm = tiny_lm(seed=0, num_tokens=V)
    with pytest.raises(ValueError, match="causal"):
        DPO(tiny_encoder(seed=0, num_tokens=V))
    with pytest.raises(ValueError, match="beta"):
        DPO(lm, beta=0.0)
    with pytest.raises(ValueError, match="reduction"):
        DPO(lm, reduction="avg")
    dpo = DPO(lm)
    w, l, prompt = pair()
    with pytest.raises(ValueError, match="one shape"):
        dpo(w, l[:, :-1], prompt_mask=prompt)
    with pytest.raises(ValueError, match="prompt_mask"):
        dpo(w, l, prompt_mask=prompt[:, :-1])
    with pytest.raises(ValueError, match="preferred_seq_mask"):
        dpo(w, l, prompt_mask=prompt, preferred_seq_mask=torch.ones(2, 8, dtype=torch.bool))
