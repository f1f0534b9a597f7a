"""Cached decoding with every pattern equals uncached decoding; a windowed Decoder's decode state
keeps the window (and sinks) alone, however long generation runs, and prompts longer than it run in
exact chunks."""

from __future__ import annotations

import pytest
import torch

from polyformer import AutoregressiveWrapper, Decoder, TransformerWrapper

from .definitions import CASES, H

DECODERS = [name for name, (_, _, kinds) in CASES.items() if True in kinds] + ["bigbird", "longnet"]
EXTRA = {"bigbird": dict(attn_window=6, attn_global_tokens=2, attn_random_blocks=1, attn_block_size=4),
         "longnet": dict(attn_dilated=((4, 1), (8, 2), (16, 4)))}


def lm(max_seq_len: int = 64, position: str = "rotary_pos_emb", **keywords) -> AutoregressiveWrapper:
    torch.manual_seed(0)
    net = TransformerWrapper(num_tokens=40, max_seq_len=max_seq_len, use_abs_pos_emb=False,
                             attn_layers=Decoder(dim=32, depth=2, heads=H, attn_dim_head=8, **{position: True},
                                                 **keywords))
    return AutoregressiveWrapper(net).eval()


@pytest.mark.parametrize("name", DECODERS)
def test_cached_greedy_decoding_equals_uncached(name):
    keywords = EXTRA.get(name) or CASES[name][0]
    model = lm(**keywords)
    prompt = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :3] = False                                     # a left-padded row
    cached = model.generate(prompt, 30, temperature=0.0, mask=mask)
    assert torch.equal(cached, model.generate(prompt, 30, temperature=0.0, mask=mask, cache_kv=False))
    assert torch.equal(cached[1:], model.generate(prompt[1:], 30, temperature=0.0))


@pytest.mark.parametrize("position", ["rotary_pos_emb", "alibi_pos_emb"])
@pytest.mark.parametrize("sinks", [0, 2])
def test_windowed_decode_state_stays_at_the_window_far_past_max_seq_len(position, sinks):
    w = 8
    keywords = dict(attn_window=w, **({"attn_sink_tokens": sinks} if sinks else {}))
    model = lm(max_seq_len=16, position=position, **keywords)
    assert model.net.attn_layers.window == (sinks, w)
    prompt = torch.randint(0, 40, (1, 20), generator=torch.Generator().manual_seed(2))   # longer than the state
    state = model.net.new_state(1, sinks + w + 4)
    out = model.generate(prompt, 4 * w, temperature=0.0, state=state)
    assert state.k.shape[3] == sinks + w + 1 and state.length == 20 + 4 * w - 1   # a ring (+ 1 to roll back)
    assert torch.equal(out, model.generate(prompt, 4 * w, temperature=0.0, cache_kv=False))
    assert torch.equal(out, model.generate(prompt, 4 * w, temperature=0.0))   # the default state: bounded too
