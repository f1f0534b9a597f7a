"""Prompt caching: a continuation from a saved and loaded decode state equals one computed from
scratch; clones of one loaded state are independent; a cache of another model, a truncated file or
a missing one is refused; a failed save leaves nothing behind."""

from __future__ import annotations

import os

import pytest
import torch
from torch.testing import assert_close

from polyformer.generate.decode import AutoregressiveWrapper, left_padded_positions
from polyformer.generate.prompt_cache import load_prompt_cache, next_token_logits, save_prompt_cache
from tests.helpers import ids, tiny_lm

pytest.importorskip("safetensors")

MODELS = {
    "plain": {},
    "rotary": dict(rotary_pos_emb=True),
    "shift_tokens": dict(shift_tokens=1),
    "num_memory_tokens": dict(num_memory_tokens=3),
    "shift_tokens+num_memory_tokens": dict(shift_tokens=1, num_memory_tokens=2),
    "performer": dict(attn_performer=True, attn_performer_features=8, attn_performer_chunk=4),
    "rfa_gate": dict(attn_rfa=True, attn_rfa_gate=True, rotary_pos_emb=True),
    "window": dict(attn_window=4, rotary_pos_emb=True),          # a ring of 4 (+ 1) slots: 9 prompt tokens wrap it
    "window_sink_shift": dict(attn_window=3, attn_sink_tokens=1, alibi_pos_emb=True, shift_tokens=1),
}
STEPS = 6


def build(name: str = "plain", seed: int = 0, **extra):
    torch.manual_seed(seed)
    net = tiny_lm(num_tokens=32, depth=2, **MODELS[name], **extra)
    with torch.no_grad():
        net.to_logits.weight.mul_(3.0)      # a peaked distribution, so greedy paths differ between inputs
    return net


def prefilled(net, prompt, mask=None, context=None):
    """The state right after the prompt, with room for exactly the prompt."""
    state = net.new_state(prompt.shape[0], prompt.shape[1])
    net(prompt, mask=mask, pos=left_padded_positions(mask), context=context, state=state)
    return state


def continue_greedy(net, state, prompt, steps, context=None):
    logits = next_token_logits(net, state, prompt, context=context)
    out = []
    for _ in range(steps):
        token = logits.argmax(dim=-1, keepdim=True)
        out.append(token)
        logits = net(token, context=context, state=state)[:, -1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("n", [9, 1], ids=["prompt9", "prompt1"])
@pytest.mark.parametrize("name", list(MODELS))
def test_loaded_cache_continues_like_from_scratch(name, n, tmp_path):
    """(a 1-token prompt puts the memory tokens inside the token-shift window of the next step)"""
    net = build(name)
    prompt = ids(1, n, 32)
    path = tmp_path / "seed.safetensors"
    save_prompt_cache(path, net, prefilled(net, prompt), prompt)
    state, loaded_prompt = load_prompt_cache(path, net, max_len=n + STEPS)
    assert torch.equal(loaded_prompt, prompt)
    assert state.length == n + net.num_memory_tokens
    scratch = AutoregressiveWrapper(net).generate(prompt, STEPS, temperature=0.0)
    assert torch.equal(continue_greedy(net, state, prompt, STEPS), scratch)


@pytest.mark.parametrize("name", ["window", "window_sink_shift"])
def test_restored_ring_decodes_bit_equal_to_the_uninterrupted_one(name, tmp_path):
    """A wrapped ring (left-padded row, sinks, token shift) saved and loaded holds the same slots, and
    in-place steps, longer ones, a rollback and more wrapping give the same logits bit for bit."""
    net = build(name)
    prompts = ids(2, 9, 32, seed=3)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :4] = False
    state = net.new_state(2, 9, history=2)
    net(prompts, mask=mask, pos=left_padded_positions(mask), state=state)
    path = tmp_path / "ring.safetensors"
    save_prompt_cache(path, net, state, prompts)
    loaded, _ = load_prompt_cache(path, net, max_len=9)
    for field in ("k", "v", "pos", "mask", "kept"):
        assert torch.equal(getattr(loaded, field), getattr(state, field)), field
    assert loaded.shift.keys() == state.shift.keys()
    assert all(torch.equal(loaded.shift[i], h) for i, h in state.shift.items())
    forced, start = ids(2, 20, 32, seed=8), 0
    for size in (1, 3, 1, 5, 2, 1, 6, 1):              # 3 = history + 1 in place; 5, 6 attend slots + own keys
        step = forced[:, start: start + size]
        assert torch.equal(net(step, state=loaded), net(step, state=state))
        start += size
        if size == 2:
            state.rollback(2)
            loaded.rollback(2)


def test_generate_continues_a_loaded_cache(tmp_path):
    """The same through `AutoregressiveWrapper.generate(state=...)`: the state lacks the logits
    after the prompt, so roll back the last prompt token and pass it as the prompt."""
    net = build("rotary")
    prompt = ids(1, 9, 32, seed=6)
    path = tmp_path / "seed.safetensors"
    save_prompt_cache(path, net, prefilled(net, prompt), prompt)
    state, _ = load_prompt_cache(path, net, max_len=9 + STEPS)
    state.rollback(1)
    wrapper = AutoregressiveWrapper(net)
    assert torch.equal(wrapper.generate(prompt[:, -1:], STEPS, temperature=0.0, state=state),
                       wrapper.generate(prompt, STEPS, temperature=0.0))


def test_left_padded_batch_cache(tmp_path):
    net = build("rotary")
    prompts = ids(2, 7, 32, seed=4)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :3] = False
    path = tmp_path / "batch.safetensors"
    save_prompt_cache(path, net, prefilled(net, prompts, mask), prompts)
    state, _ = load_prompt_cache(path, net, max_len=7 + STEPS)
    scratch = AutoregressiveWrapper(net).generate(prompts, STEPS, mask=mask, temperature=0.0)
    assert torch.equal(continue_greedy(net, state, prompts, STEPS), scratch)


def test_cross_attention_cache(tmp_path):
    net = build("plain", cross_attend=True)
    prompt, context = ids(1, 5, 32), torch.randn(1, 4, 32)
    path = tmp_path / "cross.safetensors"
    save_prompt_cache(path, net, prefilled(net, prompt, context=context), prompt)
    state, _ = load_prompt_cache(path, net, max_len=5 + STEPS)
    assert set(state.cross) == {0, 1}
    scratch = AutoregressiveWrapper(net).generate(prompt, STEPS, temperature=0.0, context=context)
    assert torch.equal(continue_greedy(net, state, prompt, STEPS, context=context), scratch)


@pytest.mark.parametrize("name", ["rotary", "shift_tokens", "performer"])
def test_two_continuations_from_one_cache_are_independent(name, tmp_path):
    net = build(name)
    prompt = ids(1, 8, 32, seed=2)
    path = tmp_path / "seed.safetensors"
    save_prompt_cache(path, net, prefilled(net, prompt), prompt)
    loaded, _ = load_prompt_cache(path, net, max_len=8 + STEPS)
    kept = loaded.k.clone()
    a, b = loaded.clone(), loaded.clone()
    forced = ids(1, STEPS, 32, seed=9)               # continuation b: a fixed suffix, not greedy
    logits_a = next_token_logits(net, a, prompt)
    logits_b = next_token_logits(net, b, prompt)
    greedy, b_logits = [], [logits_b]
    for t in range(STEPS):                           # interleave the two continuations step by step
        token = logits_a.argmax(dim=-1, keepdim=True)
        greedy.append(token)
        logits_a = net(token, state=a)[:, -1]
        b_logits.append(net(forced[:, t:t + 1], state=b)[:, -1])
    scratch = AutoregressiveWrapper(net).generate(prompt, STEPS, temperature=0.0)
    assert torch.equal(torch.cat(greedy, dim=1), scratch)
    with torch.no_grad():
        reference = net(torch.cat((prompt, forced), dim=1))[:, 7:]      # uncached, from scratch
    assert_close(torch.stack(b_logits, dim=1), reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(loaded.k, kept) and loaded.length == 8 + net.num_memory_tokens


def test_cache_of_another_model_is_refused(tmp_path):
    path = tmp_path / "seed.safetensors"
    rotary = build("rotary")
    prompt = ids(1, 6, 32)
    save_prompt_cache(path, rotary, prefilled(rotary, prompt), prompt)
    with pytest.raises(ValueError, match=r"saved for another model.*layers.*position: saved 'rotary'"):
        load_prompt_cache(path, build("plain"), max_len=10)
    with pytest.raises(ValueError, match=r"saved for another model.*args.*num_memory_tokens"):
        load_prompt_cache(path, build("rotary", num_memory_tokens=2), max_len=10)
    load_prompt_cache(path, build("rotary", seed=5), max_len=10)   # same config: accepted (see limits)


def test_missing_truncated_and_foreign_files_are_refused(tmp_path):
    net = build()
    prompt = ids(1, 6, 32)
    path = tmp_path / "seed.safetensors"
    with pytest.raises(FileNotFoundError, match="seed.safetensors"):
        load_prompt_cache(path, net, max_len=10)
    save_prompt_cache(path, net, prefilled(net, prompt), prompt)
    data = path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    for cut in (4, 100, len(data) // 2, len(data) - 1):
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"bad\.safetensors.*corrupt or truncated"):
            load_prompt_cache(bad, net, max_len=10)
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"bad\.safetensors"):
        load_prompt_cache(bad, net, max_len=10)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, str(bad))                      # a safetensors file, not a cache
    with pytest.raises(ValueError, match="not a prompt cache"):
        load_prompt_cache(bad, net, max_len=10)
    with pytest.raises(ValueError, match="max_len"):
        load_prompt_cache(path, net, max_len=5)
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:     # a cache of version 1 (summaries without the keys' mass)
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, {**f.metadata(), "version": "1"}
    save_file(tensors, str(bad), metadata=metadata)
    with pytest.raises(ValueError, match="format version '1'; this polyformer reads version 2"):
        load_prompt_cache(bad, net, max_len=10)


def test_bad_save_arguments(tmp_path):
    net = build()
    prompt = ids(1, 6, 32)
    state = prefilled(net, prompt)
    with pytest.raises(ValueError, match="prompt must have shape"):
        save_prompt_cache(tmp_path / "x.safetensors", net, state, prompt[:, :4])
    with pytest.raises(TypeError, match="DecodeState"):
        save_prompt_cache(tmp_path / "x.safetensors", net, {"k": 1}, prompt)
    assert os.listdir(tmp_path) == []


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    net = build()
    prompt = ids(1, 6, 32)
    state = prefilled(net, prompt)

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", half_written)   # what save_tensors calls
    path = tmp_path / "seed.safetensors"
    with pytest.raises(OSError, match="disk full"):
        save_prompt_cache(path, net, state, prompt)
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    save_prompt_cache(path, net, state, prompt)            # an existing cache survives a failed overwrite
    before = path.read_bytes()
    monkeypatch.setattr("safetensors.torch.save_file", half_written)   # what save_tensors calls
    with pytest.raises(OSError):
        save_prompt_cache(path, net, state, prompt)
    assert os.listdir(tmp_path) == ["seed.safetensors"] and path.read_bytes() == before
