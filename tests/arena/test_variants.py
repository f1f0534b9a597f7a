"""The arena's variant table: every row builds and runs, and every registered stage choice is
reached by some row, so a new registry entry without an arena row fails here."""

from __future__ import annotations

import pytest
import torch

from benchmarks.arena.harness import Budget, Optimiser, build_model
from benchmarks.arena.variants import TASK_NAMES, VARIANTS, Variant, for_task, variant
from polyformer import registry
from polyformer.attention.knn_memory import read_only

STAGES = {"position": "position", "bias": "bias", "kernel": "kernel", "normalize": "normalize", "pattern": "pattern",
          "mixer": "mixer", "relative": "relative"}


def tiny(v: Variant, causal: bool) -> torch.nn.Module:
    """The row's model in eval mode (LSH redraws its rotations at every training forward)."""
    return build_model(v, num_tokens=32, max_seq_len=max(16, v.min_len), dim=16, depth=v.min_depth, heads=2, causal=causal,
                       seed=0).eval()


def seeded(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """model(x) with the same random draws for every input (Gumbel-softmax attention draws in eval too)."""
    torch.manual_seed(0)
    return model(x)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_builds_and_is_causal_in_a_decoder(name):
    """A row's keywords are valid, its model is causal where asked, and its keywords reach the config."""
    v = variant(name)
    n = max(12, v.min_len)
    x = torch.randint(0, 32, (2, n))
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % 32
    if not v.encoder_only:
        model = tiny(v, causal=True)
        with torch.no_grad(), read_only(model):        # a kNN memory would remember x while y runs
            assert torch.allclose(seeded(model, x)[:, :8], seeded(model, y)[:, :8], atol=1e-5)     # causal
    if not v.causal_only:
        enc = tiny(v, causal=False)
        with torch.no_grad():
            assert not torch.allclose(seeded(enc, x)[:, :8], seeded(enc, y)[:, :8], atol=1e-5)  # sees the future


def reached(stage: str) -> set[str]:
    names = set()
    for v in VARIANTS.values():
        layers = tiny(v, causal=not v.encoder_only).attn_layers.cfg
        cfg = layers.attention
        if stage == "pattern":
            names |= {c.name for c in cfg.pattern}
        elif stage == "kernel":
            names.add(cfg.kernel.name)
        elif stage in ("mixer", "relative"):
            choice = layers.mixer if stage == "mixer" else cfg.relative
            names |= {choice.name} if choice is not None else set()
        else:
            names.add(getattr(cfg, stage))
    return names


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_registered_choice_has_an_arena_row(stage):
    missing = set(registry.names(stage)) - reached(stage) - {"none"}
    assert not missing, f"registry.{stage} names without an arena variant: {sorted(missing)}"


def test_every_task_has_default_variants_and_unknown_names_fail_by_name():
    for task in TASK_NAMES:
        assert for_task(task), task
    with pytest.raises(ValueError, match="did you mean 'alibi'"):
        variant("albi")
    with pytest.raises(ValueError, match="unknown task"):
        Variant("x", "", "", tasks=("nonsense",))


def test_budget_parses_tokens_and_time_and_refuses_the_rest():
    assert Budget.parse("2M") == Budget(tokens=2_000_000)
    assert Budget.parse("500k") == Budget(tokens=500_000)
    assert Budget.parse("3e5") == Budget(tokens=300_000)
    assert Budget.parse("90s") == Budget(seconds=90.0)
    assert Budget.parse("5min") == Budget(seconds=300.0)
    with pytest.raises(ValueError, match="--budget"):
        Budget.parse("lots")
    with pytest.raises(ValueError, match="positive"):
        Budget.parse("0")
    assert Budget(tokens=100).progress(50, 999.0) == 0.5
    assert Budget(seconds=10).progress(10**9, 5.0) == 0.5


def test_schedule_warms_up_then_decays_to_its_floor():
    opt = Optimiser(lr=1.0, warmup=0.1, floor=0.1)
    assert opt.rate(0.05) == pytest.approx(0.5)
    assert opt.rate(0.1) == pytest.approx(1.0)
    assert opt.rate(1.0) == pytest.approx(0.1)
    rates = [opt.rate(p / 100) for p in range(10, 101)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
