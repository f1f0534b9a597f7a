"""`polyformer convert` end to end, as a person would run it (subprocesses): a Hugging Face GPT-2
directory made with save_pretrained, with its tokenizer.json, becomes a run directory whose
`polyformer generate` gives the Hugging Face model's greedy tokens and whose `polyformer eval`
runs; `--to-hf` writes it back as a directory transformers loads with the same weights."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .hf_models import spread, transformers

tokenizers = pytest.importorskip("tokenizers")

TEXT = ("the quick brown fox jumps over the lazy dog. " * 3 + "a converted model speaks as it did before. "
        "polyformer reads hugging face directories without a network. ") * 8
PROMPT = "the lazy fox"


def polyformer(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "polyformer", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def tiny_tokenizer() -> "tokenizers.Tokenizer":
    tk = tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["<|endoftext|>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module, "tokenizers.Tokenizer"]:
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=12, n_layer=2, n_head=3,
                                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = spread(transformers.GPT2LMHeadModel(config))
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    hf.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path, hf, tok


@pytest.mark.slow
def test_convert_generate_eval_and_back(hf_dir, tmp_path):
    path, hf, tok = hf_dir
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    run = tmp_path / "run"
    done = polyformer("convert", "--from-hf", str(path), "--out", str(run), "--data.paths", str(corpus),
                      "--data.max_bytes", "none", "--model.max_seq_len", "32", "--train.batch_size", "2")
    assert done.returncode == 0, done.stderr
    assert "GPT2LMHeadModel" in done.stdout
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]      # no temporary left behind

    generated = polyformer("generate", "--run", str(run), "--prompt", PROMPT, "--max-new-tokens", "12",
                           "--temperature", "0")
    assert generated.returncode == 0, generated.stderr
    prompt_ids = torch.tensor([tok.encode(PROMPT).ids])
    with torch.no_grad():
        new = hf.generate(prompt_ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = PROMPT + tok.decode(new[0, prompt_ids.shape[1]:].tolist(), skip_special_tokens=False)
    assert generated.stdout.rstrip("\n") == expected

    evaluated = polyformer("eval", "--run", str(run), "--batches", "2")
    assert evaluated.returncode == 0, evaluated.stderr
    values = dict(zip(evaluated.stdout.split()[0::2], map(float, evaluated.stdout.split()[1::2])))
    assert math.isfinite(values["loss"]) and values["loss"] > 0

    back = tmp_path / "back"
    written = polyformer("convert", "--to-hf", str(run), "--out", str(back))
    assert written.returncode == 0, written.stderr
    assert sorted(p.name for p in back.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(back)
    original, again = hf.state_dict(), loaded.state_dict()
    assert list(original) == list(again) and all(torch.equal(original[k], again[k]) for k in original)
    assert tokenizers.Tokenizer.from_file(str(back / "tokenizer.json")).encode(PROMPT).ids == prompt_ids[0].tolist()


def cli(monkeypatch, capsys, *args: str) -> tuple[int | str, str, str]:
    """`polyformer ARGS` in this process (faster than a subprocess): (exit code or message, stdout, stderr)."""
    import warnings

    from polyformer.train.cli import main

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)     # main() replaces it
    try:
        code: int | str = main(list(args))
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err + (code if isinstance(code, str) else "")


def test_convert_refuses_and_explains(hf_dir, tmp_path, monkeypatch, capsys):
    path, _, _ = hf_dir
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    code, _, err = cli(monkeypatch, capsys, "convert", "--from-hf", str(path), "--out", str(busy))
    assert code != 0 and "not empty" in err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    # --to-hf checks --out before it loads anything (here the run does not even exist)
    code, _, err = cli(monkeypatch, capsys, "convert", "--to-hf", str(tmp_path / "no-run"), "--out", str(busy))
    assert code != 0 and "not empty" in err and "--out" in err

    code, _, err = cli(monkeypatch, capsys, "convert", "--from-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r"))
    assert code != 0 and "config.json" in err and not (tmp_path / "r").exists()

    code, _, err = cli(monkeypatch, capsys, "convert", "--from-hf", str(path), "--out", str(tmp_path / "r"),
                       "--model.depth", "3")
    assert code != 0 and "--model.depth" in err and not (tmp_path / "r").exists()

    bare = tmp_path / "bare"               # a model directory without tokenizer.json
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((path / name).read_bytes())
    run = tmp_path / "run"
    code, out, err = cli(monkeypatch, capsys, "convert", "--from-hf", str(bare), "--out", str(run))
    assert code == 0, err
    assert "no tokenizer.json" in out
    code, _, err = cli(monkeypatch, capsys, "generate", "--run", str(run), "--prompt", "x")
    assert code != 0 and "tokenizer.json" in err and "convert again" in err
    code, _, err = cli(monkeypatch, capsys, "train", "--resume", "--out", str(run))
    assert code != 0 and "not resumed" in err

    config = json.loads((bare / "config.json").read_text())
    config["scale_attn_by_inverse_layer_idx"] = True
    (bare / "config.json").write_text(json.dumps(config))
    code, _, err = cli(monkeypatch, capsys, "convert", "--from-hf", str(bare), "--out", str(tmp_path / "u"))
    assert code != 0 and "scale_attn_by_inverse_layer_idx" in err
    assert not (tmp_path / "u").exists()
