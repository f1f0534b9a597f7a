"""polyformer/keywords.py and polyformer/rules.py: the keyword table, conflicts, later spellings,
one test per rule, and the JSON round trip of the config."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import pytest

from polyformer import registry
import torch

from polyformer import (
    AttentionConfig,
    AttentionLayers,
    ContinuousTransformerWrapper,
    CrossAttender,
    Decoder,
    Encoder,
    FeedForwardConfig,
    LayersConfig,
    TransformerWrapper,
    ViTransformerWrapper,
    XTransformer,
)
from polyformer import config as config_mod
from polyformer.config import stack_options
from polyformer import rules
from polyformer.attention.kernels.dense import DenseKernel
from polyformer.keywords import KEYWORDS, parse_layers

SMALL = dict(dim=32, depth=2)


# ------------------------------------------------------------------------------------------------
# unknown keywords

@pytest.mark.parametrize("build, bad, suggestion", [
    (lambda: Decoder(dim=32, depth=2, attn_flsh=True), "attn_flsh", "attn_flash"),
    (lambda: Encoder(dim=32, depth=2, rotary_pos_embb=True), "rotary_pos_embb", "rotary_pos_emb"),
    (lambda: AttentionLayers(dim=32, depth=2, hedas=4), "hedas", "heads"),
    (lambda: TransformerWrapper(num_token=256, max_seq_len=16, attn_layers=Decoder(**SMALL)),
     "num_token", "num_tokens"),
    (lambda: TransformerWrapper(num_tokens=256, max_seq_len=16, attn_layers=Decoder(**SMALL),
                                max_mem_lenn=8), "max_mem_lenn", "max_mem_len"),
    (lambda: ContinuousTransformerWrapper(max_seq_len=16, attn_layers=Decoder(**SMALL), dim_inn=8),
     "dim_inn", "dim_in"),
    (lambda: ViTransformerWrapper(image_size=32, patch_size=8, attn_layers=Encoder(**SMALL),
                                  num_clases=10), "num_clases", "num_classes"),
    (lambda: XTransformer(dim=32, enc_num_tokens=16, enc_dpth=2, enc_max_seq_len=8,
                          dec_num_tokens=16, dec_depth=2, dec_max_seq_len=8), "enc_dpth", "enc_depth"),
    (lambda: XTransformer(dim=32, enc_num_tokens=16, enc_depth=2, enc_max_seq_len=8,
                          dec_num_tokens=16, dec_depth=2, dec_max_seq_len=8, tie_token_embb=True),
     "tie_token_embb", "tie_token_emb"),
], ids=["decoder", "encoder", "attention_layers", "wrapper", "wrapper_mem", "continuous", "vit",
        "xtransformer", "xtransformer_own"])
def test_unknown_keyword_names_it_and_closest(build, bad, suggestion):
    with pytest.raises(TypeError) as err:
        build()
    msg = str(err.value)
    assert repr(bad) in msg
    assert repr(suggestion) in msg
    assert "did you mean" in msg


def test_unknown_keyword_without_close_match_still_names_it():
    with pytest.raises(TypeError, match="zzqqxx"):
        Decoder(dim=32, depth=2, zzqqxx=1)


def test_xtransformer_refuses_keywords_it_sets_itself():
    base = dict(dim=32, enc_num_tokens=16, enc_depth=2, enc_max_seq_len=8,
                dec_num_tokens=16, dec_depth=2, dec_max_seq_len=8)
    with pytest.raises(TypeError, match="dec_cross_attend"):
        XTransformer(**base, dec_cross_attend=True)
    with pytest.raises(TypeError, match="enc_dim"):
        XTransformer(**base, enc_dim=64)


def test_encoder_refuses_causal():
    with pytest.raises(TypeError, match="causal"):
        Encoder(dim=32, depth=2, causal=True)
    with pytest.raises(TypeError, match="causal"):
        Encoder(dim=32, depth=2, causal=False)
    with pytest.raises(TypeError, match="causal"):
        Decoder(dim=32, depth=2, causal=False)
    with pytest.raises(TypeError, match="only_cross"):
        CrossAttender(dim=32, depth=2, only_cross=False)


def test_missing_dim_or_depth():
    with pytest.raises(TypeError, match="depth"):
        Decoder(dim=32)
    with pytest.raises(TypeError, match="dim"):
        Decoder(depth=2)


def test_flag_keyword_needs_a_bool():
    with pytest.raises(TypeError, match="rotary_pos_emb"):
        Decoder(dim=32, depth=2, rotary_pos_emb="yes")
    with pytest.raises(TypeError, match="pre_norm"):
        Decoder(dim=32, depth=2, pre_norm=1)


# ------------------------------------------------------------------------------------------------
# conflicting keywords: two keywords writing the same field

@pytest.mark.parametrize("first, second", [
    ("rotary_pos_emb", "position_infused_attn"),
    ("rel_pos_bias", "alibi_pos_emb"),
    ("use_scalenorm", "use_rmsnorm"),
    ("use_rezero", "gate_residual"),
    ("use_rezero", "use_scalenorm"),
    ("rel_pos_bias", "alibi_pos_bias"),
])
def test_conflicting_keywords_name_both(first, second):
    with pytest.raises(ValueError) as err:
        Decoder(dim=32, depth=2, **{first: True, second: True})
    msg = str(err.value)
    assert repr(first) in msg and repr(second) in msg
    # either order
    with pytest.raises(ValueError) as err:
        Decoder(dim=32, depth=2, **{second: True, first: True})
    assert repr(first) in str(err.value) and repr(second) in str(err.value)


def test_same_value_twice_is_no_conflict():
    a = Decoder(dim=32, depth=2, alibi_pos_emb=True, alibi_pos_bias=True).cfg
    assert a.attention.bias == "alibi"
    b = Decoder(dim=32, depth=2, gate_values=True, attn_gate_values=True).cfg
    assert b.attention.gate_values
    c = Decoder(dim=32, depth=2, attn_one_kv_head=True, attn_kv_heads=1).cfg
    assert c.attention.kv_heads == 1


def test_false_flags_write_nothing():
    assert Decoder(dim=32, depth=2, rotary_pos_emb=False, position_infused_attn=True).cfg.attention.position \
        == "infused"
    assert Decoder(dim=32, depth=2, use_scalenorm=False, use_rmsnorm=False).cfg == Decoder(dim=32, depth=2).cfg


# ------------------------------------------------------------------------------------------------
# later x-transformers spellings

@pytest.mark.parametrize("new, old", [
    (dict(alibi_pos_bias=True), dict(alibi_pos_emb=True)),
    (dict(alibi_pos_bias=True, alibi_num_heads=2), dict(alibi_pos_emb=True, alibi_num_heads=2)),
    (dict(attn_gate_values=True), dict(gate_values=True)),
    (dict(attn_one_kv_head=True), dict(attn_kv_heads=1)),
])
def test_later_spellings_equal_old(new, old):
    a = Decoder(dim=32, depth=2, heads=4, **new)
    b = Decoder(dim=32, depth=2, heads=4, **old)
    assert a.cfg == b.cfg
    assert a.cfg != Decoder(dim=32, depth=2, heads=4).cfg
    # same config, same modules: the weights of one load into the other and outputs agree
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(a.eval()(x), b.eval()(x))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of the dense kernel's fused and reference paths."""
    calls = {"fused": 0, "reference": 0}
    for name in calls:
        original = getattr(DenseKernel, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(DenseKernel, name, spy)
    return calls


def test_attn_flash_true_uses_fused_kernel(kernel_calls):
    model = Decoder(dim=32, depth=2, heads=4, attn_flash=True).eval()
    assert model.cfg.attention.fused is True
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        model(x)
    assert kernel_calls == {"fused": 2, "reference": 0}


def test_attn_flash_false_uses_reference(kernel_calls):
    model = Decoder(dim=32, depth=2, heads=4, attn_flash=False).eval()
    assert model.cfg.attention.fused is False
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        model(x)
    assert kernel_calls == {"fused": 0, "reference": 2}


def test_attn_flash_true_and_false_agree():
    fast = Decoder(dim=32, depth=2, heads=4, attn_flash=True).eval()
    ref = Decoder(dim=32, depth=2, heads=4, attn_flash=False).eval()
    assert fast.cfg == replace(ref.cfg, attention=replace(ref.cfg.attention, fused=True))
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 9, 32)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        torch.testing.assert_close(fast(x, mask=mask), ref(x, mask=mask), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# one test per rule

def _cfg(**fields) -> LayersConfig:
    attention = fields.pop("attention", {})
    ff = fields.pop("ff", {})
    return LayersConfig(dim=fields.pop("dim", 32), depth=fields.pop("depth", 2),
                        attention=AttentionConfig(**attention), ff=FeedForwardConfig(**ff), **fields)


# (how to build: keywords for AttentionLayers, or a LayersConfig), expected substrings, id.
# "no_entmax" marks the case that hides the optional package.
RULE_CASES = [
    pytest.param(dict(dim=0, depth=2), ["dim", "0"], id="dim"),
    pytest.param(dict(dim=32, depth=0), ["depth", "0"], id="depth"),
    pytest.param(dict(dim=32, depth=2, heads=0), ["heads", "0"], id="heads"),
    pytest.param(dict(dim=32, depth=2, attn_dim_head=0), ["attn_dim_head"], id="attn_dim_head"),
    pytest.param(dict(dim=32, depth=2, attn_kv_heads=0), ["attn_kv_heads"], id="attn_kv_heads"),
    pytest.param(dict(dim=32, depth=2, heads=8, attn_kv_heads=3), ["heads", "attn_kv_heads", "8", "3"],
                 id="heads_multiple_of_kv_heads"),
    pytest.param(dict(dim=32, depth=2, attn_collab_heads=True, attn_kv_heads=1),
                 ["attn_collab_heads", "attn_kv_heads"], id="collab_heads_with_kv_heads"),
    pytest.param(dict(dim=32, depth=2, attn_collab_compression=1.5), ["attn_collab_compression"],
                 id="collab_compression"),
    pytest.param(dict(dim=32, depth=2, attn_dropout=1.0), ["attn_dropout"], id="attn_dropout"),
    pytest.param(dict(dim=32, depth=2, ff_dropout=-0.1), ["ff_dropout"], id="ff_dropout"),
    pytest.param(dict(dim=32, depth=2, ff_mult=0), ["ff_mult"], id="ff_mult"),
    pytest.param(dict(dim=32, depth=2, ff_chunks=0), ["ff_chunks", "0"], id="ff_chunks"),
    pytest.param(dict(dim=32, depth=2, attn_num_mem_kv=-1), ["attn_num_mem_kv"], id="attn_num_mem_kv"),
    pytest.param(dict(dim=32, depth=2, attn_sparse_topk=0), ["attn_sparse_topk"], id="attn_sparse_topk"),
    pytest.param(dict(dim=32, depth=2, attn_sparse_topk=8, attn_use_entmax15=True),
                 ["attn_sparse_topk", "attn_use_entmax15"], id="topk_with_entmax"),
    pytest.param(_cfg(attention=dict(normalize="topk")), ["attn_sparse_topk"], id="topk_without_k"),
    pytest.param(dict(dim=32, depth=2, attn_use_entmax15=True, no_entmax=True),
                 ["attn_use_entmax15", "entmax"], id="entmax_missing"),
    pytest.param(dict(dim=32, depth=2, alibi_num_heads=2), ["alibi_num_heads", "alibi_pos_emb"],
                 id="alibi_num_heads_without_alibi"),
    pytest.param(dict(dim=32, depth=2, heads=4, alibi_pos_emb=True, alibi_num_heads=5),
                 ["alibi_num_heads", "heads=4", "5"], id="alibi_num_heads_range"),
    pytest.param(dict(dim=32, depth=2, rotary_emb_dim=16), ["rotary_emb_dim", "rotary_pos_emb"],
                 id="rotary_emb_dim_without_rotary"),
    pytest.param(dict(dim=32, depth=2, rotary_pos_emb=True, rotary_emb_dim=3), ["rotary_emb_dim", "3"],
                 id="rotary_emb_dim_range"),
    pytest.param(dict(dim=32, depth=2, rotary_pos_emb=True, attn_dim_head=15),
                 ["rotary_pos_emb", "attn_dim_head", "15"], id="rotary_odd_dim_head"),
    pytest.param(dict(dim=32, depth=2, rel_pos_bias=True, rel_pos_num_buckets=64, rel_pos_max_distance=32),
                 ["rel_pos_num_buckets", "rel_pos_max_distance"], id="rel_pos_buckets"),
    pytest.param(dict(dim=32, depth=2, custom_layers=("a", "f"), sandwich_coef=1),
                 ["custom_layers", "sandwich_coef"], id="custom_layers_with_sandwich"),
    pytest.param(dict(dim=32, depth=2, custom_layers=("a", "x", "f")), ["custom_layers", "'x'"],
                 id="custom_layers_letters"),
    pytest.param(dict(dim=32, depth=2, custom_layers=("a", "c", "f")), ["custom_layers", "cross_attend"],
                 id="custom_layers_cross_without_cross_attend"),
    pytest.param(dict(dim=32, depth=2, cross_attend=True, custom_layers=("a", "f")), ["cross_attend", "custom_layers"],
                 id="cross_attend_without_cross_block"),
    pytest.param(dict(dim=32, depth=2, sandwich_coef=3), ["sandwich_coef", "depth=2", "3"],
                 id="sandwich_coef_range"),
    pytest.param(dict(dim=32, depth=2, sandwich_coef=1, cross_attend=True), ["sandwich_coef", "cross_attend"],
                 id="sandwich_coef_with_cross"),
    pytest.param(dict(dim=32, depth=2, only_cross=True, causal=True), ["only_cross", "causal"],
                 id="only_cross_causal"),
    pytest.param(dict(dim=32, depth=2, shift_tokens=(1, 0, 1)), ["shift_tokens", "4 blocks", "got 3"],
                 id="shift_tokens_length"),
    pytest.param(dict(dim=32, depth=2, shift_tokens=-1), ["shift_tokens", "-1"], id="shift_tokens_negative"),
    pytest.param(dict(dim=32, depth=2, cross_residual_attn=True), ["cross_residual_attn", "cross_attend"],
                 id="cross_residual_attn_without_cross"),
    pytest.param(dict(dim=32, depth=2, use_rezero=True, pre_norm=False), ["use_rezero", "pre_norm"],
                 id="rezero_post_norm"),
    pytest.param(dict(dim=32, depth=2, attn_flash=True, attn_talking_heads=True),
                 ["attn_flash", "attn_talking_heads"], id="flash_with_talking_heads"),
    pytest.param(_cfg(attention=dict(normalize="sparsemax")), ["sparsemax"], id="unknown_normalize"),
    pytest.param(_cfg(attention=dict(position="xpos_typo")), ["xpos_typo"], id="unknown_position"),
    pytest.param(_cfg(attention=dict(bias="t6")), ["t6"], id="unknown_bias"),
    pytest.param(_cfg(norm="batch"), ["batch"], id="unknown_norm"),
    pytest.param(_cfg(residual="highway"), ["highway"], id="unknown_residual"),
    pytest.param(_cfg(ff=dict(activation="tanhh")), ["tanhh"], id="unknown_activation"),
    pytest.param(_cfg(placement="middle"), ["middle"], id="unknown_placement"),
    pytest.param(dict(dim=32, depth=2, rel_pos_bias=True, rel_pos_num_buckets=3), ["rel_pos_num_buckets", "bidirectional"],
                 id="rel_pos_bidirectional_too_few_buckets"),
    pytest.param(dict(dim=32, depth=2, rotary_base=500.0), ["rotary_base", "rotary_pos_emb"], id="rotary_base_alone"),
    pytest.param(dict(dim=32, depth=2, rotary_interpolation_factor=2.0), ["rotary_interpolation_factor", "rotary_pos_emb"],
                 id="rotary_scaling_alone"),
    pytest.param(dict(dim=32, depth=2, rotary_pos_emb=True, rotary_interpolation_factor=0.5),
                 ["rotary_interpolation_factor", ">= 1"], id="rotary_interpolation_below_one"),
    pytest.param(dict(dim=32, depth=2, rotary_pos_emb=True,
                      rotary_llama3_scaling=dict(factor=8, low_freq_factor=4, high_freq_factor=1,
                                                 original_max_position_embeddings=8192)),
                 ["rotary_llama3_scaling", "low_freq_factor < high_freq_factor"], id="rotary_llama3_bands_swapped"),
    pytest.param(dict(dim=32, depth=2, rotary_pos_emb=True, rotary_interpolation_factor=2.0,
                      rotary_llama3_scaling=dict(factor=8, low_freq_factor=1, high_freq_factor=4,
                                                 original_max_position_embeddings=8192)),
                 ["rotary_interpolation_factor", "rotary_llama3_scaling", "choose one"], id="two_rotary_scalings"),
    pytest.param(dict(dim=32, depth=2, rel_pos_max_distance=64), ["rel_pos_max_distance", "rel_pos_bias"],
                 id="rel_pos_distance_alone"),
    pytest.param(dict(dim=32, depth=2, dim_context=16), ["dim_context", "cross_attend"], id="dim_context_alone"),
    pytest.param(dict(dim=32, depth=2, only_cross=True, rotary_pos_emb=True), ["only_cross", "rotary_pos_emb"],
                 id="only_cross_with_positions"),
]

# More cases per rule where one rule has several ways to break it.
EXTRA_CASES = [
    pytest.param(dict(dim=32, depth=2, attn_collab_compression=0), ["attn_collab_compression"],
                 id="collab_compression_zero"),
    pytest.param(dict(dim=32, depth=2, causal=True, rel_pos_bias=True, rel_pos_num_buckets=1),
                 ["rel_pos_num_buckets"], id="rel_pos_one_bucket"),
    pytest.param(dict(dim=32, depth=2, custom_layers=("a", "f"), macaron=True), ["custom_layers", "macaron"],
                 id="custom_layers_with_macaron"),
    pytest.param(dict(dim=32, depth=2, custom_layers=()), ["custom_layers"], id="custom_layers_empty"),
    pytest.param(dict(dim=32, depth=2, use_rezero=True, sandwich_norm=True), ["use_rezero", "sandwich_norm"],
                 id="rezero_sandwich_norm"),
    pytest.param(dict(dim=32, depth=2, attn_flash=True, residual_attn=True), ["attn_flash", "residual_attn"],
                 id="flash_with_residual_attn"),
    pytest.param(dict(dim=32, depth=2, attn_flash=True, attn_sparse_topk=4), ["attn_flash", "topk"],
                 id="flash_with_topk"),
    pytest.param(dict(dim=32, depth=2, heads=4, alibi_pos_emb=True, alibi_num_heads=0), ["alibi_num_heads"],
                 id="alibi_num_heads_zero"),
]


def _hide_entmax(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "entmax" else real(name, *a, **k))


def _config_of(build, monkeypatch) -> LayersConfig:
    if isinstance(build, LayersConfig):
        return build
    keywords = dict(build)
    if keywords.pop("no_entmax", False):
        _hide_entmax(monkeypatch)
    return parse_layers(keywords)


def _broken(cfg: LayersConfig) -> list[int]:
    return [i for i, rule in enumerate(rules.RULES) if rule.broken(cfg)]


@pytest.mark.parametrize("build, expected", RULE_CASES + EXTRA_CASES)
def test_rule(build, expected, monkeypatch):
    cfg = _config_of(build, monkeypatch)
    assert len(_broken(cfg)) == 1, f"the case should break exactly one rule, breaks {_broken(cfg)}"
    with pytest.raises(ValueError) as err:
        if isinstance(build, LayersConfig):
            AttentionLayers.from_config(build)
        else:
            keywords = {k: v for k, v in build.items() if k != "no_entmax"}
            AttentionLayers(**keywords)
    msg = str(err.value)
    assert msg.startswith("AttentionLayers: ")
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"
    with pytest.raises(ValueError, match="^Decoder: "):
        rules.check(cfg, owner="Decoder")


def test_every_rule_has_a_case(monkeypatch):
    covered = set()
    for case in RULE_CASES:
        build, _ = case.values
        with monkeypatch.context() as m:
            broken = _broken(_config_of(build, m))
        assert broken, f"case {case.id} breaks no rule"
        covered.add(broken[0])
    missing = sorted(set(range(len(rules.RULES))) - covered)
    assert not missing, "rules without a test case: " + "; ".join(rules.RULES[i].message for i in missing)
    assert len(RULE_CASES) == len(rules.RULES)


def test_valid_defaults_break_no_rule():
    assert _broken(_cfg()) == []
    assert _broken(Decoder(dim=32, depth=2).cfg) == []


# ------------------------------------------------------------------------------------------------
# JSON round trip

ROUND_TRIP_OPTIONS = [
    dict(),
    dict(causal=True, rotary_pos_emb=True, rotary_emb_dim=16, heads=4, attn_kv_heads=2),
    dict(shift_tokens=(1, 0, 2, 0)),
    dict(shift_tokens=2, use_rmsnorm=True, ff_glu=True, ff_swish=True, ff_no_bias=True),
    dict(custom_layers=("a", "f", "a", "a", "f")),
    dict(cross_attend=True, custom_layers=("a", "c", "f", "c"), dim_context=48, shift_tokens=(1, 0, 0, 1)),
    dict(causal=True, alibi_pos_emb=True, heads=8, alibi_num_heads=4, attn_num_mem_kv=3, gate_values=True),
    dict(rel_pos_bias=True, rel_pos_num_buckets=16, rel_pos_max_distance=64, sandwich_norm=True,
         attn_sparse_topk=4, residual_attn=True),
    dict(use_rezero=True, macaron=True, attn_collab_heads=True, attn_collab_compression=0.5,
         attn_on_attn=True, attn_flash=False, norm_eps=1e-6, ff_mult=2.5),
    dict(sandwich_coef=1, pre_norm=False, gate_residual=True, attn_dropout=0.1, ff_dropout=0.2,
         attn_talking_heads=True, position_infused_attn=True, gradient_checkpointing=True),
]


@pytest.mark.parametrize("options", ROUND_TRIP_OPTIONS)
def test_config_json_round_trip(options):
    cfg = parse_layers({"dim": 32, "depth": 2, **options})
    rules.check(cfg)
    data = config_mod.to_dict(cfg)
    text = config_mod.dumps(cfg)
    assert json.loads(text) == data
    back = config_mod.from_dict(LayersConfig, json.loads(text))
    assert back == cfg
    assert type(back.shift_tokens) is type(cfg.shift_tokens)
    assert back.layout == cfg.layout
    assert hash(back) == hash(cfg)


def test_model_rebuilt_from_json_gives_same_outputs():
    stack = Decoder(dim=32, depth=2, heads=4, rotary_pos_emb=True, shift_tokens=(1, 0, 1, 0),
                    custom_layers=("a", "f", "a", "f")).eval()
    cfg = config_mod.from_dict(LayersConfig, json.loads(config_mod.dumps(stack.cfg)))
    rebuilt = Decoder.from_config(cfg).eval()
    rebuilt.load_state_dict(stack.state_dict())
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), stack(x))


def test_from_dict_unknown_field_names_it():
    data = config_mod.to_dict(Decoder(dim=32, depth=2).cfg)
    with pytest.raises(TypeError, match="bogus_field"):
        config_mod.from_dict(LayersConfig, {**data, "bogus_field": 1})
    data["attention"]["hedas"] = 4
    with pytest.raises(TypeError, match="hedas"):
        config_mod.from_dict(LayersConfig, data)


def test_keyword_table_routes_to_real_fields():
    # every route writes a field that exists: build each keyword once with a harmless value
    cfg_fields = {f"attention.{k}" for k in AttentionConfig.__dataclass_fields__}
    cfg_fields |= {f"ff.{k}" for k in FeedForwardConfig.__dataclass_fields__}
    cfg_fields |= set(LayersConfig.__dataclass_fields__)
    for path, options in stack_options().items():      # a stack piece's own dataclass (act, ff.moe, ...)
        cfg_fields |= {f"{path}.{k}" for k in options.__dataclass_fields__}
    # a pattern piece's options: attention.pattern.<registry name>[.<field of its options class>]
    for piece, entry in registry.PATTERN.items():
        cfg_fields.add(f"attention.pattern.{piece}")
        cfg_fields |= {f"attention.pattern.{piece}.{k}" for k in entry.options.__dataclass_fields__}
    # a kernel's or mixer's options likewise: attention.kernel.<name>[.<field>], mixer.<name>[.<field>]
    for prefix, table in (("attention.kernel", registry.KERNEL), ("mixer", registry.MIXER),
                          ("attention.relative", registry.RELATIVE)):
        for name, entry in table.items():
            cfg_fields.add(f"{prefix}.{name}")
            if entry.options is not None:
                cfg_fields |= {f"{prefix}.{name}.{k}" for k in entry.options.__dataclass_fields__}
    for name, route in KEYWORDS.items():
        paths = route.when_true.keys() if route.when_true is not None else [route.path]
        for path in paths:
            assert path in cfg_fields, f"keyword {name!r} routes to unknown field {path!r}"
