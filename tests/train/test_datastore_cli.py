"""`polyformer datastore`, `eval --knn` and `generate --knn` end to end: λ = 0 scores as plain eval, the
datastore's own text gets a far lower perplexity, another run's datastore, a damaged one and bad knn
values are refused by name, and an existing --out is never overwritten."""

from __future__ import annotations

import json
import math

import pytest

from .conftest import SMALL, text
from .test_eval_text import scores


@pytest.fixture
def trained(tmp_path, corpus, cli):
    run = tmp_path / "run"
    code, _, err = cli("train", *SMALL, "--steps", "4", "--data.paths", corpus, "--out", run)
    assert code == 0, err
    seen = tmp_path / "seen.txt"
    seen.write_text(text(21, 300), encoding="utf-8")
    store = tmp_path / "ds"
    code, _, err = cli("datastore", "--run", run, "--out", store, "--data.paths", seen, "--key-dtype", "float32")
    assert code == 0, err
    assert "entries" in err and "tokens/s" in err
    return run, seen, store


def test_datastore_then_eval_and_generate_with_it(trained, tmp_path, cli):
    run, seen, store = trained
    meta = json.loads((store / "meta.json").read_text())
    assert meta["key"] == "ffn_input" and meta["size"] == meta["corpus"]["tokens"] - 1
    code, out, err = cli("eval", "--run", run, "--data.paths", seen)
    assert code == 0, err
    plain = scores(out)
    code, out, err = cli("eval", "--run", run, "--data.paths", seen, "--knn", store, "--knn-lambda", "0")
    assert code == 0, err
    zero = scores(out)
    assert zero["loss"] == pytest.approx(plain["loss"], abs=2e-4) and zero["lm_loss"] == zero["loss"]
    code, out, err = cli("eval", "--run", run, "--data.paths", seen, "--knn", store, "--knn-lambda", "0.25",
                         "--knn-k", "16")
    assert code == 0, err
    assert "kNN-LM" in err
    got = scores(out)
    assert got["lm_loss"] == pytest.approx(plain["loss"], abs=2e-4)
    assert got["perplexity"] < 0.5 * got["lm_perplexity"]          # the datastore holds this very text
    code, out, err = cli("eval", "--run", run, "--knn", store, "--knn-lambda", "0.25", "--knn-k", "16")
    assert code == 0, err
    assert "every window, of the run's validation split" in err and "compare loss with lm_loss" in err
    assert scores(out)["perplexity"] < scores(out)["lm_perplexity"]
    code, _, err = cli("eval", "--run", run, "--knn", store, "--knn-k", "16", "--batches", "1")
    assert code == 0 and "the first 1 batches of windows" in err, err
    code, out, err = cli("generate", "--run", run, "--knn", store, "--prompt", "the cat", "--max-new-tokens", "20",
                         "--temperature", "0")
    assert code == 0, err
    assert out.startswith("the cat") and len(out) > len("the cat")
    code, greedy, err = cli("generate", "--run", run, "--prompt", "the cat", "--max-new-tokens", "20",
                            "--temperature", "0")
    code, knn_zero, err = cli("generate", "--run", run, "--knn", store, "--knn-lambda", "0", "--prompt", "the cat",
                              "--max-new-tokens", "20", "--temperature", "0")
    assert code == 0, err
    assert knn_zero == greedy


def test_refusals_name_the_problem_and_change_nothing(trained, tmp_path, corpus, cli):
    run, seen, store = trained
    other = tmp_path / "other"
    code, _, err = cli("train", *SMALL, "--steps", "3", "--data.paths", corpus, "--out", other)
    assert code == 0, err
    code, _, err = cli("eval", "--run", other, "--data.paths", seen, "--knn", store)
    assert code == 2 and "another model" in err
    code, _, err = cli("generate", "--run", other, "--knn", store, "--max-new-tokens", "3")
    assert code == 2 and "another model" in err
    for flags, name in ((["--knn-lambda", "1.5"], "--knn-lambda must be in [0, 1]"),
                        (["--knn-k", "0"], "--knn-k must be an integer >= 1"),
                        (["--knn-temperature", "0"], "--knn-temperature must be a positive number")):
        code, _, err = cli("eval", "--run", run, "--knn", store, *flags)
        assert code == 2 and name in err, err
    code, _, err = cli("eval", "--run", run, "--knn-lambda", "0.5")
    assert code == 2 and "--knn DIR" in err
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    code, _, err = cli("datastore", "--run", run, "--out", store, "--data.paths", seen)
    assert code == 2 and "not empty" in err
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before
    code, _, err = cli("datastore", "--run", run, "--out", tmp_path / "bad", "--stride", "0")
    assert code == 2 and "--stride" in err and not (tmp_path / "bad").exists()
    code, _, err = cli("datastore", "--run", run, "--out", tmp_path / "bad", "--nprobe", "16")
    assert code == 2 and "--nprobe" in err and "--index ivf" in err and not (tmp_path / "bad").exists()
    keys = store / "keys.safetensors"
    keys.write_bytes(keys.read_bytes()[:-7])
    code, _, err = cli("eval", "--run", run, "--knn", store)
    assert code == 2 and "corrupted" in err and "keys.safetensors" in err


def test_datastore_defaults_to_the_training_split_with_an_approximate_index(trained, tmp_path, cli):
    pytest.importorskip("faiss")
    run, _, _ = trained
    store = tmp_path / "train-ds"
    code, _, err = cli("datastore", "--run", run, "--out", store, "--index", "hnsw", "--key", "final")
    assert code == 0, err
    meta = json.loads((store / "meta.json").read_text())
    assert meta["index"]["kind"] == "hnsw" and "index.safetensors" in meta["files"] and meta["key"] == "final"
    assert "training split" in meta["corpus"]["source"]
    code, out, err = cli("eval", "--run", run, "--knn", store, "--knn-k", "8")
    assert code == 0, err
    assert math.isfinite(scores(out)["loss"])
    code, _, err = cli("datastore", "--run", run, "--out", tmp_path / "ivf-ds", "--index", "ivf", "--nprobe", "16")
    assert code == 0, err
    assert json.loads((tmp_path / "ivf-ds" / "meta.json").read_text())["index"]["nprobe"] == 16
