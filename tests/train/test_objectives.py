"""Objectives: LM equals the shifted cross-entropy; MLM masks 15% (80/10/10) and scores only those;
prefix-LM scores only after the prefix and passes `prefix_len`; seq2seq tasks are right and a tiny
XTransformer learns to copy. Ranks of a distributed run add up to the one-process loss."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polyformer import AutoregressiveWrapper, XTransformer
from polyformer.train.batches import Batches
from polyformer.train.objectives import (LanguageModeling, MaskedLanguageModeling, PrefixLanguageModeling, Seq2Seq,
                                         Seq2SeqTask, token_accuracy)
from tests.helpers import tiny_encoder, tiny_lm

MASK = 256


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows(b: int = 4, n: int = 16, num_tokens: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, num_tokens, (b, n + 1), generator=gen(seed))


class FixedLogits(nn.Module):
    """Returns given logits, whatever the input; records what it was called with."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits
        self.calls = []

    def forward(self, x, prefix_len=None):
        self.calls.append((x, prefix_len))
        return self.logits


# --- language modeling -------------------------------------------------------------------------

def test_lm_equals_shift_and_cross_entropy():
    net, batch = tiny_lm(), rows()
    loss = LanguageModeling().loss(net, batch)
    manual = F.cross_entropy(net(batch[:, :-1]).reshape(-1, 64), batch[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, manual)
    torch.testing.assert_close(loss, AutoregressiveWrapper(net)(batch))


def test_lm_refuses_an_encoder():
    LanguageModeling().check(tiny_lm())
    with pytest.raises(ValueError, match="causal"):
        LanguageModeling().check(tiny_encoder())


# --- masked language modeling ------------------------------------------------------------------

def test_mlm_masking_statistics():
    x = torch.randint(0, 256, (64, 1024), generator=gen(1))
    inp, target = MaskedLanguageModeling(MASK, 256, generator=gen(2)).mask(x)
    chosen = target != -100
    assert abs(chosen.float().mean().item() - 0.15) < 0.005
    assert torch.equal(target[chosen], x[chosen])
    assert torch.equal(inp[~chosen], x[~chosen])               # unchosen positions untouched
    masked = (inp == MASK) & chosen
    kept = (inp == x) & chosen
    replaced = chosen & ~masked & ~kept
    total = chosen.sum().item()
    assert abs(masked.sum().item() / total - 0.8) < 0.015
    assert abs(replaced.sum().item() / total - 0.1 * 255 / 256) < 0.01   # a random token may equal x
    assert abs(kept.sum().item() / total - (0.1 + 0.1 / 256)) < 0.01
    assert inp[replaced].max() < 256


def test_mlm_is_deterministic_given_its_generator():
    x = rows(8, 64, 256)
    a, b = MaskedLanguageModeling(MASK, 256, generator=gen(7)), MaskedLanguageModeling(MASK, 256, generator=gen(7))
    for _ in range(3):
        ia, ta = a.mask(x)
        ib, tb = b.mask(x)
        assert torch.equal(ia, ib) and torch.equal(ta, tb)
    state = a.state_dict()
    after = a.mask(x)
    c = MaskedLanguageModeling(MASK, 256, generator=gen(123))
    c.load_state_dict(state)
    assert all(torch.equal(u, v) for u, v in zip(after, c.mask(x)))


def test_mlm_loss_counts_only_chosen_positions():
    batch = rows(4, 32, 256)
    logits = torch.randn(4, 32, 258, generator=gen(3))
    _, target = MaskedLanguageModeling(MASK, 256, generator=gen(5)).mask(batch[:, :-1])
    chosen = target != -100
    other = logits.clone()
    other[~chosen] = torch.randn_like(other[~chosen])          # change every unchosen position
    losses = [MaskedLanguageModeling(MASK, 256, generator=gen(5)).loss(FixedLogits(lg), batch)
              for lg in (logits, other)]
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    torch.testing.assert_close(losses[0], F.cross_entropy(logits[chosen], target[chosen]))
    changed = logits.clone()
    b, t = chosen.nonzero()[0].tolist()
    changed[b, t] += 5 * torch.randn(258)
    assert MaskedLanguageModeling(MASK, 256, generator=gen(5)).loss(FixedLogits(changed), batch) != losses[0]


def test_mlm_trains_an_encoder():
    net = tiny_encoder(num_tokens=258).train()
    objective = MaskedLanguageModeling(MASK, 256, generator=gen(0))
    objective.check(net)
    loss = objective.loss(net, rows(4, 32, 256))
    loss.backward()
    assert torch.isfinite(loss) and net.token_emb.weight.grad is not None
    with pytest.raises(ValueError, match="bidirectional"):
        objective.check(tiny_lm(num_tokens=258))
    with pytest.raises(ValueError, match="num_tokens"):
        objective.check(tiny_encoder(num_tokens=256))


def test_mlm_ranks_add_up_to_the_global_loss():
    torch.manual_seed(0)
    net, batch = tiny_encoder(num_tokens=258), rows(8, 32, 256)
    whole = MaskedLanguageModeling(MASK, 256, generator=gen(9)).loss(net, batch)
    parts = [MaskedLanguageModeling(MASK, 256, generator=gen(9), rank=r, world_size=2).loss(net, batch[r::2])
             for r in range(2)]
    torch.testing.assert_close((parts[0] + parts[1]) / 2, whole)    # what DDP's gradient averaging sees


def test_mlm_training_resumes_bit_for_bit():
    """Saving the model, optimizer, Batches and objective states at step 3 and resuming elsewhere
    gives exactly the losses of an uninterrupted run."""
    tokens = torch.randint(0, 256, (5000,), generator=gen(0))

    def fresh():
        torch.manual_seed(0)
        net = tiny_encoder(num_tokens=258).train()
        return net, torch.optim.AdamW(net.parameters(), lr=1e-3), Batches(tokens, 32, 4, seed=1), \
            MaskedLanguageModeling(MASK, 256, generator=gen(2))

    def run(net, opt, batches, objective, steps):
        losses = []
        for _ in range(steps):
            loss = objective.loss(net, next(batches))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    straight = run(*fresh(), 6)
    net, opt, batches, objective = fresh()
    first = run(net, opt, batches, objective, 3)
    saved = copy.deepcopy([net.state_dict(), opt.state_dict(), batches.state_dict(), objective.state_dict()])
    torch.manual_seed(123)                                      # the resumed process starts elsewhere
    net2, opt2, batches2, objective2 = tiny_encoder(num_tokens=258).train(), None, Batches(tokens, 32, 4, seed=7), \
        MaskedLanguageModeling(MASK, 256, generator=gen(99))
    net2.load_state_dict(saved[0])
    opt2 = torch.optim.AdamW(net2.parameters(), lr=1e-3)
    opt2.load_state_dict(saved[1])
    batches2.load_state_dict(saved[2])
    objective2.load_state_dict(saved[3])
    assert first + run(net2, opt2, batches2, objective2, 3) == straight


def test_mlm_bad_arguments():
    with pytest.raises(ValueError, match="prob"):
        MaskedLanguageModeling(MASK, 256, prob=1.5)
    with pytest.raises(ValueError, match="mask_frac"):
        MaskedLanguageModeling(MASK, 256, mask_frac=0.9, random_frac=0.2)
    with pytest.raises(ValueError, match="rank"):
        MaskedLanguageModeling(MASK, 256, rank=2, world_size=2)


# --- prefix language modeling ------------------------------------------------------------------

def test_prefix_lm_scores_only_after_the_prefix_and_passes_prefix_len():
    batch = rows(6, 16)
    logits = torch.randn(6, 16, 64, generator=gen(1))
    model = FixedLogits(logits)
    loss = PrefixLanguageModeling(2, 10, generator=gen(4)).loss(model, batch)
    inp, p = model.calls[0]
    assert torch.equal(inp, batch[:, :-1])
    assert p.shape == (6,) and p.dtype == torch.long and 2 <= p.min() and p.max() <= 10
    counted = torch.arange(16)[None] >= p[:, None] - 1          # position t predicts token t + 1 >= p
    manual = F.cross_entropy(logits[counted], batch[:, 1:][counted])
    torch.testing.assert_close(loss, manual)
    other = logits.clone()
    other[~counted] = 0.0
    again = PrefixLanguageModeling(2, 10, generator=gen(4)).loss(FixedLogits(other), batch)
    torch.testing.assert_close(again, loss, rtol=0, atol=0)


def test_prefix_lm_ranks_add_up_to_the_global_loss():
    batch, logits = rows(8, 16), torch.randn(8, 16, 64, generator=gen(2))
    whole = PrefixLanguageModeling(0, 16, generator=gen(3)).loss(FixedLogits(logits), batch)
    parts = [PrefixLanguageModeling(0, 16, generator=gen(3), rank=r, world_size=2)
             .loss(FixedLogits(logits[r::2]), batch[r::2]) for r in range(2)]
    torch.testing.assert_close((parts[0] + parts[1]) / 2, whole)


def test_prefix_lm_bad_arguments():
    with pytest.raises(ValueError, match="max_prefix"):
        PrefixLanguageModeling(5, 3)
    with pytest.raises(ValueError, match="min_prefix"):
        PrefixLanguageModeling(-1, 3)
    with pytest.raises(ValueError, match="n=16"):
        PrefixLanguageModeling(0, 20).loss(FixedLogits(torch.zeros(2, 16, 64)), rows(2, 16))
    with pytest.raises(ValueError, match="causal"):
        PrefixLanguageModeling(0, 4).check(tiny_encoder())


# The next three follow the maintainer's contract for TransformerWrapper / Decoder:
# forward(x, prefix_len=(b,)) lets the first prefix_len[b] tokens of row b attend to each other
# bidirectionally, causal after.

def test_decoder_prefix_len_is_bidirectional_inside_causal_after():
    torch.manual_seed(0)
    net, x = tiny_lm(), rows(2, 12)[:, :-1]
    p = torch.tensor([4, 7])
    base = net(x, prefix_len=p)
    y = x.clone()
    y[0, 3], y[1, 6] = (y[0, 3] + 1) % 64, (y[1, 6] + 1) % 64   # the last prefix token of each row
    changed = net(y, prefix_len=p)
    assert not torch.allclose(base[0, :3], changed[0, :3])      # earlier prefix tokens see it
    assert not torch.allclose(base[1, :6], changed[1, :6])
    z = x.clone()
    z[:, 9] = (z[:, 9] + 1) % 64                                # a token after both prefixes
    torch.testing.assert_close(net(z, prefix_len=p)[:, :9], base[:, :9])
    torch.testing.assert_close(net(x, prefix_len=torch.zeros(2, dtype=torch.long)), net(x))


def test_prefix_lm_trains_a_decoder():
    torch.manual_seed(0)
    net = tiny_lm().train()
    objective = PrefixLanguageModeling(1, 8, generator=gen(0))
    objective.check(net)
    loss = objective.loss(net, rows(4, 16))
    loss.backward()
    assert torch.isfinite(loss) and net.token_emb.weight.grad is not None


def test_prefix_lm_of_zero_prefix_is_language_modeling():
    torch.manual_seed(0)
    net, batch = tiny_lm(), rows(4, 16)
    torch.testing.assert_close(PrefixLanguageModeling(0, 0).loss(net, batch), LanguageModeling().loss(net, batch))


# --- sequence to sequence ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["copy", "reverse", "sort"])
def test_seq2seq_tasks_produce_correct_targets(kind):
    task = Seq2SeqTask(kind, num_tokens=10, length=12, generator=gen(0))
    src, tgt = task.sample(64)
    assert src.shape == (64, 12) and tgt.shape == (64, 13)
    assert (tgt[:, 0] == task.bos).all() and task.bos == 10 and task.vocab_size == 11
    assert 0 <= src.min() and src.max() < 10
    answer = tgt[:, 1:]
    if kind == "copy":
        assert torch.equal(answer, src)
    elif kind == "reverse":
        assert all(answer[i].tolist() == src[i].tolist()[::-1] for i in range(64))
    else:
        assert all(answer[i].tolist() == sorted(src[i].tolist()) for i in range(64))


def test_seq2seq_task_is_deterministic_and_splits_over_ranks():
    a = Seq2SeqTask("reverse", 10, 6, generator=gen(1))
    b = Seq2SeqTask("reverse", 10, 6, generator=gen(1))
    assert torch.equal(a.sample(8)[0], b.sample(8)[0])
    state = a.state_dict()
    after = a.sample(8)[0]
    b.load_state_dict(state)
    assert torch.equal(b.sample(8)[0], after)
    whole = Seq2SeqTask("copy", 10, 6, generator=gen(2)).sample(8)[0]
    parts = [Seq2SeqTask("copy", 10, 6, generator=gen(2), rank=r, world_size=2).sample(8)[0] for r in range(2)]
    assert torch.equal(whole[0::2], parts[0]) and torch.equal(whole[1::2], parts[1])


def tiny_xtransformer(task: Seq2SeqTask, dim: int = 32) -> XTransformer:
    return XTransformer(dim=dim, enc_num_tokens=task.vocab_size, enc_max_seq_len=task.length, enc_depth=1,
                        enc_heads=4, dec_num_tokens=task.vocab_size, dec_max_seq_len=task.length + 1,
                        dec_depth=1, dec_heads=4)


def test_seq2seq_loss_is_the_xtransformer_loss():
    torch.manual_seed(0)
    task = Seq2SeqTask("sort", 10, 6, generator=gen(0))
    model, objective = tiny_xtransformer(task), Seq2Seq(task)
    objective.check(model)
    src, tgt = task.sample(4)
    torch.testing.assert_close(objective.loss(model, (src, tgt)), model(src, tgt))
    torch.testing.assert_close(objective.loss(model, src), model(src, tgt))
    with pytest.raises(TypeError, match="XTransformer"):
        objective.check(tiny_lm())
    with pytest.raises(ValueError, match="dec_num_tokens >= 11"):
        objective.check(XTransformer(dim=32, enc_num_tokens=11, enc_max_seq_len=6, enc_depth=1,
                                     dec_num_tokens=10, dec_max_seq_len=7, dec_depth=1))
    with pytest.raises(ValueError, match="unknown seq2seq task 'rotate'"):
        Seq2SeqTask("rotate", 10, 6)


def test_tiny_xtransformer_learns_to_copy():
    torch.manual_seed(0)
    task = Seq2SeqTask("copy", num_tokens=16, length=8, generator=gen(0))
    model, objective = tiny_xtransformer(task), Seq2Seq(task)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    before = token_accuracy(model, task, n=256)
    for _ in range(200):
        loss = objective.loss(model, task.sample(32))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model.training                                       # token_accuracy restores the mode
    accuracy = token_accuracy(model, task, n=256)
    assert before < 0.3 and accuracy > 0.99, (before, accuracy)
