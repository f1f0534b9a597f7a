"""Issue 22 in the arena: the early-exit speed / quality curve (benchmarks/arena/tasks/exit_curve.py), the
compute read-outs (benchmarks/arena/compute.py) and the long-text rows that carry them.

The curve's teacher-forced pass is one forward per segment under the exit policy: it must equal decoding the
segment token by token; threshold 1 must be the full model (its loss the table's, its generation the plain
decode path's tokens); layers used fall as the threshold falls. The recorded spans are S clamp(p, 0, 1) of
the kernels' parameters, ACT's steps what the halting did, and the long-text row trains an exit model on
CALM's weighted loss."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.arena.__main__ import main
from benchmarks.arena.compute import compute_used
from benchmarks.arena.harness import build_model
from benchmarks.arena.tasks import exit_curve, long_text
from benchmarks.arena.variants import variant
from polyformer.act import Halting
from polyformer.early_exit import next_token_loss
from tests.helpers import ids, tiny_lm

DEPTH = 4


def exit_model():
    return tiny_lm(depth=DEPTH, heads=4, seed=0, rotary_pos_emb=True, exit_layers=True)


def test_one_forward_per_segment_equals_decoding_it_token_by_token():
    """The teacher-forced pass reads what token-by-token exit decoding would: the same loss, agreement, layers."""
    net, x = exit_model(), ids(3, 25)
    segs = exit_curve.segments(x, 8, 0)                         # 3 segments of 8 positions
    full_top = [net(seg[:, :-1]).argmax(-1) for seg in segs]
    exits = net.attn_layers.early_exit
    for threshold in (0.02, 0.005):                           # the margins of an untrained model are small
        got = exit_curve.teacher_forced(net, segs, threshold, full_top)
        loss = agree = layers = 0.0
        used = []
        with torch.no_grad():
            for seg, top in zip(segs, full_top):
                state = net.new_state(3, 8)
                for t in range(8):
                    with exits.decoding(net.head, threshold) as run:
                        logits = net(seg[:, t:t + 1], state=state)[:, 0]
                    loss += float(F.cross_entropy(logits, seg[:, t + 1], reduction="sum"))
                    agree += float((logits.argmax(-1) == top[:, t]).sum())
                    used.append(run.layers)
        layers = torch.cat(used).float()
        assert layers.unique().numel() > 2                    # positions stop at different layers
        assert got["loss"] == pytest.approx(loss / 72, abs=1e-5)
        assert got["agreement"] == agree / 72 and got["mean_layers"] == pytest.approx(float(layers.mean()))


def test_threshold_one_is_the_full_model_and_threshold_zero_exits_at_the_first_layer():
    net, x = exit_model(), ids(2, 17)
    segs = exit_curve.segments(x, 8, 0)
    with torch.no_grad():
        logits = [net(seg[:, :-1]) for seg in segs]
    full = torch.cat([F.cross_entropy(l.transpose(1, 2), s[:, 1:], reduction="none") for l, s in zip(logits, segs)])
    top = [l.argmax(-1) for l in logits]
    never = exit_curve.teacher_forced(net, segs, 1.0, top)
    assert never["mean_layers"] == DEPTH and never["agreement"] == 1.0
    assert never["loss"] == pytest.approx(float(full.mean()), abs=1e-5)
    assert exit_curve.teacher_forced(net, segs, 0.0, top)["mean_layers"] == 1.0


def test_recorded_spans_are_the_parameters_formula():
    model = build_model(variant("adaptive_span"), num_tokens=32, max_seq_len=16, dim=16, depth=2, heads=2,
                        causal=True, seed=0)
    kernels = [m for m in model.modules() if type(m).__name__ == "AdaptiveSpan"]
    values = torch.tensor([[-0.3, 0.25], [0.6, 1.7]])           # below, inside and above [0, 1]
    with torch.no_grad():
        for k, p in zip(kernels, values):
            k.fraction.copy_(p)
    span = compute_used(model)["span"]
    s, r = 224, 32
    want = s * values.clamp(0, 1)                               # z = S clamp(p, 0, 1)
    assert torch.allclose(torch.tensor(span["spans"]), want) and span["mean_span"] == pytest.approx(float(want.mean()))
    assert span["reach"] == [math.floor(56 + r) + 1, s + r]          # floor(max z + R) + 1, at most S + R
    assert span["max_span"] == s and span["fraction"] == pytest.approx((89 + 256) / 2 / 256)


@pytest.mark.parametrize("threshold, bias, steps", [(0.5, None, 1), (0.999, -10.0, 3)])
def test_act_compute_is_what_the_halting_did(threshold, bias, steps):
    """sigmoid(1) (the initial halting bias) passes 0.5 at once: one step; a halting unit near 0 never reaches
    0.999: every position and row runs all act_max_steps."""
    net = tiny_lm(depth=3, heads=2, seed=0, universal=True, act=True, act_threshold=threshold)
    if bias is not None:
        halting = next(m for m in net.modules() if isinstance(m, Halting))
        with torch.no_grad():
            halting.unit.weight.zero_()
            halting.unit.bias.fill_(bias)
    assert compute_used(net) == {}                             # no forward yet: nothing to read
    with torch.no_grad():
        net(ids(2, 9))
    act = compute_used(net)["act"]
    assert act["mean_steps"] == act["row_steps"] == steps and act["max_steps"] == 3


def test_long_text_rows_carry_the_curve_spans_and_the_weighted_loss(tmp_path):
    out = tmp_path / "arena"
    assert main(["--task", "long_text", "--quick", "--variants", "early_exit,adaptive_span", "--out-dir", str(out),
                 "--threads", "1"]) == 0
    rec = json.loads((out / "long_text.json").read_text())
    row, s = rec["rows"]["early_exit"], rec["settings"]
    points = {p["threshold"]: p for p in row["exit_curve"]["points"]}
    assert list(points) == list(exit_curve.QUICK["thresholds"])
    never = points[1.0]
    assert never["mean_layers"] == never["gen_mean_layers"] == s["depth"]
    assert never["consistency"] == 1.0 and never["agreement"] == 1.0   # the plain decode path's tokens
    assert never["loss"] == pytest.approx(row["loss"], abs=1e-4)        # the table's segments, the full model
    layers = [points[t]["mean_layers"] for t in sorted(points, reverse=True)]
    assert layers == sorted(layers, reverse=True) and layers[-1] == 1.0     # threshold 0: the first exit layer
    gen = [points[t]["gen_mean_layers"] for t in sorted(points, reverse=True)]
    assert gen == sorted(gen, reverse=True) and gen[-1] < s["depth"]
    assert all(p["tokens_per_s"] > 0 and 0 <= p["consistency"] <= 1 for p in points.values())
    assert row["compute"]["exit"]["mean_layers"] == points[0.9]["gen_mean_layers"]

    # the first training step's loss is CALM's weighted one, not the cross-entropy
    train_text, _ = long_text.documents(s)
    starts = torch.arange(s["batch"]) * (len(train_text) // s["batch"]) % (len(train_text) - s["segment"] - 1)
    seg = train_text[starts[:, None] + torch.arange(s["segment"] + 1)]
    model = build_model(variant("early_exit"), num_tokens=256, max_seq_len=s["segment"], dim=s["dim"],
                        depth=s["depth"], heads=s["heads"], causal=True, seed=s["seed"]).train()
    with torch.no_grad():
        weighted = float(next_token_loss(model, seg[:, :-1], seg[:, 1:])[0])
        plain = float(F.cross_entropy(model(seg[:, :-1]).transpose(1, 2), seg[:, 1:]))
    assert row["train"]["losses"][0] == [1, pytest.approx(weighted, abs=1e-5)] and abs(weighted - plain) > 1e-3
    assert row["objective"] == "CALM weighted exit loss"

    span = rec["rows"]["adaptive_span"]["compute"]["span"]
    assert len(span["spans"]) == s["depth"] and all(len(z) == s["heads"] for z in span["spans"])
    assert all(0 <= z <= span["max_span"] for zs in span["spans"] for z in zs)
    table = (out / "long_text.md").read_text()
    assert "## Early exit: speed against quality" in table and "## Compute actually used" in table
    assert "mean span" in table and "`early_exit` (CALM weighted exit loss)" in table
    assert (out / "long_text_exit.png").stat().st_size > 1000 and (out / "long_text_spans.png").stat().st_size > 1000
