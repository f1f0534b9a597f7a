"""`polyformer train --train.expert_parallel N` under torchrun: the run equals one process holding every
expert, its checkpoints hold every expert and load in one process, a resumed run equals an uninterrupted
one; what cannot run is refused by name."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polyformer.train.cli import main
from polyformer.train.commands import load_model

COMMON = ["--preset", "tiny", "--train.progress", "false", "--data.max_bytes", "40000", "--model.dim", "32",
          "--model.depth", "2", "--model.max_seq_len", "32", "--train.batch_size", "8", "--train.eval_every", "3",
          "--train.checkpoint_every", "3", "--train.sample_tokens", "8", "--model.layers.ff_moe", "true",
          "--model.layers.ff_num_experts", "4", "--model.layers.ff_moe_balance_loss", "0.1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def polyformer(*args: str, processes: int = 1) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={processes}"] if processes > 1 else []
    return subprocess.run([sys.executable, *launcher, "-m", "polyformer", *args], capture_output=True, text=True,
                          timeout=600, env=ENV)


def rows(run: Path) -> list[dict[str, str]]:
    with open(run / "log.csv") as f:
        return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in csv.DictReader(f)]


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


@pytest.mark.slow
def test_expert_parallel_run_equals_one_process_and_resumes_exactly(tmp_path):
    two = polyformer("train", *COMMON, "--steps", "6", "--train.expert_parallel", "2", "--out",
                     str(tmp_path / "ep"), processes=2)
    assert two.returncode == 0, two.stderr[-3000:]
    one = polyformer("train", *COMMON, "--steps", "6", "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    ep, single = rows(tmp_path / "ep"), rows(tmp_path / "one")
    assert len(ep) == len(single) == 6
    for a, b in zip(ep, single):                 # train loss, aux terms (balance, z, loads), val loss
        for key, value in b.items():
            if value:
                assert abs(float(a[key]) - float(value)) < 1e-5, key
    stored = weights(tmp_path / "ep", 6)
    assert stored["attn_layers.blocks.1.branch.experts.w_in"].shape[0] == 4           # every expert on disk
    for name, tensor in weights(tmp_path / "one", 6).items():
        torch.testing.assert_close(stored[name], tensor, atol=1e-5, rtol=0, msg=name)
    _, model = load_model(str(tmp_path / "ep"))                                        # loads in one process
    assert model.attn_layers.blocks[1].branch.experts.num == 4
    half = polyformer("train", *COMMON, "--steps", "3", "--train.expert_parallel", "2", "--out",
                      str(tmp_path / "half"), processes=2)
    resumed = polyformer("train", "--resume", "--steps", "6", "--out", str(tmp_path / "half"), processes=2)
    assert half.returncode == 0 and resumed.returncode == 0, resumed.stderr[-3000:]
    assert rows(tmp_path / "half") == ep                                                # bit for bit
    for name, tensor in weights(tmp_path / "half", 6).items():
        assert torch.equal(tensor, stored[name]), name


def refused(tmp_path: Path, *args: str, processes: int = 1) -> str:
    if processes > 1:
        done = polyformer("train", *COMMON, "--steps", "2", "--out", str(tmp_path / "run"), *args, processes=processes)
        assert done.returncode != 0
        return done.stderr
    try:
        code = main(["train", *COMMON, "--steps", "2", "--out", str(tmp_path / "run"), *args])
    except SystemExit as stop:
        code = stop.code
    assert code not in (0, None)
    assert not (tmp_path / "run" / "checkpoints").exists()
    return ""


def test_expert_parallel_without_torchrun_or_with_fsdp_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)         # main() replaces it
    refused(tmp_path, "--train.expert_parallel", "2")
    assert "train.expert_parallel=2 spreads the experts over processes: start the run with torchrun" in \
        capsys.readouterr().err
    refused(tmp_path, "--train.expert_parallel", "2", "--fsdp")
    assert "train.expert_parallel=2 does not combine with --fsdp" in capsys.readouterr().err
    refused(tmp_path, "--train.expert_parallel", "0")
    assert "train.expert_parallel must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_expert_parallel_not_dividing_the_world_or_the_experts_is_refused(tmp_path):
    err = refused(tmp_path, "--train.expert_parallel", "3", "--model.layers.ff_num_experts", "3", processes=2)
    assert "train.expert_parallel=3 must divide the number of processes (2)" in err
    err = refused(tmp_path, "--train.expert_parallel", "2", "--model.layers.ff_num_experts", "3", processes=2)
    assert "train.expert_parallel=2 must divide ff_num_experts=3" in err
