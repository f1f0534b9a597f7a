"""The training command line, driven as a person would: real subprocesses on tiny settings."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from polyformer import Int8Linear
from polyformer.layout import is_input_major
from polyformer.train.sample import prepare_for_sampling
from polyformer.train.tokenizer import BPETokenizer
from polyformer.train.commands import load_model, load_run

TINY = ["--preset", "tiny", "--train.progress", "false", "--data.max_bytes", "40000",
        "--model.dim", "32", "--model.depth", "1", "--model.max_seq_len", "32"]


def polyformer(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "polyformer", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def losses(run: Path, column: str = "train_loss") -> list[str]:
    with open(run / "log.csv") as f:
        return [row[column] for row in csv.DictReader(f)]


def test_train_generate_eval(tmp_path):
    run = tmp_path / "run"
    done = polyformer("train", *TINY, "--steps", "40", "--out", str(run), "--train.eval_every", "20",
                      "--train.lr", "5e-3")
    assert done.returncode == 0, done.stderr
    assert "val loss" in done.stdout and "done: 40 steps" in done.stdout
    for name in ("config.json", "log.csv", "loss.png", "tokenizer.json"):
        assert (run / name).is_file(), name
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["settings"]["train"]["steps"] == 40 and config["train"]["corpus_sha256"]
    train = [float(v) for v in losses(run)]
    assert len(train) == 40 and sum(train[-5:]) / 5 < train[0] - 1.0          # the loss falls
    with open(run / "log.csv") as f:
        assert set(csv.DictReader(f).fieldnames) >= {"step", "train_loss", "val_loss", "lr", "tokens_per_s"}
    generated = polyformer("generate", "--run", str(run), "--max-new-tokens", "30", "--prompt", "def ")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("def ") and len(generated.stdout) > 4
    greedy = polyformer("generate", "--run", str(run), "--max-new-tokens", "12", "--prompt", "def ",
                        "--temperature", "0", "--int8")
    assert greedy.returncode == 0 and greedy.stdout.startswith("def "), greedy.stderr
    # what --int8 (and the default) do to the loaded model: int8 weights whose logits stay close
    _, model, data = load_run(str(run))
    x = data.val[None, :64]
    with torch.no_grad():
        reference = model(x)
        assert torch.allclose(prepare_for_sampling(model, int8=False)(x), reference, atol=1e-5)
        assert is_input_major(model.attn_layers.blocks[0].branch.project.to_qkv.weight)
        quantized = prepare_for_sampling(load_model(str(run))[1], int8=True)
        assert any(isinstance(m, Int8Linear) for m in quantized.modules())
        got = quantized(x)
    assert not torch.equal(got, reference) and (got - reference).norm() / reference.norm() < 0.05
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
    evaluated = polyformer("eval", "--run", str(run))
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"scored {run / 'checkpoints' / 'step-000040'}" in evaluated.stderr      # which weights were scored
    values = dict(zip(evaluated.stdout.split()[0::2], map(float, evaluated.stdout.split()[1::2])))
    assert abs(values["perplexity"] - 2.718281828 ** values["loss"]) < 1e-2 * values["perplexity"]
    assert abs(values["bits_per_byte"] - values["loss"] / 0.693147) < 1e-3   # byte-level: tokens are bytes


def test_generate_with_a_draft_is_speculative_and_keeps_the_targets_text(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    for run, dim, window in ((target, "32", "32"), (draft, "16", "16")):    # the draft's window is shorter
        done = polyformer("train", *TINY, "--model.dim", dim, "--model.max_seq_len", window, "--steps", "30",
                          "--out", str(run), "--train.lr", "5e-3")
        assert done.returncode == 0, done.stderr
    common = ["--run", str(target), "--max-new-tokens", "20", "--prompt", "def ", "--temperature", "0"]
    plain = polyformer("generate", *common)
    fast = polyformer("generate", *common, "--draft", str(draft), "--gamma", "3")
    assert plain.returncode == 0 and fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout                       # greedy: exactly the target's own text
    accepted, proposed = map(int, re.search(r"gamma 3: (\d+) of (\d+) draft tokens", fast.stderr).groups())
    assert 0 <= accepted <= proposed and proposed > 0
    sampled = polyformer("generate", *common[:-2], "--draft", str(draft), "--top-k", "5", "--seed", "3")
    assert sampled.returncode == 0 and sampled.stdout.startswith("def "), sampled.stderr

    other = tmp_path / "other"                                # same model, another tokenizer
    shutil.copytree(draft, other)
    BPETokenizer.train(b"def main(): return 1\n" * 50, 260).save(other)
    for args, message in ((["--draft", str(other)], "another tokenizer"),
                          (["--gamma", "2"], "needs --draft"),
                          (["--draft", str(draft), "--gamma", "0"], "gamma must be an integer >= 1"),
                          (["--draft", str(draft), "--top-p", "1.5"], "top_p"),
                          (["--top-k", "0"], "top_k"),
                          (["--draft", str(draft), "--max-new-tokens", "40"], "exceed the target's window of 32")):
        refused = polyformer("generate", "--run", str(target), "--max-new-tokens", "10", *args)
        assert refused.returncode != 0 and message in refused.stderr, (args, refused.stderr)


def test_resume_continues_exactly(tmp_path):
    common = [*TINY, "--train.checkpoint_every", "3", "--train.eval_every", "100"]
    straight = polyformer("train", *common, "--steps", "8", "--out", str(tmp_path / "a"))
    first = polyformer("train", *common, "--steps", "4", "--out", str(tmp_path / "b"))
    resumed = polyformer("train", "--resume", "--steps", "8", "--out", str(tmp_path / "b"), "--train.progress", "false")
    for done in (straight, first, resumed):
        assert done.returncode == 0, done.stderr
    assert losses(tmp_path / "a") == losses(tmp_path / "b")                   # bit for bit, as text


def test_sigterm_saves_and_resume_matches(tmp_path):
    common = [*TINY, "--train.checkpoint_every", "1000", "--train.eval_every", "1000"]
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "polyformer", "train", *common, "--steps", "150", "--out", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and len(losses(run) if (run / "log.csv").exists() else []) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "checkpoint saved" in out
    stopped_at = len(losses(run))
    assert 3 <= stopped_at < 150 and (run / "checkpoints").is_dir()
    resumed = polyformer("train", "--resume", "--out", str(run))         # the run's own 150 steps
    assert resumed.returncode == 0, resumed.stderr
    straight = polyformer("train", *common, "--steps", "150", "--out", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr
    assert losses(run) == losses(tmp_path / "straight")


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path):
    run = tmp_path / "run"
    done = polyformer("train", *TINY, "--steps", "4", "--out", str(run), "--train.checkpoint_every", "2",
                      "--train.eval_every", "100")
    assert done.returncode == 0, done.stderr
    latest = sorted((run / "checkpoints").iterdir())[-1]
    weights = latest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])                          # truncated
    resumed = polyformer("train", "--resume", "--steps", "6", "--out", str(run), "--train.progress", "false")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at step 2" in resumed.stdout and latest.name in resumed.stderr


@pytest.mark.parametrize("args, message", [
    (["--model.dpth", "3"], "model.depth"),
    (["--bogus"], "--bogus"),
    (["--stpes", "3"], "did you mean '--steps'"),
    (["--train.steps", "many"], "train.steps"),
    (["--train.objective", "gan"], "train.objective"),
    (["--data.paths", "/no/such/file.txt"], "/no/such/file.txt"),
])
def test_bad_settings_exit_nonzero_naming_them(tmp_path, args, message):
    done = polyformer("train", *TINY, "--steps", "2", "--out", str(tmp_path / "run"), *args)
    assert done.returncode != 0
    assert message in done.stderr + done.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_flag_typo_in_generate_and_eval_names_the_flag_meant(tmp_path):
    for command, typo, meant in (("generate", "--temprature", "--temperature"), ("eval", "--batchs", "--batches")):
        done = polyformer(command, "--run", str(tmp_path), typo, "2")
        assert done.returncode != 0 and f"did you mean {meant!r}" in done.stderr


def test_several_paths_after_one_flag_are_one_list(tmp_path):
    from polyformer.train.cli import overrides
    from polyformer.train.settings import resolve

    settings = resolve("tiny", None, overrides(["--data.paths", "a.txt", "b dir", "--model.depth", "3"]))
    assert settings.data.paths == ["a.txt", "b dir"] and settings.model.depth == 3


def test_resume_with_nothing_and_an_existing_run_are_refused(tmp_path):
    nothing = polyformer("train", "--resume", "--out", str(tmp_path / "none"))
    assert nothing.returncode != 0 and "none" in nothing.stderr
    run = tmp_path / "run"
    assert polyformer("train", *TINY, "--steps", "2", "--out", str(run)).returncode == 0
    before = (run / "log.csv").read_bytes()
    again = polyformer("train", *TINY, "--steps", "2", "--out", str(run))
    assert again.returncode != 0 and "--resume" in again.stderr
    assert (run / "log.csv").read_bytes() == before                           # nothing overwritten
    config = json.loads((run / "config.json").read_text())
    config["polyformer_run_format"] = 99
    (run / "config.json").write_text(json.dumps(config))
    incompatible = polyformer("train", "--resume", "--steps", "3", "--out", str(run))
    assert incompatible.returncode != 0 and "incompatible" in incompatible.stderr


def test_config_files_toml_and_yaml(tmp_path):
    (tmp_path / "c.toml").write_text('[model]\ndepth = 1\ndim = 32\nmax_seq_len = 32\n[train]\nsteps = 2\n')
    (tmp_path / "c.yaml").write_text("model:\n  depth: 1\n  dim: 32\n  max_seq_len: 32\ntrain:\n  steps: 2\n")
    for name in ("c.toml", "c.yaml"):
        run = tmp_path / name.replace(".", "_")
        done = polyformer("train", "--preset", "tiny", "--config", str(tmp_path / name), "--out", str(run),
                          "--data.max_bytes", "40000", "--train.progress", "false")
        assert done.returncode == 0, done.stderr
        settings = json.loads((run / "config.json").read_text())["train"]["settings"]
        assert settings["model"]["depth"] == 1 and settings["train"]["steps"] == 2
    (tmp_path / "bad.toml").write_text("[model]\ndeepth = 2\n")
    bad = polyformer("train", "--config", str(tmp_path / "bad.toml"), "--out", str(tmp_path / "bad"))
    assert bad.returncode != 0 and "deepth" in bad.stderr


@pytest.mark.parametrize("objective", ["mlm", "prefix_lm"])
def test_other_objectives_lower_their_loss(tmp_path, objective):
    run = tmp_path / objective
    done = polyformer("train", *TINY, "--steps", "30", "--out", str(run), "--train.objective", objective,
                      "--train.lr", "5e-3", "--train.eval_every", "100")
    assert done.returncode == 0, done.stderr
    train = [float(v) for v in losses(run)]
    assert sum(train[-5:]) / 5 < train[0] - 0.5


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(tmp_path):
    common = [*TINY, "--steps", "4", "--train.batch_size", "8", "--train.eval_every", "100"]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "polyformer",
                          "train", *common, "--out", str(tmp_path / "two")], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    one = polyformer("train", *common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    for a, b in zip(losses(tmp_path / "two"), losses(tmp_path / "one")):
        assert abs(float(a) - float(b)) < 1e-4
    assert not list((tmp_path / "two").glob("**/*rank1*"))                  # only rank 0 writes


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "polyformer",
                           *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_fsdp_equals_one_process_and_resumes_exactly(tmp_path):
    common = [*TINY, "--train.batch_size", "8", "--train.eval_every", "100", "--train.checkpoint_every", "3"]
    sharded = torchrun("train", *common, "--steps", "6", "--out", str(tmp_path / "fsdp"), "--fsdp")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    one = polyformer("train", *common, "--steps", "6", "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    for a, b in zip(losses(tmp_path / "fsdp"), losses(tmp_path / "one")):
        assert abs(float(a) - float(b)) < 1e-4
    half = torchrun("train", *common, "--steps", "3", "--out", str(tmp_path / "half"), "--fsdp")
    resumed = torchrun("train", "--resume", "--steps", "6", "--out", str(tmp_path / "half"))
    assert half.returncode == 0 and resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path / "half") == losses(tmp_path / "fsdp")                # bit for bit
    generated = polyformer("generate", "--run", str(tmp_path / "half"), "--max-new-tokens", "5")
    assert generated.returncode == 0, generated.stderr                          # full weights on disk


def test_fsdp_needs_torchrun(tmp_path):
    done = polyformer("train", *TINY, "--steps", "2", "--out", str(tmp_path / "run"), "--fsdp")
    assert done.returncode != 0 and "torchrun" in done.stderr


def test_bf16_autocast_trains(tmp_path):
    run = tmp_path / "bf16"
    done = polyformer("train", *TINY, "--steps", "30", "--out", str(run), "--train.bf16", "true",
                      "--train.lr", "5e-3", "--train.eval_every", "100")
    assert done.returncode == 0, done.stderr
    train = [float(v) for v in losses(run)]
    assert all(v == v for v in train) and sum(train[-5:]) / 5 < train[0] - 0.5


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    common = [*TINY, "--steps", "4", "--train.eval_every", "100"]
    whole = polyformer("train", *common, "--train.batch_size", "8", "--out", str(tmp_path / "whole"))
    accumulated = polyformer("train", *common, "--train.batch_size", "4", "--train.grad_accum", "2",
                             "--out", str(tmp_path / "accumulated"))
    assert whole.returncode == 0 and accumulated.returncode == 0, accumulated.stderr
    for a, b in zip(losses(tmp_path / "whole"), losses(tmp_path / "accumulated")):
        assert abs(float(a) - float(b)) < 1e-5


def test_bpe_tokenizer_run(tmp_path):
    run = tmp_path / "bpe"
    done = polyformer("train", *TINY, "--steps", "10", "--out", str(run), "--data.tokenizer", "bpe",
                      "--data.vocab_size", "400", "--train.eval_every", "10")
    assert done.returncode == 0, done.stderr
    saved = json.loads((run / "tokenizer.json").read_text())
    assert saved["kind"] == "bpe"
    evaluated = polyformer("eval", "--run", str(run))
    values = dict(zip(evaluated.stdout.split()[0::2], map(float, evaluated.stdout.split()[1::2])))
    bits_per_token = values["loss"] / 0.693147
    assert values["bits_per_byte"] < bits_per_token / 1.5            # a BPE token spans several bytes


def test_seq2seq_objective_lowers_its_loss(tmp_path):
    run = tmp_path / "copy"
    done = polyformer("train", *TINY, "--steps", "40", "--out", str(run), "--train.objective", "seq2seq",
                      "--train.task", "copy", "--train.task_length", "6", "--train.lr", "5e-3",
                      "--train.eval_every", "40")
    assert done.returncode == 0, done.stderr
    train = [float(v) for v in losses(run)]
    assert sum(train[-5:]) / 5 < train[0] - 0.5
    assert "val accuracy" in done.stdout


@pytest.mark.slow
def test_torch_compile_trains_like_eager(tmp_path):
    common = [*TINY, "--steps", "3", "--train.eval_every", "100"]
    eager = polyformer("train", *common, "--out", str(tmp_path / "eager"))
    compiled = polyformer("train", *common, "--train.compile", "true", "--out", str(tmp_path / "compiled"),
                          timeout=900)
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr[-3000:]
    for a, b in zip(losses(tmp_path / "eager"), losses(tmp_path / "compiled")):
        assert abs(float(a) - float(b)) < 1e-3


def test_resume_accepts_the_original_command_and_names_what_differs(tmp_path):
    """The command that started a run, repeated with --resume and more --steps, continues it exactly;
    a setting that differs is refused with both values."""
    common = [*TINY, "--train.checkpoint_every", "3", "--train.eval_every", "100"]
    straight = polyformer("train", *common, "--steps", "8", "--out", str(tmp_path / "a"))
    first = polyformer("train", *common, "--steps", "4", "--out", str(tmp_path / "b"))
    changed = polyformer("train", *common, "--model.dim", "48", "--steps", "8", "--out", str(tmp_path / "b"),
                         "--resume")
    assert changed.returncode != 0
    assert "--model.dim is 48 here but 32 in the run" in changed.stderr, changed.stderr
    resumed = polyformer("train", *common, "--steps", "8", "--out", str(tmp_path / "b"), "--resume")
    for done in (straight, first, resumed):
        assert done.returncode == 0, done.stderr
    assert losses(tmp_path / "a") == losses(tmp_path / "b")                   # bit for bit, as text


def test_obvious_mistakes_get_one_line_and_leave_no_run_behind(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.dat").write_bytes(bytes(range(256)) * 4)
    cases = [
        (["train", *TINY, "--steps", "2", "--data.paths", str(tmp_path / "nope.txt")], "does not exist"),
        (["train", *TINY, "--steps", "2", "--data.paths", str(tmp_path / "empty.txt")], "corpus is empty"),
        (["train", *TINY, "--steps", "2", "--data.paths", str(tmp_path / "binary.dat")], "is binary"),
        (["train", *TINY, "--steps", "2", "--model.dimm", "3"], "did you mean 'model.dim'"),
        (["generate", "--run", str(tmp_path), "--prompt", "x"], "is not a polyformer run directory"),
        (["eval", "--run", str(tmp_path / "nothing")], "does not exist"),
    ]
    for n, (args, message) in enumerate(cases):
        out = tmp_path / f"run{n}"
        done = polyformer(*args, *(["--out", str(out)] if args[0] == "train" else []))
        assert done.returncode != 0 and message in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
        assert done.stderr.startswith("polyformer: ")
        assert not out.exists(), args                       # no half-made run directory
    debug = polyformer("train", *TINY, "--steps", "2", "--model.dimm", "3", "--out", str(tmp_path / "d"), "--debug")
    assert "Traceback" in debug.stderr


def test_train_help_lists_every_setting_with_its_default():
    import dataclasses

    from polyformer.train.settings import RunSettings

    shown = polyformer("train", "--help").stdout
    for section in dataclasses.fields(RunSettings):
        for f in dataclasses.fields(section.default_factory()):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            line = next((l for l in shown.splitlines() if l.strip().startswith(f"--{section.name}.{f.name} ")), None)
            assert line is not None, f"{section.name}.{f.name} missing from train --help"
            assert line.rstrip().endswith(f"[{json.dumps(default)}]"), line


def test_progress_is_plain_lines_when_not_a_terminal(tmp_path):
    args = [a for a in TINY if a not in ("--train.progress", "false")]
    done = polyformer("train", *args, "--steps", "4", "--train.eval_every", "2", "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    lines = [l for l in done.stderr.splitlines() if l.startswith("train: step ")]
    assert lines and lines[-1].startswith("train: step 4/4") and "tok_s" in lines[-1], done.stderr
    assert "sample:" in done.stdout
