"""Run logs: the CSV log (resumed logs equal uninterrupted ones), TensorBoard when installed, the loss plot."""

import sys
import types
import warnings

import pytest

from polyformer.train import logs
from polyformer.train.logs import TRAIN_FIELDS, CSVLog, TensorBoardLog, plot_losses, read_csv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(step: int) -> dict:
    """Losses with many digits, a validation loss every third step, the rest empty."""
    return {"step": step, "train_loss": 4.0 / (step + 1) + 1e-9 * step, "lr": 1e-3 * min(1.0, step / 4),
            "tokens_per_s": 1234.5 + step, "val_loss": 4.5 / (step + 1) if step % 3 == 0 else None}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(logs, "_warned", set())      # "says so once" per test, not once per session


def test_csv_header_once_and_exact_floats(tmp_path):
    log = CSVLog(tmp_path / "log.csv")
    for step in range(1, 4):
        log.log(row(step))
    lines = (tmp_path / "log.csv").read_text().splitlines()
    assert lines[0] == ",".join(TRAIN_FIELDS) and len(lines) == 4
    header, rows = read_csv(tmp_path / "log.csv")
    assert [float(r["train_loss"]) for r in rows] == [row(s)["train_loss"] for s in range(1, 4)]
    assert rows[0]["val_loss"] == "" and float(rows[2]["val_loss"]) == row(3)["val_loss"]


def test_resumed_log_equals_uninterrupted_log(tmp_path):
    straight = CSVLog(tmp_path / "straight.csv")
    for step in range(1, 9):
        straight.log(row(step))
    interrupted = CSVLog(tmp_path / "resumed.csv")
    for step in range(1, 7):                 # logged up to step 6, last checkpoint at step 4
        interrupted.log(row(step))
    with open(tmp_path / "resumed.csv", "a") as f:
        f.write("7,0.5,,0.00")               # killed in the middle of a row
    with pytest.warns(UserWarning, match="unfinished last line"):
        resumed = CSVLog(tmp_path / "resumed.csv", resume_step=4)
    for step in range(5, 9):
        resumed.log(row(step))
    assert (tmp_path / "resumed.csv").read_bytes() == (tmp_path / "straight.csv").read_bytes()


def test_csv_bad_use_is_refused(tmp_path):
    CSVLog(tmp_path / "log.csv").log(row(1))
    with pytest.raises(FileExistsError, match="resume_step"):
        CSVLog(tmp_path / "log.csv")                     # a new run never overwrites a log
    with pytest.raises(ValueError, match="has columns"):
        CSVLog(tmp_path / "log.csv", fields=("step", "loss"), resume_step=1)
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 2
    with pytest.raises(ValueError, match="unknown CSV log fields \\['trian_loss'\\]"):
        CSVLog(tmp_path / "other.csv").log({"step": 1, "trian_loss": 2.0})
    with pytest.raises(ValueError, match="'step'"):
        CSVLog(tmp_path / "third.csv", fields=("loss",))
    assert CSVLog(tmp_path / "missing.csv", resume_step=3).path.read_text() == ",".join(TRAIN_FIELDS) + "\n"


def test_plot_is_a_png_and_is_redrawn(tmp_path):
    pytest.importorskip("matplotlib")
    log = CSVLog(tmp_path / "log.csv")
    png = tmp_path / "loss.png"
    assert plot_losses(tmp_path / "log.csv", png) == png              # no rows yet: still a picture
    for step in range(1, 4):
        log.log(row(step))
    plot_losses(tmp_path / "log.csv", png)
    first = png.read_bytes()
    assert first.startswith(PNG_MAGIC)
    for step in range(4, 10):
        log.log(row(step))
    plot_losses(tmp_path / "log.csv", png)
    assert png.read_bytes().startswith(PNG_MAGIC) and png.read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.csv", "loss.png"]    # no temp files left


def test_plot_without_matplotlib_warns_once(tmp_path, monkeypatch):
    CSVLog(tmp_path / "log.csv").log(row(1))
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)                 # import fails
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert plot_losses(tmp_path / "log.csv", tmp_path / "loss.png") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_losses(tmp_path / "log.csv", tmp_path / "loss.png") is None
    assert not (tmp_path / "loss.png").exists()


def test_tensorboard_is_a_no_op_when_unavailable_and_warns_only_when_asked_for(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # not asked for (the default): silent
        board = TensorBoardLog(tmp_path / "tb")
    assert not board.available
    board.log(row(1))
    board.close()
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        assert not TensorBoardLog(tmp_path / "tb", asked=True).available
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # once
        assert not TensorBoardLog(tmp_path / "tb", asked=True).available
    assert not (tmp_path / "tb").exists()


def test_tensorboard_writes_scalars_when_available(tmp_path, monkeypatch):
    calls = []

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            calls.append(("open", log_dir, purge_step))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    board = TensorBoardLog(tmp_path / "tb", resume_step=4)            # events after step 4 are purged
    assert board.available
    board.log({"step": 6, "train_loss": 1.5, "val_loss": None, "lr": 0.001})
    board.close()
    assert calls == [("open", str(tmp_path / "tb"), 5), ("train_loss", 1.5, 6), ("lr", 0.001, 6), ("close",)]
