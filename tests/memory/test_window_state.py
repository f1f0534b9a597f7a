"""The ring-buffer decode state of a windowed Decoder (issue 17, memory/window_state.py): w key slots (+ sinks,
+ rollback room) however long generation runs, position t at slot t mod ring, storage never reallocated;
cached == uncached far past max_seq_len (rotary, ALiBi, T5 bias, dilation, token shift, left padding, steps
of every length); speculative decoding and beam search equal their references; rollback and clone."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper
from polyformer.generate.beam import beam_search
from polyformer.generate.speculative import speculative_generate
from polyformer.memory.kv_cache import DecodeState
from polyformer.memory.window_state import WindowState
from tests.generate.test_beam import peaky, reference_beam_search
from tests.helpers import ids, tiny_lm
from tests.options import perturb

W = 4
CASES = {
    "rotary": dict(attn_window=W, rotary_pos_emb=True),
    "alibi_sinks": dict(attn_window=W, attn_sink_tokens=2, alibi_pos_emb=True),
    "t5_sinks": dict(attn_window=W, attn_sink_tokens=1, rel_pos_bias=True),
    "dilation": dict(attn_window=3, attn_window_dilation=(1, 2, 1, 2), rotary_pos_emb=True),   # span 6
    "shift_memory_tokens": dict(attn_window=W, rotary_pos_emb=True, shift_tokens=1, num_memory_tokens=2),
}


def lm(seed: int = 0, **keywords) -> torch.nn.Module:
    """Unbounded positions and max_seq_len 16, so generation runs far past it."""
    return perturb(tiny_lm(num_tokens=32, max_seq_len=16, use_abs_pos_emb=False, seed=seed, **keywords), scale=0.05)


def sinks_and_span(net) -> tuple[int, int]:
    return net.attn_layers.window


@pytest.mark.parametrize("name", CASES)
def test_state_stays_at_the_window_and_generation_equals_uncached_far_past_max_seq_len(name):
    net = lm(**CASES[name])
    sinks, span = sinks_and_span(net)
    ar = AutoregressiveWrapper(net)
    prompts = ids(2, 6, 32)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :3] = False                                     # a left-padded row: its sinks sit later
    state = ar.state_for(2, 6, 10 * span)
    address = state.k.data_ptr()
    cached = ar.generate(prompts, 10 * span, temperature=0.0, mask=mask, state=state)
    assert isinstance(state, WindowState) and state.k.shape[3] == sinks + span      # w (+ sinks), nothing more
    assert state.length == net.num_memory_tokens + 6 + 10 * span - 1
    assert state.k.data_ptr() == address                   # written in place: never reallocated or compacted
    assert torch.equal(cached, ar.generate(prompts, 10 * span, temperature=0.0, mask=mask, cache_kv=False))
    assert torch.equal(cached[1], ar.generate(prompts[1:, 3:], 10 * span, temperature=0.0)[0])   # row alone


def test_position_t_sits_at_slot_t_mod_ring_and_sinks_keep_their_own_slots():
    net = lm(**CASES["alibi_sinks"])
    state = net.new_state(1, 8, history=2)                 # ring = w + 2
    ring = W + 2
    net(ids(1, 5, 32), state=state)
    for t in range(5, 31):
        net(ids(1, 1, 32, seed=t), state=state)
    assert state.k.shape[3] == 2 + ring and state.length == 31
    slots = state.pos[0, 2:].tolist()
    assert sorted(slots) == list(range(31 - ring, 31)) and all(slots[t % ring] == t for t in slots)
    assert state.pos[0, :2].tolist() == [0, 1] and state.mask[0, :2].all() and state.mask[0, 2:].all()


@pytest.mark.parametrize("name", ["alibi_sinks", "dilation", "shift_memory_tokens"])
def test_steps_of_every_length_equal_one_uncached_forward(name):
    """In-place steps (n <= history + 1), longer steps (attend over slots + own keys) and steps longer than
    the ring, wrapping it several times, with a left-padded row."""
    net = lm(**CASES[name])
    x = ids(2, 40, 32, seed=5)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :4] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    full = net(x, mask=mask, pos=pos)
    state = net.new_state(2, 40, history=1)
    out, start = [], 0
    for size in (9, 1, 1, 2, 3, 1, 7, 2, 1, 13):
        part = slice(start, start + size)
        out.append(net(x[:, part], state=state, **({"mask": mask[:, part], "pos": pos[:, part]} if start == 0 else {})))
        start += size
    keep = mask[:, :, None].expand_as(full)
    assert_close(torch.cat(out, 1)[keep], full[keep], atol=1e-5, rtol=1e-5)


def test_rollback_within_history_then_continue_equals_the_shorter_prefix():
    net = lm(**CASES["t5_sinks"])
    x = ids(2, 30, 32, seed=7)
    state = net.new_state(2, 30, history=3)
    net(x[:, :10], state=state)
    for t in range(10, 26):
        net(x[:, t:t + 1], state=state)
    net(x[:, 26:29], state=state)                          # a speculative step of 3, all rejected
    state.rollback(3)
    twin = state.clone()
    other = ids(2, 5, 32, seed=8)                           # longer than history + 1: attends over slots + its own
    got = net(other, state=state)
    fresh = net.new_state(2, 30, history=3)
    net(x[:, :26], state=fresh)
    assert_close(got, net(other, state=fresh), atol=1e-5, rtol=1e-5)
    assert_close(net(other, state=twin), got, atol=1e-5, rtol=1e-5)     # the clone is independent
    with pytest.raises(ValueError, match="history"):
        state.rollback(4)                                  # its overwritten keys are gone


def test_rollback_to_before_the_sinks_forgets_them():
    net = lm(**CASES["alibi_sinks"])
    x = ids(1, 6, 32, seed=9)
    state = net.new_state(1, 6, history=6)
    net(x, state=state)
    state.rollback(5)                                      # only position 0 stays: sink 1 is gone
    assert state.mask[0, :2].tolist() == [True, False]
    fresh = net.new_state(1, 6, history=6)
    net(x[:, :1], state=fresh)
    y = ids(1, 3, 32, seed=10)
    assert_close(net(y, state=state), net(y, state=fresh), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma", [2, 4])
def test_speculative_decoding_with_a_window_equals_target_greedy(gamma):
    target = lm(seed=0, **CASES["alibi_sinks"])
    draft = lm(seed=1, attn_window=3, rotary_pos_emb=True)
    prompts = ids(2, 5, 32, seed=11)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, :2] = False
    out = speculative_generate(target, draft, prompts, 30, gamma=gamma, temperature=0.0, mask=mask)
    expected = AutoregressiveWrapper(target).generate(prompts, 30, temperature=0.0, mask=mask, cache_kv=False)
    assert torch.equal(out.tokens, expected)


def test_beam_search_with_a_window_equals_an_uncached_reference():
    torch.manual_seed(0)
    net = peaky(tiny_lm(num_tokens=16, depth=1, max_seq_len=8, use_abs_pos_emb=False, attn_window=3,
                        attn_sink_tokens=1, rotary_pos_emb=True))
    prompt = ids(1, 4, 16, seed=2)
    result = beam_search(net, prompt, 9, 3, length_penalty=1.0)    # 4 + 9 positions wrap a ring of 3 + 1
    for j, (score, tokens) in enumerate(reference_beam_search(net, prompt[0], 9, 3, None, 1.0)):
        assert result.beams[0, j].tolist() == tokens
        assert float(result.beam_scores[0, j]) == pytest.approx(score, abs=1e-4)


def test_a_window_state_never_slides_and_a_plain_state_is_refused():
    net = lm(**CASES["rotary"])
    state = net.new_state(1, 4)
    with pytest.raises(ValueError, match="ring"):
        state.slide(1)
    plain = DecodeState(2, 1, 6, *net.attn_layers.blocks[0].branch.decode_dims)
    with pytest.raises(ValueError, match="ring state"):
        AutoregressiveWrapper(net).generate(ids(1, 4, 32), 8, temperature=0.0, state=plain)
