"""Per-layer attention options (attn_per_layer, polyformer/per_layer.py): per-block options equal to the
stack's own change nothing; a mixed stack is exactly its one-layer stacks composed (window / full, two
patterns sharing one forward, heads of their own); cached == uncached for mixed Decoders (keys and
recurrent blocks, the fast decode step, windows of two spans in a sliding state, local and LSH layers);
the config round-trips through JSON; every reader of the blocks' attention reads each block's own; bad
input is named."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, LayersConfig, TransformerWrapper
from polyformer.build import build_model, model_config
from polyformer.config import from_dict, to_dict
from polyformer.generate.fast import FastStep
from tests.helpers import ids, tiny_lm
from tests.options import perturb

LSH = dict(attn_lsh=True, attn_shared_qk=True, attn_lsh_bucket_size=4, attn_lsh_n_hashes=2, attn_lsh_n_buckets=4)


def test_per_layer_options_equal_to_the_stack_own_change_nothing():
    torch.manual_seed(0)
    common = dict(dim=32, depth=2, heads=4, rotary_pos_emb=True, attn_kv_heads=2)
    plain = perturb(Decoder(**common, attn_window=3))
    per = Decoder(**common, attn_per_layer=[dict(attn_window=3)] * 2)
    assert per.cfg.attention_layers == (plain.cfg.attention,) * 2
    per.load_state_dict(plain.state_dict())
    x = torch.randn(2, 12, 32)
    assert torch.equal(per(x), plain(x))
    full = Decoder(**common)
    full.load_state_dict(plain.state_dict())
    assert (full(x) - plain(x)).abs().max() > 1e-3          # the window is felt: the comparison can fail


def composed(stack: type, per_layer: list[dict], common: dict, x: torch.Tensor, **forward) -> tuple:
    """(the two-layer stack with attn_per_layer, its two one-layer stacks with those options applied in
    turn) on x, with the same weights. Post-norm: a one-layer stack then has no final norm of its own.
    `forward` goes to the whole stack and to the one-layer stacks with options (a full one takes no
    global_mask: it already shows every key)."""
    torch.manual_seed(0)
    whole = perturb(stack(depth=2, pre_norm=False, attn_per_layer=per_layer, **common))
    state = whole.state_dict()
    out = x
    for i, options in enumerate(per_layer):
        one = stack(depth=1, pre_norm=False, **{**common, **options})
        one.load_state_dict({k.replace(f"blocks.{2 * i + j}.", f"blocks.{j}."): v for k, v in state.items()
                             for j in (0, 1) if k.startswith(f"blocks.{2 * i + j}.")})
        out = one(out, **(forward if options else {}))
    return whole(x, **forward), out


PAIRS = {
    "window_full": (Decoder, [dict(attn_window=3), {}]),
    "full_window_bidirectional": (Encoder, [{}, dict(attn_window=4)]),
    "window_block_local": (Decoder, [dict(attn_window=3), dict(attn_block_local=(4, 4))]),   # two patterns, one forward
    "dilated_heads_2_and_4": (Encoder, [dict(attn_dilated=((4, 1), (8, 2)), heads=2),     # geometries per head count
                                        dict(attn_dilated=((4, 1), (8, 2)))]),
    "performer_dense": (Decoder, [dict(attn_performer=True, attn_performer_features=16), {}]),
}


@pytest.mark.parametrize("name", PAIRS)
def test_a_mixed_stack_is_its_one_layer_stacks_composed(name):
    stack, per_layer = PAIRS[name]
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, parts = composed(stack, per_layer, dict(dim=32, heads=4, rotary_pos_emb=True), x)
    assert_close(whole, parts, atol=1e-5, rtol=1e-5)


def test_a_global_mask_reaches_the_patterned_blocks_of_a_mixed_encoder():
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    marked = torch.zeros(2, 16, dtype=torch.bool)
    marked[:, 0] = True
    with torch.no_grad():
        whole, parts = composed(Encoder, [dict(attn_window=4), {}], dict(dim=32, heads=4), x, global_mask=marked)
        plain, _ = composed(Encoder, [dict(attn_window=4), {}], dict(dim=32, heads=4), x)
    assert_close(whole, parts, atol=1e-5, rtol=1e-5)
    assert (whole - plain).abs().max() > 1e-3


DECODE = {
    "window_dense": [dict(attn_window=3), {}],
    "dense_performer": [{}, dict(attn_performer=True, attn_performer_features=16, attn_performer_chunk=4)],
    "linear_window_kv_heads": [dict(attn_linear="elu", attn_kv_heads=4), dict(attn_window=5, attn_num_mem_kv=2)],
    "block_local_lsh": [dict(attn_block_local=(4, 4)), LSH],      # LSH per bucket: it decodes
}


@pytest.mark.parametrize("name", DECODE)
def test_cached_steps_equal_uncached_forward_for_a_mixed_decoder(name):
    torch.manual_seed(0)
    model = perturb(tiny_lm(rotary_pos_emb=True, attn_per_layer=DECODE[name]), scale=0.05)
    x = ids(2, 14)
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[1, :4] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(x, mask=mask, pos=pos)
        state = model.new_state(2, 14)
        chunks = [model(x[:, :6], mask=mask[:, :6], pos=pos[:, :6], state=state)]
        chunks += [model(x[:, t:t + 1], state=state) for t in range(6, 10)] + [model(x[:, 10:], state=state)]
    keep = mask[:, :, None].expand_as(full)
    assert_close(torch.cat(chunks, 1)[keep], full[keep], atol=1e-5, rtol=1e-5)
    kinds = {"dense_performer": ("keys", "recurrent"), "linear_window_kv_heads": ("recurrent", "keys")}
    assert state.kinds == kinds.get(name, ("keys", "keys"))


def test_the_fast_decode_step_runs_each_block_with_its_own_options():
    torch.manual_seed(0)
    model = perturb(tiny_lm(attn_per_layer=[dict(rotary_pos_emb=True, attn_sparse_topk=3), dict(gate_values=True)]),
                    scale=0.05)
    assert FastStep.unsupported(model) is None
    ar = AutoregressiveWrapper(model)
    prompts = ids(2, 5)
    cached = ar.generate(prompts, 10, temperature=0.0)
    assert torch.equal(cached, ar.generate(prompts, 10, temperature=0.0, cache_kv=False))


def test_windows_of_two_spans_slide_a_state_that_keeps_the_longer():
    torch.manual_seed(0)
    model = perturb(tiny_lm(rotary_pos_emb=True, max_seq_len=64, attn_per_layer=[dict(attn_window=3),
                                                                                 dict(attn_window=6)]), scale=0.05)
    assert model.attn_layers.window == (0, 6)
    ar = AutoregressiveWrapper(model)
    prompts = ids(1, 4)
    cached = ar.generate(prompts, 40, temperature=0.0)             # a ring of 6 slots per layer
    assert torch.equal(cached, ar.generate(prompts, 40, temperature=0.0, cache_kv=False))
    assert len(set(cached.flatten().tolist())) > 3


def test_blocks_that_carry_positions_turn_the_absolute_ones_off_by_default():
    layers = Decoder(dim=32, depth=2, heads=4, attn_per_layer=[{}, dict(rotary_pos_emb=True)])
    assert layers.has_pos_emb and layers.blocks[2].branch.position is not None
    assert layers.blocks[0].branch.position is None
    assert TransformerWrapper(num_tokens=16, max_seq_len=8, attn_layers=layers).pos_emb is None


@pytest.mark.parametrize("name", ["dense_performer", "linear_window_kv_heads", "block_local_lsh"])
def test_the_config_round_trips_through_json_and_rebuilds_the_same_model(name):
    model = tiny_lm(rotary_pos_emb=True, seed=0, attn_per_layer=DECODE[name])
    cfg = model.attn_layers.cfg
    assert from_dict(LayersConfig, to_dict(cfg)) == cfg
    rebuilt = build_model(model_config(model))
    rebuilt.load_state_dict(model.state_dict())
    assert rebuilt.attn_layers.cfg == cfg
    x = ids(2, 12)
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(x), model(x))


BAD = {
    "not_a_list": (dict(attn_per_layer=dict(attn_window=4)), TypeError, "attn_per_layer"),
    "too_few": (dict(attn_per_layer=[{}]), ValueError, r"attn_per_layer has 1 entries; the stack has 2 self-attention"),
    "not_attention": (dict(attn_per_layer=[dict(ff_mult=2), {}]), TypeError, r"attn_per_layer\[0\]: 'ff_mult' is not"),
    "unknown": (dict(attn_per_layer=[{}, dict(attn_windw=4)]), TypeError,
                r"attn_per_layer\[1\].*'attn_windw'.*'attn_window'"),
    "bad_value": (dict(attn_per_layer=[{}, dict(attn_window=0)]), ValueError, r"attn_per_layer\[1\]: attn_window"),
    "score_bias": (dict(attn_per_layer=[dict(alibi_pos_emb=True), {}]), TypeError,
                   r"attn_per_layer\[0\]: 'alibi_pos_emb'"),
    "infused": (dict(attn_per_layer=[{}, dict(position_infused_attn=True)]), TypeError, "position_infused_attn"),
    "clash_inside": (dict(attn_per_layer=[dict(attn_lsh=True, attn_performer=True), {}]), ValueError,
                     r"attn_per_layer\[0\]: attn_performer and attn_lsh conflict"),
    "switch_off": (dict(rotary_pos_emb=True, attn_per_layer=[{}, dict(rotary_pos_emb=False)]), ValueError,
                   r"attn_per_layer\[1\]: rotary_pos_emb=False cannot switch off"),
    "kernel_rule": (dict(attn_per_layer=[{}, dict(LSH, attn_num_mem_kv=2)]), ValueError,
                    r"attn_per_layer\[1\]: attn_num_mem_kv .* attn_lsh"),
    "decode_dims": (dict(attn_per_layer=[dict(attn_kv_heads=2), {}]), ValueError,
                    r"attn_per_layer\[0\] and attn_per_layer\[1\] keep keys of different shapes"),
    "mixer": (dict(gau=True, attn_per_layer=[{}, {}]), ValueError, "attn_per_layer .* gau"),
    "bias_heads": (dict(rel_pos_bias=True, attn_per_layer=[{}, dict(heads=2)]), ValueError,
                   r"attn_per_layer\[1\]: heads=2 differs from the stack's heads=4, but the stack's score bias "
                   r"\(rel_pos_bias\)"),
    "residual_attn": (dict(residual_attn=True, attn_per_layer=[{}, dict(heads=2)]), ValueError,
                      r"attn_per_layer\[1\]: residual_attn=True"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_refused_by_name_with_the_block_index(name):
    keywords, error, match = BAD[name]
    with pytest.raises(error, match=match):
        Decoder(dim=32, depth=2, heads=4, **keywords)


def test_key_shapes_may_differ_where_nothing_decodes():
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, parts = composed(Encoder, [dict(attn_kv_heads=2), dict(heads=2, attn_dim_head=16)], dict(dim=32, heads=4), x)
    assert_close(whole, parts, atol=1e-5, rtol=1e-5)


def test_a_config_built_by_hand_is_checked_by_the_same_rules():
    """from_config (a saved JSON) meets the checks the keywords meet, named by the keyword."""
    cfg = Decoder(dim=32, depth=2, heads=4, rel_pos_bias=True, attn_per_layer=[{}, {}]).cfg
    other = Decoder(dim=32, depth=2, heads=4).cfg.attention
    with pytest.raises(ValueError, match=r"attn_per_layer\[1\]: the score bias"):
        Decoder.from_config(LayersConfig(**{**cfg.__dict__, "attention_layers": (cfg.attention, other)}))
    bad = Decoder(dim=32, depth=2, heads=4, attn_per_layer=[dict(attn_window=2), {}]).cfg
    window = bad.attention_layers[0].pattern[0]
    broken = window.__class__(window.stage, window.name, window.options.__class__(size=-1))
    layer = bad.attention_layers[0].__class__(**{**bad.attention_layers[0].__dict__, "pattern": (broken,)})
    with pytest.raises(ValueError, match=r"attn_per_layer\[0\]: .*attn_window"):
        Decoder.from_config(LayersConfig(**{**bad.__dict__, "attention_layers": (layer, bad.attention_layers[1])}))
