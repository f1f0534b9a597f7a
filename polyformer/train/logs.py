"""What a person sees of a run: a CSV log (one row per logged step), TensorBoard events when
tensorboard is installed, and a PNG of training and validation loss redrawn at each evaluation.

    log = CSVLog(run / "log.csv", resume_step=None if fresh else step)   # resume: rows > step dropped
    board = TensorBoardLog(run / "tensorboard", resume_step=...)          # no-op without tensorboard
    log.log({"step": 10, "train_loss": 2.31, "lr": 1e-3, "tokens_per_s": 5120.0}); board.log(row)
    plot_losses(run / "log.csv", run / "loss.png")                         # after each evaluation
"""

from __future__ import annotations

import csv
import io
import math
import os
import warnings
from pathlib import Path
from typing import Any

from torch import Tensor

from .files import replace_atomic, write_atomic

TRAIN_FIELDS = ("step", "train_loss", "val_loss", "lr", "tokens_per_s")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def read_csv(path: str | os.PathLike) -> tuple[list[str], list[dict[str, str]]]:
    """(header, rows) of a CSV log; a last line without its newline (a write cut short) is dropped,
    as is any row with the wrong number of cells."""
    text = Path(path).read_text()
    if not text:
        return [], []
    lines = text.split("\n")
    complete, partial = lines[:-1], lines[-1]      # after the last "\n": "" unless cut short
    if partial:
        warnings.warn(f"{str(path)!r}: dropping an unfinished last line {partial!r}", stacklevel=2)
    table = list(csv.reader(complete))
    if not table:
        return [], []
    header, rows = table[0], []
    for cells in table[1:]:
        if len(cells) != len(header):
            warnings.warn(f"{str(path)!r}: dropping a malformed row {cells!r}", stacklevel=2)
            continue
        rows.append(dict(zip(header, cells)))
    return header, rows


def _cell(value: Any) -> str:
    if isinstance(value, Tensor):
        value = value.item()
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)     # repr: floats round-trip exactly


class CSVLog:
    """A CSV log with a fixed header, one row appended per `log` call.

    Args:
        path: the CSV file.
        fields: the columns, "step" among them.
        resume_step: None for a new run (the file must not exist or be empty, FileExistsError
            otherwise); the checkpoint's step when resuming: rows with a larger step are removed, so
            the resumed log equals the log of a run that was never interrupted.
    """

    def __init__(self, path: str | os.PathLike, fields: tuple[str, ...] | list[str] = TRAIN_FIELDS,
                 resume_step: int | None = None):
        self.path, self.fields = Path(path), tuple(fields)
        if "step" not in self.fields or len(set(self.fields)) != len(self.fields):
            raise ValueError(f"fields must name 'step' and no column twice, got {self.fields}")
        exists = self.path.is_file() and self.path.stat().st_size > 0
        rows: list[dict[str, str]] = []
        if resume_step is None and exists:
            raise FileExistsError(f"CSV log {str(self.path)!r} exists: pass resume_step to continue it, or use a "
                                  "new run directory")
        if resume_step is not None and exists:
            header, rows = read_csv(self.path)
            if tuple(header) != self.fields:
                raise ValueError(f"CSV log {str(self.path)!r} has columns {header}, this run logs {list(self.fields)}")
            steps = [_step(row, self.path) for row in rows]
            rows = [row for row, step in zip(rows, steps) if step is not None and step <= resume_step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rewrite(rows)

    def _rewrite(self, rows: list[dict[str, str]]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, self.fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        write_atomic(self.path, text.getvalue().encode())

    def log(self, row: dict[str, Any]) -> None:
        """Append one row: {"step": int, field: number or None, ...}; absent fields stay empty."""
        unknown = sorted(set(row) - set(self.fields))
        if unknown:
            raise ValueError(f"unknown CSV log fields {unknown}; this log has {list(self.fields)}")
        if "step" not in row:
            raise ValueError("a CSV log row needs a 'step'")
        with open(self.path, "a", newline="") as f:
            csv.writer(f, lineterminator="\n").writerow([_cell(row.get(name)) for name in self.fields])


def _step(row: dict[str, str], path: Path) -> int | None:
    try:
        return int(row["step"])
    except ValueError:
        warnings.warn(f"{str(path)!r}: dropping a row with step {row['step']!r}", stacklevel=3)
        return None


class TensorBoardLog:
    """Scalars to TensorBoard when `torch.utils.tensorboard` imports; otherwise a no-op, which says so
    once when TensorBoard was asked for.

    Args:
        log_dir: the event directory.
        resume_step: when resuming, events after this step (from the interrupted run) are purged.
        asked: True: the user asked for TensorBoard (warn when it is missing); False: never write
            events; None: write them when tensorboard is installed, silently otherwise.
    """

    def __init__(self, log_dir: str | os.PathLike, resume_step: int | None = None, asked: bool | None = None):
        self.writer = None
        if asked is False:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            if asked:
                _warn_once("tensorboard", "tensorboard is not installed: no TensorBoard events are written "
                                          "(pip install tensorboard); the CSV log has the same numbers")
        else:
            purge = None if resume_step is None else resume_step + 1
            self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    @property
    def available(self) -> bool:
        return self.writer is not None

    def log(self, row: dict[str, Any]) -> None:
        """Every number in the row but "step" as a scalar at that step; None / empty values are skipped."""
        if self.writer is None:
            return
        step = int(row["step"])
        for name, value in row.items():
            if isinstance(value, Tensor):
                value = value.item()
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(name, float(value), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _series(rows: list[dict[str, str]], field: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        try:
            step, value = int(row["step"]), float(row.get(field) or "nan")
        except ValueError:
            continue
        if math.isfinite(value):
            steps.append(step)
            values.append(value)
    return steps, values


def plot_losses(csv_path: str | os.PathLike, png_path: str | os.PathLike, title: str | None = None) -> Path | None:
    """Draw train_loss and val_loss against step from a CSV log into a PNG (written atomically).

    Needs matplotlib (Agg, no display); without it, warns once and returns None.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        _warn_once("matplotlib", "matplotlib is not installed: the loss plot is not drawn (pip install matplotlib)")
        return None
    _, rows = read_csv(csv_path)
    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    train, val = _series(rows, "train_loss"), _series(rows, "val_loss")
    if train[0]:
        ax.plot(*train, lw=1, alpha=0.8, label="train")
    if val[0]:
        ax.plot(*val, "o-", lw=1.5, ms=3, label="validation")
    if train[0] or val[0]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no losses logged yet", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="step", ylabel="loss", title=title or Path(csv_path).parent.name or "loss")
    ax.grid(alpha=0.3)
    png_path = Path(png_path)
    replace_atomic(png_path, lambda f: figure.savefig(f, format="png"))
    return png_path
