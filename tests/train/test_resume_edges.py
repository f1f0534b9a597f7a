"""`train --resume` at the edges: a complete run, more steps than the schedule was planned for, a
corpus that changed, and a split too short for one window (refused before step 1)."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest

from .conftest import SMALL, text


def snapshot(run) -> dict[str, tuple[bytes, int, int]]:
    """Every file under the run: bytes, modification time and mode."""
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode)
            for p in sorted(run.rglob("*")) if p.is_file()}


def column(run, name: str) -> list[str]:
    with open(run / "log.csv") as f:
        return [row[name] for row in csv.DictReader(f)]


def test_resuming_a_complete_run_says_so_and_changes_nothing(tmp_path, corpus, cli):
    run = tmp_path / "run"
    command = ("train", *SMALL, "--steps", "4", "--data.paths", corpus, "--out", run)
    assert cli(*command)[0] == 0
    before = snapshot(run)
    for again in (("train", "--resume", "--out", run), (*command, "--resume")):
        code, out, err = cli(*again)
        assert code == 0 and "is complete" in out and "step-000004" in out and "nothing was changed" in out, err
        assert "larger --steps" in out
    code, out, err = cli("train", "--resume", "--out", run, "--steps", "3")
    assert code == 2 and "already at step 4" in err and "--steps" in err and err.count("\n") == 1, err
    assert snapshot(run) == before


def planned(step: int, lr: float, warmup: int, total: int, floor: float) -> float:
    """The documented schedule: linear warmup, cosine to lr * floor at `total`, then held."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def test_more_steps_than_planned_hold_the_final_learning_rate(tmp_path, corpus, cli):
    common = (*SMALL, "--data.paths", corpus, "--train.warmup", "2", "--train.lr", "1e-2", "--train.min_lr_ratio",
              "0.1", "--train.checkpoint_every", "6", "--train.keep_last", "5", "--train.eval_every", "100")
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    assert cli("train", *common, "--steps", "12", "--out", straight)[0] == 0
    assert cli("train", *common, "--steps", "12", "--out", extended)[0] == 0
    for path in sorted((extended / "checkpoints" / "step-000012").iterdir()):   # as if stopped at step 6
        path.unlink()
    (extended / "checkpoints" / "step-000012").rmdir()
    code, out, err = cli("train", *common, "--steps", "16", "--out", extended, "--resume")
    assert code == 0, err
    assert "resuming at step 6" in out
    assert "planned for 12 steps; steps 13-16 hold its final rate 0.001" in out, out
    lrs = [float(v) for v in column(extended, "lr")]
    assert len(lrs) == 16
    for step, lr in enumerate(lrs, start=1):
        assert lr == pytest.approx(planned(step, 1e-2, 2, 12, 0.1), rel=1e-12), step
    assert lrs[11:] == pytest.approx([1e-3] * 5, rel=1e-12)              # no jump back up: held
    # up to the plan's end, the same run as one never extended, bit for bit
    assert column(extended, "train_loss")[:12] == column(straight, "train_loss")
    assert column(extended, "lr")[:12] == column(straight, "lr")
    config = json.loads((extended / "config.json").read_text())
    assert config["train"]["settings"]["train"]["steps"] == 16 and config["train"]["schedule_steps"] == 12
    code, out, _ = cli("train", "--resume", "--out", extended)           # --resume alone: the 16 steps asked for
    assert code == 0 and "is complete" in out and "all 16 steps" in out


def test_a_changed_corpus_is_refused_by_file_name_unless_allowed(tmp_path, corpus, cli):
    run = tmp_path / "run"
    assert cli("train", *SMALL, "--steps", "4", "--data.paths", corpus, "--out", run)[0] == 0
    (corpus / "b.txt").write_text(text(50), encoding="utf-8")
    (corpus / "c.txt").unlink()
    (corpus / "f.txt").write_text(text(51), encoding="utf-8")
    before = snapshot(run)
    for command in (("train", "--resume", "--out", run, "--steps", "6"), ("eval", "--run", run)):
        code, out, err = cli(*command)
        assert code == 2 and err.count("\n") == 1, err
        assert "changed: corpus/b.txt; missing: corpus/c.txt; new: corpus/f.txt" in err, err
    assert "--allow-corpus-change" in cli("train", "--resume", "--out", run, "--steps", "6")[2]
    assert snapshot(run) == before
    code, out, err = cli("train", "--resume", "--out", run, "--steps", "6", "--allow-corpus-change")
    assert code == 0 and "resuming at step 4" in out, err
    code, out, err = cli("train", "--resume", "--out", run, "--steps", "8")     # the corpus as now recorded
    assert code == 0 and "resuming at step 6" in out, err
    assert cli("eval", "--run", run)[0] == 0
    code, _, err = cli("train", *SMALL, "--steps", "2", "--data.paths", corpus, "--out", tmp_path / "new",
                       "--allow-corpus-change")
    assert code == 2 and "--allow-corpus-change" in err and not (tmp_path / "new").exists()


@pytest.mark.parametrize("val_fraction, split", [("0.05", "validation"), ("0.95", "training")])
def test_a_split_too_short_for_one_window_is_refused_before_step_one(tmp_path, cli, val_fraction, split):
    small = tmp_path / "small.txt"
    small.write_bytes(text(3)[:1000].encode("ascii", "replace"))
    run = tmp_path / "run"
    code, out, err = cli("train", *SMALL, "--model.max_seq_len", "64", "--data.paths", small,
                         "--data.val_fraction", val_fraction, "--steps", "50", "--out", run)
    assert code == 2 and not out, out                                         # not one step, no sample
    assert re.search(rf"the {split} split has 52 tokens, fewer than one window of --model.max_seq_len \+ 1 = 65", err)
    assert "--data.val_fraction" in err and "--data.paths" in err and err.count("\n") == 1, err
    assert not run.exists()
