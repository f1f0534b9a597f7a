"""ACT over the Universal Transformer's steps (polyformer/act.py): the output equals Graves's halting rule
worked out by hand; halting weights sum to 1; a threshold that halts at once runs one step; halted positions
are not updated; finished rows leave the batch and the loop stops when all have halted; the ponder cost
equals mean(N + R) and its gradient reaches the halting unit; cached == uncached; bad input named."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper
from polyformer.interfaces import Context
from tests.helpers import ids, tiny_lm
from tests.options import perturb
from tests.test_universal import DIM, stack as universal_stack, unit_once

N = 9


def stack(cls=Decoder, seed: int = 0, **keywords) -> torch.nn.Module:
    return universal_stack(cls, seed=seed, **{"depth": 4, "act": True, **keywords})


def counted(s: torch.nn.Module) -> list[tuple[int, ...]]:
    """The input shapes of every application of the unit, as it runs."""
    shapes: list[tuple[int, ...]] = []
    s.blocks[0].register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    return shapes


def by_hand(s: torch.nn.Module, x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Graves's rule per position over every step of the unit (none skipped), halted states frozen."""
    b, n, _ = x.shape
    ctx = Context(pos=torch.arange(n)[None], causal=s.causal)
    state, out = x, torch.zeros_like(x)
    cum = [[0.0] * n for _ in range(b)]
    halted = torch.zeros(b, n, dtype=torch.bool)
    steps = s.universal.steps
    for t in range(steps):
        state = torch.where(halted[..., None], state, unit_once(s, state, ctx))
        prob = torch.sigmoid(s.universal.halting.unit(state)).squeeze(-1)
        for i in range(b):
            for j in range(n):
                if halted[i, j]:
                    continue
                if cum[i][j] + prob[i, j] >= threshold or t == steps - 1:
                    p, halted[i, j] = 1 - cum[i][j], True        # the remainder R
                else:
                    p = prob[i, j]
                    cum[i][j] = cum[i][j] + p
                out[i, j] += p * state[i, j]
    return s.final_norm(out)


@pytest.mark.parametrize("cls", [Decoder, Encoder])
def test_output_is_the_halting_weighted_mix_of_step_states(cls):
    s = stack(cls, act_threshold=0.8)
    x = torch.randn(2, N, DIM)
    with torch.no_grad():
        assert_close(s(x), by_hand(s, x, 0.8))
    steps = s.universal.halting.last.steps
    assert set(steps.flatten().tolist()) == {1.0, 2.0, 3.0}     # positions differ in the steps they take


def test_halting_weights_sum_to_one_and_end_with_the_remainder():
    s = stack(Encoder, act_threshold=0.95)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1, 6:] = False
    s(torch.randn(2, N, DIM), mask=mask)
    last = s.universal.halting.last
    assert_close(last.weights.sum(0), torch.ones(2, N))
    final = last.weights.gather(0, last.steps.long()[None] - 1)[0]
    assert_close(final, last.remainders)
    assert (last.steps[1, 6:] == 1).all()                       # padding halts after the first step


def test_a_threshold_that_halts_at_once_uses_one_step():
    s = stack(act_threshold=1e-4)
    shapes = counted(s)
    x = torch.randn(2, N, DIM)
    out = s(x)
    assert len(shapes) == 1 and (s.universal.halting.last.steps == 1).all()
    ctx = Context(pos=torch.arange(N)[None], causal=True)
    assert_close(out, s.final_norm(unit_once(s, x, ctx)))


def test_halted_positions_are_unchanged_by_later_steps():
    s = stack(Encoder, ut_timestep_emb=True)
    states: list[torch.Tensor] = []
    s.universal.halting.unit.register_forward_hook(lambda module, args, out: states.append(args[0]))
    s(torch.randn(1, N, DIM))
    steps = s.universal.halting.last.steps[0].long()
    assert len(states) == int(steps.max()) == 3
    for j, k in enumerate(steps.tolist()):
        for t in range(k, len(states)):
            assert torch.equal(states[t][0, j], states[k - 1][0, j])
    running = steps == 3
    assert not torch.allclose(states[2][0, running], states[1][0, running])


def test_finished_rows_leave_the_batch_and_the_loop_stops_when_all_have_halted():
    s = stack(Encoder, act_max_steps=6)
    shapes = counted(s)
    x = torch.randn(2, N, DIM)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1] = False                                             # row 1: padding only, halted after step 1
    out = s(x, mask=mask)
    most = int(s.universal.halting.last.steps[0].max())
    assert most < 6 and shapes == [(2, N, DIM)] + [(1, N, DIM)] * (most - 1)
    assert_close(out[:1], s(x[:1]))


def test_ponder_cost_is_mean_steps_plus_remainder_and_its_gradient_reaches_the_halting_unit():
    torch.manual_seed(0)
    model = perturb(TransformerWrapper(num_tokens=64, max_seq_len=32, attn_layers=Decoder(
        dim=DIM, depth=4, heads=2, universal=True, act=True, act_ponder_weight=0.05)), scale=0.05)
    x = ids(2, N + 1)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[0, :3] = False
    _, record = model(x[:, :-1], mask=mask, return_intermediates=True)
    term, last = record.losses.terms["act_ponder"], model.attn_layers.universal.halting.last
    assert record.losses.weights == {"act_ponder": 0.05}
    assert_close(term, (last.steps + last.remainders)[mask].mean())
    unit = model.attn_layers.universal.halting.unit
    grads = torch.autograd.grad(term, [unit.weight, unit.bias])
    assert all(g.abs().sum() > 0 for g in grads)
    loss = AutoregressiveWrapper(model)(x)
    ce = F.cross_entropy(model(x[:, :-1]).transpose(1, 2), x[:, 1:])
    assert_close(loss, ce + 0.05 * model(x[:, :-1], return_intermediates=True)[1].losses.terms["act_ponder"])


def test_cached_steps_equal_the_uncached_forward():
    model = perturb(tiny_lm(depth=4, universal=True, act=True, act_threshold=0.8, ut_timestep_emb=True,
                            rotary_pos_emb=True, seed=0), scale=0.05)
    x = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    full = model(x, mask=mask, pos=pos)
    assert len(set(model.attn_layers.universal.halting.last.steps[mask].tolist())) > 1
    state = model.new_state(2, 12)
    assert state.layers == 4
    chunks = [model(x[:, :5], mask=mask[:, :5], pos=pos[:, :5], state=state)]
    chunks += [model(x[:, t:t + 1], state=state) for t in range(5, 9)] + [model(x[:, 9:], state=state)]
    assert_close(torch.cat(chunks, 1)[mask], full[mask], atol=1e-5, rtol=1e-5)
    # one row token by token: a token that halts early still writes every step's keys, which a later
    # token that runs longer reads
    full = model(x[:1])
    steps = model.attn_layers.universal.halting.last.steps[0].tolist()
    assert any(steps[i] < steps[j] for i in range(4, 12) for j in range(i + 1, 12))
    state = model.new_state(1, 12)
    cached = [model(x[:1, :4], state=state)] + [model(x[:1, t:t + 1], state=state) for t in range(4, 12)]
    assert_close(torch.cat(cached, 1), full, atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_and_trains():
    s = stack().to(torch.bfloat16).train()
    x = torch.randn(2, N, DIM, dtype=torch.bfloat16, requires_grad=True)
    out, record = s(x, return_intermediates=True)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    (out.float().square().mean() + record.losses.total()).backward()
    assert torch.isfinite(s.universal.halting.unit.weight.grad).all()


@pytest.mark.parametrize("keywords, error, named", [
    (dict(act_threshold=0.0), ValueError, "act_threshold"),
    (dict(act_threshold=1.0), ValueError, "act_threshold"),
    (dict(act_threshold=-0.5), ValueError, "act_threshold"),
    (dict(act_threshold="0.9"), ValueError, "act_threshold"),
    (dict(act_max_steps=0), ValueError, "act_max_steps"),
    (dict(act_max_steps=2.5), ValueError, "act_max_steps"),
    (dict(act_ponder_weight=-0.1), ValueError, "act_ponder_weight"),
    (dict(act_ponder_weight=math.nan), ValueError, "act_ponder_weight"),
    (dict(universal=False), ValueError, "universal=True"),
    (dict(act=False, act_threshold=0.9), ValueError, "act_threshold need.* act=True"),
    (dict(act=1), TypeError, "'act'"),
])
def test_bad_input_is_named(keywords, error, named):
    with pytest.raises(error, match=named):
        Decoder(dim=DIM, heads=2, **{"depth": 2, "universal": True, "act": True, **keywords})


def test_act_takes_no_xl_memories():
    model = tiny_lm(universal=True, act=True, max_mem_len=4)
    with pytest.raises(ValueError, match="mems"):
        model(ids(2, 6), mems=[torch.zeros(2, 4, 32)] * 2)
