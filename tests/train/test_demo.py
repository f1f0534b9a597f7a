"""The README's main-job command: the demo trains on the built-in corpus and its loss falls."""

import re
import subprocess
import sys

from polyformer.train.corpus import stdlib_bytes, stdlib_files


def test_corpus_is_deterministic_and_local():
    files = stdlib_files()
    assert files == sorted(files, key=lambda p: p.as_posix())
    assert all("site-packages" not in p.parts for p in files)
    assert stdlib_bytes(100_000) == stdlib_bytes(100_000)
    assert len(stdlib_bytes(100_000)) == 100_000


def test_demo_loss_falls_and_prints_a_sample():
    cmd = [sys.executable, "-m", "polyformer", "demo", "--steps", "60", "--dim", "32", "--depth", "1",
           "--seq-len", "32", "--batch", "8", "--lr", "3e-3"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    losses = [float(v) for v in re.findall(r"val loss (\d+\.\d+)", run.stdout)]
    assert len(losses) >= 3
    assert losses[-1] < losses[0] - 1.0, run.stdout
    assert "sample:" in run.stdout


def test_unknown_command_fails_with_its_name():
    run = subprocess.run([sys.executable, "-m", "polyformer", "trian"], capture_output=True, text=True)
    assert run.returncode == 2 and "trian" in run.stderr
