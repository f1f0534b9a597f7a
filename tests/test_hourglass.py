"""Hourglass (polyformer/hourglass.py, arXiv:2110.13711): causal through the shift, equal to the paper's
formula written out, factor 1 is the plain stack, the shortened layers see n / k positions, cached steps
(rollback, reorder, clone) equal the full forward, bad input is refused by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper, speculative_generate
from polyformer.interfaces import Context
from polyformer.memory.kv_cache import DecodeState
from tests.helpers import ids, tiny_lm
from tests.options import perturb

NUM_TOKENS = 64


def model(seed: int = 0, **keywords) -> TransformerWrapper:
    torch.manual_seed(seed)
    keywords.setdefault("depth", 3)
    return perturb(tiny_lm(num_tokens=NUM_TOKENS, rotary_pos_emb=True, **keywords), seed + 1, scale=0.05)


@pytest.mark.parametrize("keywords", [
    dict(hourglass=2),
    dict(hourglass=3, hourglass_pool="average", hourglass_upsample="repeat"),
    dict(hourglass=(2, 2), depth=5),
], ids=["2", "3_average_repeat", "2x2"])
def test_perturbing_a_future_token_never_changes_past_outputs(keywords):
    net = model(**keywords)
    x = ids(2, 13)
    out = net(x)
    for t in range(12):
        y = x.clone()
        y[:, t + 1] = (y[:, t + 1] + 1) % NUM_TOKENS         # one future token, every group boundary in turn
        out_y = net(y)
        assert_close(out_y[:, :t + 1], out[:, :t + 1], rtol=0, atol=0)
        assert not torch.allclose(out_y[:, t + 1], out[:, t + 1])


@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "encoder"])
def test_equals_the_paper_formula_written_out(causal):
    """pre layer; shift right by k - 1 (a Decoder), groups of k concatenated and projected; the shortened
    layer; each shortened vector projected to k vectors, added to the pre layer's output; post layer."""
    k, n = 3, 12
    torch.manual_seed(0)
    stack = (Decoder if causal else Encoder)(dim=16, depth=3, heads=2, hourglass=k, rotary_pos_emb=True)
    perturb(stack, scale=0.05)
    blocks, level = stack.blocks, stack.hourglass.resample[0]
    x = torch.randn(2, n, 16)

    def run(h, part, length):
        ctx = Context(pos=torch.arange(length)[None], causal=causal)
        for block in part:
            h = block(h, ctx, None)[0]
        return h

    h = run(x, blocks[0:2], n)
    shifted = F.pad(h, (0, 0, k - 1, 0))[:, :n] if causal else h
    s = level.pool(shifted.reshape(2, n // k, k * 16))
    s = run(s, blocks[2:4], n // k)
    h = h + level.up(s).reshape(2, n, 16)
    expected = stack.final_norm(run(h, blocks[4:6], n))
    assert_close(stack(x), expected, rtol=1e-5, atol=1e-5)


def test_factor_one_is_the_plain_stack_and_merges_into_the_next_level():
    plain, one = model(depth=4), model(depth=4, hourglass=1, seed=7)
    one.load_state_dict(plain.state_dict(), strict=True)
    x = ids(2, 11)
    assert_close(one(x), plain(x), rtol=0, atol=0)
    # a level of factor 1 adds its layers to the next: (1@1, 1@1, 1@2, 0@1, 1@1) is (2@1, 1@2, 1@1)
    nested, merged = model(depth=4, hourglass=(1, 2), hourglass_depths=(1, 1, 1, 0, 1), seed=3), \
        model(depth=4, hourglass=2, hourglass_depths=(2, 1, 1))
    nested.load_state_dict(merged.state_dict(), strict=True)
    assert_close(nested(x), merged(x), rtol=0, atol=0)
    assert not torch.allclose(merged(x), model(depth=4)(x))


@pytest.mark.parametrize("n", [12, 13])
def test_shortened_layers_run_on_n_over_k_positions(n):
    net = model(depth=5, hourglass=(2, 3), hourglass_depths=(1, 1, 1, 1, 1))
    seen: dict[int, int] = {}

    def record(index: int):
        def hook(_, args) -> None:
            seen[index] = args[0].shape[1]
        return hook

    for index, block in enumerate(net.attn_layers.blocks):
        block.register_forward_pre_hook(record(index))
    net(ids(2, n))
    half = math.ceil(n / 2)
    expected = [n, half, math.ceil(half / 3), half, n]           # pre, pre, middle, post, post: one layer each
    assert [seen[i] for i in range(10)] == [length for length in expected for _ in range(2)]


def test_a_left_padded_row_computes_what_it_computes_alone():
    net = model(hourglass=3, num_memory_tokens=2)
    x = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    padded = net(x, mask=mask, pos=pos)
    assert_close(padded[1, 5:], net(x[1:, 5:])[0], rtol=1e-5, atol=1e-5)


def cached(net, x, mask, pos, sizes, state):
    chunks, t = [], 0
    for size in sizes:
        part = dict(mask=mask[:, t:t + size], pos=pos[:, t:t + size]) if t == 0 else {}
        chunks.append(net(x[:, t:t + size], state=state, **part))
        t += size
    return torch.cat(chunks, dim=1)


@pytest.mark.parametrize("keywords", [dict(hourglass=2, shift_tokens=1), dict(hourglass=(2, 3), depth=5)],
                         ids=["2", "2x3"])
def test_cached_steps_equal_the_full_forward_with_rows_in_different_phases(keywords):
    net = model(**keywords)
    x = ids(3, 17)
    mask = torch.ones(3, 17, dtype=torch.bool)
    mask[1, :3] = False                                      # rows whose groups end at different steps
    mask[2, :4] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    full = net(x, mask=mask, pos=pos)
    state = net.new_state(3, 17)
    steps = cached(net, x, mask, pos, [5, 1, 1, 3, 1, 1, 2, 1, 1, 1], state)
    assert_close(steps[mask], full[mask], rtol=1e-5, atol=1e-5)
    # every shortened token that some row completed is kept: 17 + at most one per level, not more
    assert state.child.length <= math.ceil(17 / 2) + 1


def test_rollback_reorder_and_clone_continue_exactly():
    net = model(depth=5, hourglass=(2, 2))
    x = ids(3, 14)
    state = net.new_state(3, 14, history=4)
    net(x[:, :11], state=state)
    assert (state.child.length, state.child.child.length) == (6, 3)     # groups of 2 after the shift, then of 2
    state.rollback(4)                                        # positions 7 ... 10 forgotten, at every level
    assert (state.length, state.child.length, state.child.child.length) == (7, 4, 2)
    resumed = net(x[:, 11:14], state=state)
    fresh = net(torch.cat((x[:, :7], x[:, 11:14]), dim=1))[:, -3:]
    assert_close(resumed, fresh, rtol=1e-5, atol=1e-5)
    state = net.new_state(3, 14)
    net(x[:, :9], state=state)
    copy = state.clone()
    order = torch.tensor([2, 0, 0])
    state.reorder(order)
    assert_close(net(x[order, 9:], state=state), net(x[order])[:, 9:], rtol=1e-5, atol=1e-5)
    assert_close(net(x[:, 9:], state=copy), net(x)[:, 9:], rtol=1e-5, atol=1e-5)


def test_speculative_greedy_decoding_equals_greedy_generation():
    """Speculative decoding rolls the rejected draft tokens back at every resolution."""
    target, draft = model(depth=5, hourglass=(2, 2)), model(seed=4, depth=1)
    prompts = ids(2, 5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, :2] = False
    greedy = AutoregressiveWrapper(target).generate(prompts, 12, temperature=0.0, mask=mask, cache_kv=False)
    result = speculative_generate(target, draft, prompts, 12, gamma=3, temperature=0.0, mask=mask)
    assert torch.equal(result.tokens, greedy)
    assert 0 < result.acceptance_rate < 1                   # some draft tokens were rolled back


def test_bfloat16_stays_close_to_float32():
    net = model(hourglass=2)
    x = ids(2, 12)
    full = net(x)
    low = net.to(torch.bfloat16)(x)
    assert low.dtype == torch.bfloat16
    assert_close(low.float(), full, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("keywords, match", [
    (dict(hourglass=0), "hourglass must be a shortening factor >= 1"),
    (dict(hourglass=(2, -1)), "hourglass must be a shortening factor >= 1"),
    (dict(hourglass=2.0), "hourglass must be a shortening factor >= 1"),
    (dict(hourglass=()), "hourglass must be a shortening factor >= 1"),
    (dict(hourglass=2, hourglass_depths=(1, 2)), "hourglass_depths needs 3 layer counts"),
    (dict(hourglass=2, hourglass_depths=(1, 1, 2)), r"hourglass_depths=\(1, 1, 2\) counts 4 layers; depth is 3"),
    (dict(hourglass=2, hourglass_depths=(2, 0, 1)), "the middle, shortened segment needs at least one layer"),
    (dict(hourglass=2, hourglass_depths=3), "keyword 'hourglass_depths'"),
    (dict(hourglass_depths=(1, 1, 1)), "hourglass_depths need"),
    (dict(hourglass=2, hourglass_pool="max"), "hourglass_pool must be 'linear' or 'average'"),
    (dict(hourglass=2, hourglass_upsample="attention"), "hourglass_upsample must be 'linear' or 'repeat'"),
    (dict(hourglass=2, custom_layers=("a", "f", "a", "f", "f", "a")), "custom_layers makes the layout 'afaffa'"),
    (dict(hourglass=2, reversible=True), "hourglass cannot combine with reversible=True"),
    (dict(hourglass=2, universal=True), "hourglass cannot combine with universal=True"),
    (dict(hourglass=2, attn_local_2d=dict(image=(3, 4), query=(1, 2), memory=(1, 1))), "attn_local_2d"),
])
def test_bad_keywords_are_refused_by_name(keywords, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Decoder(dim=16, heads=2, **{"depth": 3, **keywords})


def test_what_an_hourglass_stack_cannot_take_is_refused_by_name(tmp_path):
    net = model(hourglass=2)
    x = ids(2, 8)
    with pytest.raises(ValueError, match="mems: an hourglass stack"):
        net.attn_layers(torch.randn(2, 8, 32), mems=[torch.randn(2, 4, 32)] * 3)
    with pytest.raises(ValueError, match="prefix_len"):
        net(x, prefix_len=3)
    with pytest.raises(ValueError, match="max_mem_len=4 cannot combine with hourglass"):
        TransformerWrapper(num_tokens=8, max_seq_len=8, max_mem_len=4,
                           attn_layers=Decoder(dim=16, depth=3, hourglass=2))
    with pytest.raises(ValueError, match="state: an hourglass stack"):
        net(x, state=DecodeState(3, 2, 8, 4, 8, 4, 8))
    state = net.new_state(2, 8)
    net(x[:, :4], state=state)
    with pytest.raises(ValueError, match="hourglass decode state cannot slide"):
        state.slide(2)
    pytest.importorskip("safetensors")
    from polyformer import save_prompt_cache

    with pytest.raises(ValueError, match="hourglass"):
        save_prompt_cache(tmp_path / "cache.safetensors", net, state, x[:, :4])
