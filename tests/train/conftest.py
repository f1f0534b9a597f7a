"""The command line in this process (faster than a subprocess), and a small corpus of its own."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Callable

import pytest

# a model small enough that a few steps take well under a second
SMALL = ["--preset", "tiny", "--train.progress", "false", "--model.dim", "32", "--model.depth", "1",
         "--model.heads", "2", "--model.max_seq_len", "32", "--train.batch_size", "4", "--train.eval_batches", "2",
         "--train.sample_tokens", "8"]

WORDS = ("the cat sat on a mat while one dog ran far away and every bird sang loud songs at dawn "
         "über naïve café résumé").split()


def text(seed: int, n_words: int = 900) -> str:
    g = random.Random(seed)
    return " ".join(g.choice(WORDS) for _ in range(n_words)) + "\n"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of five text files (about 5 kB each)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, name in enumerate(("a.txt", "b.txt", "c.txt", "d.txt", "e.txt")):
        (folder / name).write_text(text(i), encoding="utf-8")
    return folder


@pytest.fixture
def cli(monkeypatch, capsys) -> Callable[..., tuple[int, str, str]]:
    """cli(*args) -> (exit code, stdout, stderr) of `polyformer ARGS`."""
    from polyformer.train.cli import main

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)     # main() replaces it

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
