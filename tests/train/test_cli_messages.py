"""What the command line says when it is used wrongly (one line, exit status 2, what to do), and
progress lines whose ETA leaves out the pauses for evaluation, and a column per auxiliary loss in the
training log."""

from __future__ import annotations

import csv

import pytest

from polyformer.train import progress

from .conftest import SMALL


@pytest.mark.parametrize("args, message", [
    ((), "polyformer: the following arguments are required: command"),
    (("trian", "--out", "x"), "did you mean 'train'?"),
    (("train",), "polyformer train: the following arguments are required: --out"),
    (("train", "--out", "x", "--preset", "tny"), "invalid choice: 'tny'"),
    (("train", "--out", "x", "--stpes", "3"), "did you mean '--steps'"),
    (("generate",), "polyformer generate: the following arguments are required: --run"),
    (("eval", "--run", "x", "--batches", "many"), "invalid int value: 'many'"),
])
def test_usage_errors_are_one_line_with_status_2(cli, args, message):
    code, out, err = cli(*args)
    assert code == 2 and not out
    assert message in err and err.count("\n") == 1 and err.startswith("polyformer"), err
    assert "usage:" not in err


def test_plain_progress_eta_leaves_out_pauses(monkeypatch, capsys):
    clock = iter([100.0,              # opened (after the first step)
                  101.0, 102.0,       # two steps of 1 s
                  112.0,              # unpause after a 10 s evaluation
                  113.0])             # one more step of 1 s
    monkeypatch.setattr(progress.time, "time", lambda: next(clock))
    bar = progress.PlainProgress(total=14, step=1)
    bar.every = 1
    bar.update(1)
    bar.update(1)
    bar.unpause()
    bar.set_postfix(loss="1.000")
    bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "train: step 2/14  eta 00:12"       # 12 steps left at 1 s each
    assert lines[-1] == "train: step 4/14  loss 1.000  eta 00:10", lines    # the 10 s pause is not a step's time


def test_a_file_where_a_run_directory_belongs_is_named(tmp_path, cli):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for args in (("train", "--preset", "tiny", "--out", notes), ("train", "--resume", "--out", notes),
                 ("generate", "--run", notes), ("eval", "--run", notes)):
        code, out, err = cli(*args)
        assert code == 2 and f"{str(notes)!r} is a file" in err and err.count("\n") == 1, (args, err)
    assert notes.read_text() == "mine"


def test_training_logs_each_auxiliary_loss_by_name(cli, corpus, tmp_path):
    """A model whose blocks report an auxiliary loss (routing attention's k-means commitment): the
    trainer adds it to the loss and logs it in its own column, every step."""
    out = tmp_path / "run"
    code, _, err = cli("train", *SMALL, "--data.paths", str(corpus), "--steps", "3", "--train.eval_every", "3",
                       "--model.layers.attn_routing", "True", "--model.layers.attn_routing_clusters", "2",
                       "--model.layers.attn_routing_window", "8", "--out", str(out))
    assert code == 0, err
    with open(out / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    terms = [float(r["aux_routing_commitment"]) for r in rows]
    assert all(0 < t < 4 for t in terms)        # 2 - 2 cos per position, averaged, summed over 1 layer
