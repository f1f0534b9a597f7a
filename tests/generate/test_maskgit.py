"""NonAutoregressiveWrapper: MaskGIT (arXiv:2202.04200) training and iterative decoding, BERT's 80/10/10
corruption, MDLM's loss weight (arXiv:2406.07524), self-conditioning and the token critic (arXiv:2209.04439)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder, Encoder, NonAutoregressiveWrapper, TransformerWrapper
from polyformer.generate.maskgit import cosine_schedule, mdlm_weight
from tests.helpers import ids

V, N, MASK = 16, 12, 15


def encoder(seed: int = 0, **kw) -> TransformerWrapper:
    torch.manual_seed(seed)
    return TransformerWrapper(num_tokens=V, max_seq_len=N, attn_layers=Encoder(dim=32, depth=1, heads=2), **kw)


def wrapper(**kw) -> NonAutoregressiveWrapper:
    return NonAutoregressiveWrapper(encoder(), mask_id=MASK, **kw)


def test_chosen_count_follows_the_schedule():
    model = wrapper(schedule="cosine")
    x = ids(5, N, num_tokens=MASK)
    t = torch.tensor([0.0, 0.3, 0.5, 0.9, 0.999])
    _, chosen, _ = model.choose(x, t=t)
    want = [max(1, math.ceil(math.cos(math.pi * v / 2) * N - 1e-9)) for v in t.tolist()]
    assert chosen.sum(-1).tolist() == want
    mask = torch.ones(5, N, dtype=torch.bool)
    mask[:, 8:] = False                              # padding is never chosen; counts follow the kept length
    _, chosen, _ = model.choose(x, mask, t=torch.zeros(5))
    assert torch.equal(chosen, mask)


def test_80_10_10_corruption():
    torch.manual_seed(0)
    model = wrapper(no_replace_prob=0.15, random_token_prob=0.1)
    x = ids(4000, N, num_tokens=MASK)
    inp, chosen, _ = model.choose(x)
    assert torch.equal(inp[~chosen], x[~chosen])                     # the others are untouched
    picked, orig = inp[chosen], x[chosen]
    is_mask = picked == MASK
    same = ~is_mask & (picked == orig)
    other = ~is_mask & (picked != orig)
    total = picked.numel()
    assert abs(is_mask.sum() / total - 0.75) < 0.01
    assert abs(same.sum() / total - 0.15 - 0.1 / (V - 1)) < 0.01     # a random token may equal the original
    assert abs(other.sum() / total - 0.1 * (V - 2) / (V - 1)) < 0.01
    plain = wrapper(no_replace_prob=0.0, random_token_prob=0.0)
    inp, chosen, _ = plain.choose(x)
    assert bool((inp[chosen] == MASK).all())


@pytest.mark.parametrize("mdlm", [False, True])
def test_loss_is_the_cross_entropy_of_the_chosen_tokens(mdlm):
    model = wrapper(use_simple_mdlm_loss_weight=mdlm, schedule="cosine")
    x = ids(3, N, num_tokens=MASK)
    torch.manual_seed(7)
    losses = model(x)
    torch.manual_seed(7)
    inp, chosen, t = model.choose(x)
    logp = model.net(inp).double().log_softmax(-1).gather(-1, x[..., None])[..., 0]    # (b, n)
    if mdlm:    # -γ'/γ for γ = cos(πt/2): (π/2) tan(πt/2); sum over chosen tokens per row, per token of the batch
        weight = (math.pi / 2) * torch.tan(math.pi * t.double() / 2)
        want = -(weight[:, None] * logp * chosen).sum() / x.numel()
    else:
        want = -logp[chosen].mean()
    assert_close(losses.loss.double(), want, rtol=1e-5, atol=1e-6)
    assert losses.generator_loss is losses.loss and losses.critic_loss is None


def test_mdlm_weight_of_the_linear_schedule():
    t = torch.tensor([0.1, 0.5, 0.8])
    assert_close(mdlm_weight(lambda s: 1 - s, t), 1 / (1 - t))
    assert_close(mdlm_weight(cosine_schedule, t), (math.pi / 2) * torch.tan(math.pi * t / 2))


def record_inputs(model: NonAutoregressiveWrapper) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    model.net.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    return seen


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_generation_unmasks_on_schedule_and_keeps_what_it_unmasked(schedule):
    model = wrapper(steps=5, schedule=schedule)
    inputs = record_inputs(model)
    torch.manual_seed(0)
    out = model.generate(batch_size=3)
    assert out.shape == (3, N) and not bool((out == MASK).any())
    gamma = (lambda r: 1 - r) if schedule == "linear" else (lambda r: math.cos(math.pi * r / 2))
    counts = [N] + [math.ceil(gamma((s + 1) / 5) * N - 1e-6) for s in range(4)]
    assert [int((seq == MASK).sum(-1).unique()) for seq in inputs] == counts
    for before, after in zip(inputs + [out], (inputs + [out])[1:]):
        kept = before != MASK
        assert torch.equal(after[kept], before[kept])          # an unmasked token never changes
    assert model.generate().shape == (N,)


def test_generation_remasks_the_least_confident():
    model = wrapper(steps=4, schedule="linear")
    with torch.no_grad():
        model.net.to_logits.weight.mul_(20)             # well-separated logits: the sampled token is the argmax
    logits_seen: list[torch.Tensor] = []
    inputs = record_inputs(model)
    model.net.to_logits.register_forward_hook(lambda module, args, out: logits_seen.append(out.clone()))
    torch.manual_seed(1)
    model.generate(batch_size=2, start_temperature=0.0, filter_thres=None)   # greedy: the argmax is sampled
    logits = logits_seen[0]
    logits[..., MASK] = float("-inf")
    confidence = logits.log_softmax(-1).max(-1).values                        # (b, n) of the first step
    unmasked = inputs[1] != MASK
    for row in range(2):
        assert confidence[row][unmasked[row]].min() >= confidence[row][~unmasked[row]].max()


def test_token_critic_chooses_what_to_remask_and_learns_from_replaced_tokens():
    torch.manual_seed(0)
    critic = TransformerWrapper(num_tokens=V, max_seq_len=N, logits_dim=1,
                                attn_layers=Encoder(dim=16, depth=1, heads=2))
    model = NonAutoregressiveWrapper(encoder(), mask_id=MASK, steps=3, token_critic=critic, critic_loss_weight=0.5)
    inputs = record_inputs(model)
    critic_inputs: list[torch.Tensor] = []
    critic.register_forward_pre_hook(lambda module, args: critic_inputs.append(args[0].clone()))
    torch.manual_seed(2)
    model.generate(batch_size=2, noise_level_scale=0.0)
    scores = critic(critic_inputs[0])[..., 0]
    remasked = inputs[1] == MASK
    for row in range(2):
        assert scores[row][remasked[row]].min() >= scores[row][~remasked[row]].max()
    x = ids(3, N, num_tokens=MASK)
    critic_inputs.clear()
    torch.manual_seed(3)
    losses = model(x)
    filled = critic_inputs[0]
    want = F.binary_cross_entropy_with_logits(critic(filled)[..., 0], (filled != x).float())
    assert_close(losses.critic_loss, want)
    assert_close(losses.loss, losses.generator_loss + 0.5 * want)
    assert model(x, only_train_critic=True).generator_loss is None
    own = NonAutoregressiveWrapper(encoder(), mask_id=MASK, self_token_critic=True)
    assert own.token_critic.net is own.net


@pytest.mark.skipif("sum_embeds" not in inspect.signature(TransformerWrapper.forward).parameters,
                    reason="TransformerWrapper.forward(sum_embeds=) is not there yet")
def test_self_conditioning_feeds_the_previous_embeddings():
    model = wrapper(self_cond=True, self_cond_train_prob=1.0)
    x = ids(2, N, num_tokens=MASK)
    torch.manual_seed(4)
    loss = model(x).loss
    torch.manual_seed(4)
    inp, chosen, t = model.choose(x)
    cond = model.to_self_cond(model.net(inp, return_embeddings=True))
    assert_close(loss, model.generator_loss(model.net(inp, sum_embeds=cond), x, chosen, t))


def test_bad_arguments():
    with pytest.raises(ValueError, match="bidirectional"):
        NonAutoregressiveWrapper(TransformerWrapper(num_tokens=V, max_seq_len=N,
                                                    attn_layers=Decoder(dim=16, depth=1)), mask_id=0)
    for kw, match in [(dict(mask_id=V), "mask_id"), (dict(mask_id=0, steps=0), "steps"),
                      (dict(mask_id=0, schedule="cos"), "schedule"),
                      (dict(mask_id=0, no_replace_prob=0.7, random_token_prob=0.5), "at most 1"),
                      (dict(mask_id=0, random_token_prob=1.5), "random_token_prob"),
                      (dict(mask_id=0, self_token_critic=True, token_critic=encoder()), "not both"),
                      (dict(mask_id=0, token_critic=encoder()), "logits_dim=1")]:
        with pytest.raises(ValueError, match=match):
            NonAutoregressiveWrapper(encoder(), **kw)
    with pytest.raises(ValueError, match="filter_thres"):
        wrapper().generate(filter_thres=1.0)


def test_gumbel_sample_draws_from_the_softmax():
    from polyformer.generate.maskgit import gumbel_sample

    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, float("-inf")])
    draws = gumbel_sample(logits.expand(20000, 1, 5), 1.0)[:, 0]
    freq = torch.bincount(draws, minlength=5).float() / 20000
    assert_close(freq, logits.softmax(-1), atol=0.015, rtol=0)
    assert_close(torch.bincount(gumbel_sample(logits.expand(2000, 1, 5), 0.5)[:, 0], minlength=5).float() / 2000,
                 (logits / 0.5).softmax(-1), atol=0.03, rtol=0)
    near = torch.randn(64, 3, 7)
    assert torch.equal(gumbel_sample(near, 1e-6), near.argmax(-1))         # greedy as the temperature falls
