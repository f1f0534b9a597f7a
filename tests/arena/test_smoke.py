"""One tiny arena task end to end through its command line: the record, the table, the plot, and
rows of a later run merged into the record."""

from __future__ import annotations

import json
import math

from benchmarks.arena.__main__ import main


def test_extrapolation_runs_end_to_end_and_merges_later_rows(tmp_path, capsys):
    out = tmp_path / "arena"
    assert main(["--task", "extrapolation", "--quick", "--variants", "abs_learned,rotary", "--out-dir", str(out)]) == 0
    rec = json.loads((out / "extrapolation.json").read_text())
    assert set(rec["rows"]) == {"abs_learned", "rotary"}
    rotary, learned = rec["rows"]["rotary"], rec["rows"]["abs_learned"]
    for factor, ev in rotary["eval"].items():
        assert ev["status"] == "ok" and math.isfinite(ev["loss"]), factor
        assert len(ev["loss_by_position"]) == ev["length"] // rec["settings"]["bin_width"]
    assert learned["eval"]["1"]["status"] == "ok"
    assert learned["eval"]["2"]["status"].startswith("cannot run") and "max_seq_len" in learned["eval"]["2"]["status"]
    assert rotary["train"]["steps"] > 1 and rotary["train"]["tokens"] >= 2000
    assert rec["environment"]["cpu_count"] >= 1 and rotary["commit"]
    assert (out / "extrapolation.png").stat().st_size > 1000

    assert main(["--task", "extrapolation", "--quick", "--variants", "alibi", "--out-dir", str(out)]) == 0
    rec = json.loads((out / "extrapolation.json").read_text())
    assert set(rec["rows"]) == {"abs_learned", "rotary", "alibi"}
    table = (out / "extrapolation.md").read_text()
    assert all(f"`{name}`" in table for name in rec["rows"]) and "cannot run" in table


def test_list_names_every_task_and_variant(capsys):
    from benchmarks.arena.variants import TASK_NAMES, VARIANTS

    assert main(["--list"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in TASK_NAMES) and all(name in text for name in VARIANTS)


def test_set_changes_a_setting_into_the_record_and_refuses_unknown_names(tmp_path, capsys):
    import pytest

    out = tmp_path / "arena"
    assert main(["--task", "mqar", "--quick", "--variants", "dense", "--set", "widths=8", "--set", "lr=0.01",
                 "--out-dir", str(out)]) == 0
    rec = json.loads((out / "mqar.json").read_text())
    assert rec["settings"]["widths"] == [8] and rec["settings"]["lr"] == 0.01
    assert list(rec["rows"]["dense"]["widths"]) == ["8"]
    with pytest.raises(SystemExit):
        main(["--task", "mqar", "--quick", "--set", "width=8", "--out-dir", str(out)])
    assert "has no setting(s) ['width']" in capsys.readouterr().err
