"""Per-layer absolute positions (abs_pos_per_layer, position/per_layer_abs.py; Al-Rfou et al. 2019)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper
from polyformer.generate.fast import FastStep
from tests.helpers import ids, tiny_lm
from tests.options import perturb


def lm(seed: int = 0, **keywords) -> TransformerWrapper:
    return perturb(tiny_lm(seed=seed, max_seq_len=16, abs_pos_per_layer=True, **keywords), seed + 1, 0.05)


def block_io(model: TransformerWrapper) -> tuple[list, list]:
    """Forward hooks recording each block's input stream x and output stream."""
    ins, outs = [], []
    for block in model.attn_layers.blocks:
        block.register_forward_pre_hook(lambda m, args: ins.append(args[0]))
        block.register_forward_hook(lambda m, args, out: outs.append(out[0]))
    return ins, outs


@pytest.mark.parametrize("keywords", [dict(), dict(num_memory_tokens=2, macaron=True)])
def test_each_self_attention_block_reads_its_own_table_at_the_stack_positions(keywords):
    model = lm(**keywords)
    assert model.pos_emb is None                    # the first layer's table replaces the input positions
    stack, m = model.attn_layers, model.num_memory_tokens
    ins, outs = block_io(model)
    x = ids(2, 9)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 2, 3, 4, 5, 6]])   # row 1 left-padded
    with torch.no_grad():
        model(x, pos=pos)
    stack_pos = torch.cat((torch.arange(m)[None].expand(2, -1), pos + m), dim=1)
    emb = model.token_emb(x)
    if m:
        emb = torch.cat((model.memory_tokens.tokens.expand(2, -1, -1), emb), dim=1)
    tables = stack.layer_pos.tables
    table = 0
    for i, block in enumerate(stack.blocks):
        before = emb if i == 0 else outs[i - 1]
        if block.kind == "a":
            before = before + tables[table](stack_pos)
            table += 1
        assert_close(ins[i], before)
    assert table == len(tables) == 2 and not torch.equal(tables[0].weight, tables[1].weight)


def test_cached_decoding_equals_the_uncached_forward_and_the_fast_step_steps_aside():
    model = lm(attn_kv_heads=2)
    x = ids(2, 12)
    full = model(x)
    state = model.new_state(2, 12)
    steps = [model(x[:, :5], state=state)] + [model(x[:, t:t + 1], state=state) for t in range(5, 12)]
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert "abs_pos_per_layer" in FastStep.unsupported(model)
    ar = AutoregressiveWrapper(model)
    assert torch.equal(ar.generate(x[:, :4], 6, temperature=0.0), ar.generate(x[:, :4], 6, temperature=0.0,
                                                                           cache_kv=False))


def test_xl_memories_continue_the_positions_so_segment_two_equals_one_long_forward():
    """Tables read at the stack's positions: a segment after its memories sits where it sits in one forward."""
    model = lm(max_mem_len=6)
    x = ids(2, 12)
    whole = model(x)
    first, mems = model(x[:, :6], return_mems=True)
    second = model(x[:, 6:], mems=mems)
    assert_close(torch.cat((first, second), dim=1), whole, atol=1e-5, rtol=1e-5)


def test_positions_past_the_tables_are_refused_by_name():
    model = lm(max_mem_len=4)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(ids(1, 17))
    too_long = [torch.randn(1, 5, 32) for _ in range(2)]     # memories longer than max_mem_len
    with pytest.raises(ValueError, match="abs_pos_per_layer"):
        model(ids(1, 16), mems=too_long)
    assert model.bounded


@pytest.mark.parametrize("keywords, match, error", [
    (dict(abs_pos_per_layer="yes"), "abs_pos_per_layer must be True or False", TypeError),
    (dict(abs_pos_per_layer=True, use_abs_pos_emb=True), "cannot combine with use_abs_pos_emb=True", ValueError),
    (dict(abs_pos_per_layer=True, scaled_sinu_pos_emb=True), "scaled_sinu_pos_emb", ValueError),
    (dict(abs_pos_per_layer=True, axial_pos_emb=(4, 8)), "axial_pos_emb", ValueError),
    (dict(abs_pos_per_layer=True, position_infused_attn=True), "position_infused_attn", ValueError),
    (dict(abs_pos_per_layer=True, reversible=True), "reversible", ValueError),
    (dict(abs_pos_per_layer=True, universal=True), "universal", ValueError),
    (dict(abs_pos_per_layer=True, custom_layers="f"), "needs self-attention blocks", ValueError),
])
def test_bad_combinations_fail_when_built_naming_the_keywords(keywords, match, error):
    with pytest.raises(error, match=match):
        tiny_lm(**keywords)


def test_a_stack_takes_tables_from_one_wrapper_only_and_encoders_get_them_too():
    stack = Encoder(dim=16, depth=2, heads=2)
    TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=stack, abs_pos_per_layer=True)
    with pytest.raises(ValueError, match="already carries per-layer positions"):
        TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=stack, abs_pos_per_layer=True)
    model = TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=Decoder(dim=16, depth=1, heads=2),
                               abs_pos_per_layer=False)
    assert model.attn_layers.layer_pos is None and model.pos_emb is not None
