"""Randomized positional encodings (randomized_pos, position/randomized.py; Ruoss et al. 2023), and which
positional schemes may run past max_seq_len."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import ContinuousTransformerWrapper, Decoder
from polyformer.position.randomized import sample
from tests.helpers import ids, tiny_lm
from tests.options import perturb


def stack_positions(model: torch.nn.Module) -> list[torch.Tensor]:
    """The positions each forward hands the layer stack."""
    seen = []
    model.attn_layers.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["pos"]), with_kwargs=True)
    return seen


def test_a_sample_is_sorted_distinct_within_range_per_row_and_seeded():
    torch.manual_seed(3)
    a = sample(4, 10, 50, torch.device("cpu"))
    b = sample(4, 10, 50, torch.device("cpu"))
    assert a.shape == (4, 10)
    assert (a[:, 1:] > a[:, :-1]).all() and a.min() >= 0 and a.max() < 50       # strictly increasing: distinct
    assert not torch.equal(a[0], a[1]) and not torch.equal(a, b)                 # per row, fresh per call
    torch.manual_seed(3)
    assert torch.equal(sample(4, 10, 50, torch.device("cpu")), a)               # torch's generator
    assert torch.equal(sample(1, 6, 6, torch.device("cpu")), torch.arange(6)[None])
    counts = torch.bincount(sample(2000, 3, 6, torch.device("cpu")).flatten(), minlength=6).float()
    assert (counts / counts.mean() - 1).abs().max() < 0.1                       # every position as often


@pytest.mark.parametrize("keywords", [dict(), dict(rotary_pos_emb=True), dict(scaled_sinu_pos_emb=True),
                                      dict(num_memory_tokens=2, alibi_pos_emb=True)])
def test_training_positions_are_random_and_evaluation_positions_are_0_to_n(keywords):
    model = perturb(tiny_lm(seed=0, max_seq_len=16, randomized_pos=64, **keywords), 1, 0.05)
    m = model.num_memory_tokens
    seen = stack_positions(model)
    x = ids(3, 12)
    model.train()
    model(x), model(x)
    first, second = (p[:, m:] - m for p in seen)
    for p in (first, second):
        assert p.shape == (3, 12) and (p[:, 1:] > p[:, :-1]).all() and p.min() >= 0 and p.max() < 64
    assert not torch.equal(first, second) and not torch.equal(first[0], first[1])
    assert (seen[0][:, :m] == torch.arange(m)).all()                            # memory tokens lead, unmoved
    model.eval()
    model(x)
    assert torch.equal(seen[-1], torch.arange(m + 12)[None])                    # memory tokens, then 0 .. n-1


@pytest.mark.parametrize("keywords", [dict(), dict(rotary_pos_emb=True), dict(scaled_sinu_pos_emb=True),
                                      dict(abs_pos_per_layer=True)])
def test_a_training_forward_is_the_model_at_the_drawn_positions(keywords):
    """Learned, sinusoidal, rotary and per-layer positions all read the sample (dropout off: train = eval)."""
    model = perturb(tiny_lm(seed=0, max_seq_len=16, randomized_pos=40, **keywords), 1, 0.05)
    x = ids(2, 10)
    torch.manual_seed(7)
    trained = model.train()(x)
    torch.manual_seed(7)
    drawn = sample(2, 10, 40, x.device)
    assert_close(trained, model.eval()(x, pos=drawn))
    assert not torch.allclose(trained, model(x), atol=1e-4)


def test_learned_tables_cover_L_and_longer_inputs_are_refused_by_name():
    model = tiny_lm(max_seq_len=16, randomized_pos=24)
    assert model.pos_emb.emb.num_embeddings == 24 and model.max_seq_len == 24
    model(ids(1, 24))                               # evaluation past the training length, up to L
    with pytest.raises(ValueError, match="randomized_pos=24"):
        model(ids(1, 25))
    with pytest.raises(ValueError, match="randomized_pos=24"):
        model.train()(ids(1, 25))


def test_the_continuous_wrapper_randomizes_too():
    model = ContinuousTransformerWrapper(max_seq_len=8, dim_in=4, attn_layers=Decoder(dim=16, depth=1, heads=2,
                                                                                      rotary_pos_emb=True),
                                         randomized_pos=32).train()
    seen = stack_positions(model)
    model(torch.randn(2, 8, 4))
    assert seen[0].max() < 32 and not torch.equal(seen[0], torch.arange(8)[None].expand(2, -1))


@pytest.mark.parametrize("keywords, match, error", [
    (dict(randomized_pos=32), "randomized_pos=32 must be greater than max_seq_len=32", ValueError),
    (dict(randomized_pos=8), "greater than max_seq_len", ValueError),
    (dict(randomized_pos=True), "randomized_pos must be an integer", TypeError),
    (dict(randomized_pos=64.0), "randomized_pos must be an integer", TypeError),
    (dict(randomized_pos=64, use_abs_pos_emb=False), "reads none", ValueError),
    (dict(randomized_pos=64, max_mem_len=4, rotary_pos_emb=True), "max_mem_len=4", ValueError),
])
def test_bad_input_is_refused_when_built_by_name(keywords, match, error):
    with pytest.raises(error, match=match):
        tiny_lm(**keywords)


BOUNDED = {"learned": dict(), "axial": dict(axial_pos_emb=(4, 8)), "per_layer": dict(abs_pos_per_layer=True)}
UNBOUNDED = {"nope": dict(use_abs_pos_emb=False), "sinusoidal": dict(scaled_sinu_pos_emb=True),
             "rotary": dict(rotary_pos_emb=True), "alibi": dict(alibi_pos_emb=True), "t5": dict(rel_pos_bias=True),
             "infused": dict(position_infused_attn=True),
             "randomized_rotary": dict(randomized_pos=40, rotary_pos_emb=True)}


@pytest.mark.parametrize("name", list(BOUNDED) + list(UNBOUNDED))
def test_extrapolation_past_max_seq_len_is_allowed_exactly_for_the_schemes_that_can(name):
    model = tiny_lm(max_seq_len=32, **{**BOUNDED, **UNBOUNDED}[name])
    assert model.bounded == (name in BOUNDED)
    model(ids(1, 32))
    if name in BOUNDED:
        with pytest.raises(ValueError, match="max_seq_len=32"):
            model(ids(1, 33))
    else:
        assert torch.isfinite(model(ids(1, 96))).all()
