"""The arena's records: rows keep the thread count they were timed with, and a table names the rows whose
speed another count makes incomparable; ListOps' per-operator majority is the held-out accuracy of answering
with the training set's most common result for the outermost operator."""

from __future__ import annotations

import json

import torch

from benchmarks.arena import record
from benchmarks.arena.tasks.listops import operator_majority


def test_rows_keep_their_thread_count_and_odd_ones_are_named(tmp_path):
    old = {"task": "t", "settings": {"a": 1}, "environment": {"torch_threads": 2}, "rows": {"x": {"loss": 1.0}}}
    (tmp_path / "t.json").write_text(json.dumps(old))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec = record.merge(tmp_path, "t", {"a": 1}, {"y": {"loss": 2.0}, "z": {"loss": 3.0}})
    finally:
        torch.set_num_threads(before)
    assert rec["rows"]["x"]["threads"] == 2                 # an older row: its record's count
    assert rec["rows"]["y"]["threads"] == rec["rows"]["z"]["threads"] == 1
    record.write(tmp_path, rec, "| table |", [])
    footer = (tmp_path / "t.md").read_text()
    assert "1 torch threads" in footer and "`x` (2)" in footer and "`y`" not in footer.split("comparable")[1]


def test_operator_majority_answers_with_each_operators_most_common_result():
    train = [(["[MAX", "1"], 9), (["[MAX", "2"], 9), (["[MAX", "3"], 8), (["[MIN", "4"], 0)]
    test = [(["[MAX", "5"], 9), (["[MAX", "6"], 8), (["[MIN", "7"], 0), (["[SM", "8"], 3)]
    assert operator_majority(train, test) == 2 / 4          # MAX -> 9 right once, MIN -> 0 right, SM unseen


def test_an_oom_stops_longer_lengths_only_and_later_rounds_measure_the_shorter_ones(tmp_path, monkeypatch):
    """Efficiency: a variant over the memory cap at one length is not run at longer ones (in any round), but
    a later round still measures its shorter lengths (it once marked every later cell as not run)."""
    from benchmarks.arena.tasks import efficiency
    from benchmarks.arena.variants import variant

    calls = []

    def fake(name, depth, length, s, seed, log):
        calls.append((name, depth, length))
        if name == "window" and length >= 256:
            return {"status": "oom", "error": "over the cap"}
        return {"status": "ok", "seconds": 0.1, "all_seconds": [0.1], "peak_mib": 10.0}

    monkeypatch.setattr(efficiency, "measure", fake)
    rec = efficiency.run([variant("window")], budget=None, out_dir=tmp_path, quick=True, seed=0,
                         log=lambda m: None, changes={"rounds": 2})
    cells = rec["rows"]["window"]["results"]
    for depth in cells:
        assert cells[depth]["128"]["status"] == "ok" and len(cells[depth]["128"]["rounds"]) == 2
        assert cells[depth]["256"]["status"] == "oom"
        assert calls.count(("window", int(depth), 128)) == 2 and calls.count(("window", int(depth), 256)) == 1


def test_efficiency_rows_keep_the_dense_of_their_own_run(tmp_path, monkeypatch):
    """A row's ratios are taken against dense as measured in the same run: a later run (perhaps on another
    processor) re-measures dense without changing an earlier row's speed-up, and the table names a row whose
    processor differs."""
    from benchmarks.arena.tasks import efficiency
    from benchmarks.arena.variants import variant

    dense_seconds = {"value": 0.4}

    def fake(name, depth, length, s, seed, log):
        seconds = dense_seconds["value"] if name == "dense" else 0.1
        return {"status": "ok", "seconds": seconds, "all_seconds": [seconds], "peak_mib": 10.0}

    monkeypatch.setattr(efficiency, "measure", fake)
    run = dict(budget=None, out_dir=tmp_path, quick=True, seed=0, log=lambda m: None, changes={"rounds": 1})
    efficiency.run([variant("window")], **run)
    stored = json.loads((tmp_path / "efficiency.json").read_text())
    stored["rows"]["window"]["cpu"] = "another CPU"
    (tmp_path / "efficiency.json").write_text(json.dumps(stored))
    dense_seconds["value"] = 0.2                # the next run's machine is twice as fast at dense
    rec = efficiency.run([variant("strided")], **run)
    for depth, cells in rec["rows"]["window"]["results"].items():
        assert all(cell["speedup"] == 4.0 for cell in cells.values())
        assert all(cell["speedup"] == 2.0 for cell in rec["rows"]["strided"]["results"][depth].values())
    page = (tmp_path / "efficiency.md").read_text()
    assert "another processor" in page and "`window` (another CPU)" in page
