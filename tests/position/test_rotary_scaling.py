"""Rotary scalings, polyformer/position/rotary_scaling.py: YaRN (arXiv:2309.00071), dynamic NTK, LongRoPE
(arXiv:2402.13753). Frequencies against the papers' formulas (and Hugging Face's reference functions), the
attention temperature on q.k, the length dependence, the decode-state convention, and named errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, build_model, model_config
from polyformer.config import Choice
from polyformer.position.rotary import Rotary
from polyformer.position.rotary_scaling import DynamicNtkOptions, LongRopeOptions, YarnOptions
from tests.helpers import ids, tiny_lm

R = 16          # rotated features: 8 pairs


def w(r: int = R, base: float = 10000.0) -> torch.Tensor:
    return torch.tensor([base ** (-2.0 * i / r) for i in range(r // 2)], dtype=torch.float64)


def rotary(name: str, options: object, base: float = 10000.0) -> Rotary:
    return Rotary(R, base=base, scaling=Choice("rotary_scaling", name, options))


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_ramps_monotonically_between():
    o = YarnOptions(factor=4.0, original_max_len=64, beta_fast=8.0, beta_slow=1.0, truncate=False)
    got = rotary("yarn", o).frequencies(None).double()
    turns = o.original_max_len * w() / (2 * math.pi)        # how often pair i turns within L
    fast, slow = turns > o.beta_fast, turns < o.beta_slow
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    assert_close(got[fast], w()[fast], rtol=1e-6, atol=0)
    assert_close(got[slow], w()[slow] / o.factor, rtol=1e-6, atol=0)
    stretch = w() / got                                     # 1 (kept) .. s (interpolated), growing with i
    assert (stretch[1:] >= stretch[:-1] - 1e-6).all() and stretch.min() >= 1 - 1e-6 and stretch.max() <= 4 + 1e-6


@pytest.mark.parametrize("factor, m", [(4.0, None), (1.0, None), (3.0, 1.3)])
def test_yarn_temperature_multiplies_qk_by_the_attention_factor_squared(factor, m):
    """At offset 0 the rotation cancels: q.k = m^2 q.k with m = 0.1 ln(s) + 1 (sqrt(1/t) of the paper)."""
    rot = rotary("yarn", YarnOptions(factor=factor, original_max_len=32, attention_factor=m))
    q, k = torch.randn(1, 2, 5, R), torch.randn(1, 2, 5, R)
    pos = torch.full((1, 5), 7)
    rq, rk = rot(q, k, pos, pos)
    want = m if m is not None else 0.1 * math.log(factor) + 1.0
    assert_close((rq * rk).sum(-1), want ** 2 * (q * k).sum(-1), rtol=1e-5, atol=1e-5)


def test_yarn_and_dynamic_ntk_equal_hugging_face_reference_functions():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters, _compute_yarn_parameters

    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, max_position_embeddings=24,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0,
                                                       "original_max_position_embeddings": 24, "beta_fast": 16.0})
    theirs, m = _compute_yarn_parameters(config)
    rot = rotary("yarn", YarnOptions(factor=8.0, original_max_len=24, beta_fast=16.0), base=500.0)
    assert_close(rot.frequencies(None), theirs)
    assert math.isclose(rot.scale, m)
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 500.0, "factor": 3.0}
    rot = rotary("dynamic", DynamicNtkOptions(factor=3.0, original_max_len=24), base=500.0)
    for n in (5, 24, 25, 100):
        assert_close(rot.frequencies(torch.tensor(n)), _compute_dynamic_ntk_parameters(config, seq_len=n)[0])


def test_dynamic_ntk_base_grows_with_the_length_past_the_original_context():
    s, L = 2.0, 16
    rot = rotary("dynamic", DynamicNtkOptions(factor=s, original_max_len=L))
    for n in (1, 9, 16):
        assert_close(rot.frequencies(torch.tensor(n)).double(), w(), rtol=1e-6, atol=0)
    for n in (17, 40, 1000):
        base = 10000.0 * (s * n / L - (s - 1)) ** (R / (R - 2))
        assert_close(rot.frequencies(torch.tensor(n)).double(), w(R, base), rtol=1e-5, atol=0)


def test_longrope_divides_each_pair_by_its_short_or_long_factor_by_length():
    short, long = [1.0 + 0.1 * i for i in range(R // 2)], [1.0 + i for i in range(R // 2)]
    o = LongRopeOptions(short_factor=tuple(short), long_factor=tuple(long), original_max_len=8, factor=4.0)
    rot = rotary("longrope", o)
    assert_close(rot.frequencies(torch.tensor(8)).double(), w() / torch.tensor(short, dtype=torch.float64))
    assert_close(rot.frequencies(torch.tensor(9)).double(), w() / torch.tensor(long, dtype=torch.float64))
    assert math.isclose(rot.scale, math.sqrt(1 + math.log(4.0) / math.log(8)))


@pytest.mark.parametrize("name, options", [("dynamic", DynamicNtkOptions(2.0, 8)),
                                           ("longrope", LongRopeOptions((1.0,) * 8, (3.0,) * 8, 8))])
def test_length_following_scalings_keep_offsets_within_one_length_and_change_past_the_original(name, options):
    rot = rotary(name, options)
    q, k = torch.randn(1, 1, 1, R), torch.randn(1, 1, 1, R)

    def score(i: int, j: int, n: int) -> torch.Tensor:      # q at i, k at j, in a forward reaching position n - 1
        rq, _ = rot(q, q, torch.tensor([[i]]), torch.tensor([[n - 1]]))
        rk, _ = rot(k, k, torch.tensor([[j]]), torch.tensor([[n - 1]]))
        return (rq * rk).sum()

    assert_close(score(5, 2, 20), score(13, 10, 20))        # only the offset counts at a given length
    assert_close(score(5, 2, 6), score(5, 2, 8))            # within the original context: no change
    assert not torch.allclose(score(5, 2, 8), score(5, 2, 20))


KEYWORDS = {"rotary_yarn": dict(factor=4.0, original_max_len=8, beta_fast=16.0),
            "rotary_dynamic_ntk": (2.0, 8),
            "rotary_longrope": dict(short_factor=[1.0] * 32, long_factor=[2.0 + i for i in range(32)],
                                    original_max_len=8, factor=4.0)}


@pytest.mark.parametrize("keyword", KEYWORDS)
def test_config_round_trips_through_json(keyword):
    model = tiny_lm(rotary_pos_emb=True, seed=0, **{keyword: KEYWORDS[keyword]})
    rebuilt = build_model(model_config(model))
    rebuilt.load_state_dict(model.state_dict())
    x = ids(2, 20)
    assert rebuilt.attn_layers.cfg == model.attn_layers.cfg
    assert_close(rebuilt(x), model(x))


@pytest.mark.parametrize("keyword", KEYWORDS)
def test_cached_steps_equal_uncached_forward_within_the_original_context_and_for_yarn_past_it(keyword):
    """Hugging Face's convention: a cached key keeps the rotation of its step. YaRN is static, so cached ==
    uncached everywhere; dynamic NTK and LongRoPE agree while the length stays <= original_max_len, and past it
    an uncached forward rotates every key for the final length, which the cached keys do not follow."""
    model = tiny_lm(rotary_pos_emb=True, seed=0, **{keyword: KEYWORDS[keyword]})
    x = ids(2, 14)
    state = model.new_state(2, 14)
    steps = [model(x[:, :4], state=state)[:, -1]] + [model(x[:, t:t + 1], state=state)[:, -1] for t in range(4, 14)]
    uncached = [model(x[:, :t])[:, -1] for t in range(4, 15)]
    within = slice(0, 5)                                    # lengths 4 .. 8 = original_max_len
    assert_close(torch.stack(steps[within]), torch.stack(uncached[within]), atol=1e-5, rtol=1e-5)
    past = (torch.stack(steps[5:]) - torch.stack(uncached[5:])).abs().max()
    assert past < 1e-5 if keyword == "rotary_yarn" else past > 1e-4


@pytest.mark.parametrize("keywords, match", [
    (dict(rotary_yarn=(4.0, 8)), "rotary_yarn scales rotary positions but rotary_pos_emb"),
    (dict(rotary_pos_emb=True, rotary_yarn=(4.0, 8), rotary_dynamic_ntk=(2.0, 8)),
     "'rotary_yarn' and 'rotary_dynamic_ntk' conflict"),
    (dict(rotary_pos_emb=True, rotary_yarn=(4.0, 8), rotary_interpolation_factor=2.0), "two rotary scalings"),
    (dict(rotary_pos_emb=True, rotary_dynamic_ntk=(2.0, 8), rotary_llama3_scaling=dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)),
     "two rotary scalings"),
    (dict(rotary_pos_emb=True, rotary_yarn=(0.5, 8)), "rotary_yarn needs factor >= 1"),
    (dict(rotary_pos_emb=True, rotary_yarn=dict(factor=2.0, original_max_len=8, beta_fast=1.0)),
     "beta_fast > beta_slow"),
    (dict(rotary_pos_emb=True, rotary_dynamic_ntk=(2.0, 0)),
     "rotary_dynamic_ntk original_max_len must be an integer >= 1"),
    (dict(rotary_pos_emb=True, rotary_emb_dim=2, rotary_dynamic_ntk=(2.0, 8)), "rotary dimension r >= 4"),
    (dict(rotary_pos_emb=True, rotary_longrope=dict(short_factor=[1.0] * 3, long_factor=[1.0] * 32,
                                                    original_max_len=8)), "short_factor needs 32 positive"),
    (dict(rotary_pos_emb=True, rotary_yarn=dict(factor=2.0, original_max_len=8, attention_factor=-1.0)),
     "attention_factor must be a positive"),
    (dict(rotary_pos_emb=True, gau=True, rotary_yarn=(2.0, 8)), "a mixer"),
])
def test_bad_scalings_fail_when_built_naming_the_keyword(keywords, match):
    with pytest.raises(ValueError, match=match):
        Decoder(dim=32, depth=1, heads=2, **keywords)


@pytest.mark.parametrize("keyword, arg", [("rotary_yarn", dict(factor=2.0)), ("rotary_longrope", (1.0, 2.0)),
                                          ("rotary_dynamic_ntk", dict(factor=2.0, original_max_len=8, beta=1))])
def test_malformed_scaling_arguments_are_type_errors_naming_the_keyword(keyword, arg):
    with pytest.raises(TypeError, match=f"{keyword}.*expected"):
        Decoder(dim=32, depth=1, heads=2, rotary_pos_emb=True, **{keyword: arg})
