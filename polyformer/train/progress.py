"""Training progress: tqdm's bar on a terminal, plain periodic lines when stderr is not one."""

from __future__ import annotations

import sys
import time
from typing import Any


def progress_bar(total: int, step: int) -> Any:
    """tqdm's bar on a terminal; plain periodic lines otherwise (a log file would get every redraw)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(total, step)
    if not sys.stderr.isatty():
        return PlainProgress(total, step)
    return tqdm(total=total, initial=step, desc="train", dynamic_ncols=True, file=sys.stderr)


class PlainProgress:
    """Progress as plain periodic lines on stderr (output that is not a terminal): one about every
    twentieth of the run or every 30 s, whichever comes first, with an ETA from the time between
    updates (a pause ended by `unpause` left out). tqdm's calls that the loop uses."""

    def __init__(self, total: int, step: int, every_s: float = 30.0):
        self.total, self.step = total, step
        self.every = max(1, total // 20)
        self.every_s = every_s
        self.last = self.mark = time.time()
        self.elapsed, self.counted = 0.0, 0
        self.postfix: dict[str, str] = {}
        self.description = "train"

    def update(self, n: int = 1) -> None:
        self.step += n
        now = time.time()
        self.elapsed, self.counted, self.mark = self.elapsed + now - self.mark, self.counted + n, now
        if self.step % self.every == 0 or self.step == self.total or now - self.last >= self.every_s:
            self.last = now
            left = (self.total - self.step) * self.elapsed / self.counted
            extra = "  ".join(f"{k} {v}" for k, v in {**self.postfix, "eta": _clock(left)}.items())
            print(f"{self.description}: step {self.step}/{self.total}  {extra}", file=sys.stderr, flush=True)

    def unpause(self) -> None:
        self.mark = time.time()

    def set_postfix(self, **values: str) -> None:
        self.postfix = values

    def set_description(self, text: str) -> None:
        self.description = text

    def write(self, text: str) -> None:
        print(text, flush=True)                 # as tqdm.write: stdout

    def close(self) -> None:
        pass


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}" if minutes >= 60 else f"{minutes:02d}:{s:02d}"
