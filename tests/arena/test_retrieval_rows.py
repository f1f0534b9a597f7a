"""Issue 21 in the arena: the long-text task's retrieval rows (benchmarks/arena/tasks/retrieval.py).

`knn_lm` trains as `no_memory` (the same weights, so the same table loss) and scores new-domain text: its
LM loss is the plain model's on the same windows and λ = 0 gives exactly that; `spalm` switches to SPALM
halfway, with a datastore of exactly the positions read before the switch, and reads the held-out text
through SPALM (not the plain XL model)."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from benchmarks.arena.__main__ import main
from benchmarks.arena.tasks import retrieval
from benchmarks.knn_lm import new_domain
from tests.helpers import tiny_lm


def test_knn_domain_lm_loss_is_the_plain_models_and_lambda_zero_equals_it(monkeypatch):
    monkeypatch.setattr(retrieval, "KNN_QUICK", {**retrieval.KNN_QUICK, "lambdas": (0.0, 0.5, 1.0)})
    model = tiny_lm(num_tokens=256, max_seq_len=16, seed=0, rotary_pos_emb=True)
    out = retrieval.knn_domain(model, quick=True, log=lambda _: None)
    score = new_domain()[1][-retrieval.KNN_QUICK["score_tokens"]:]
    total, count = 0.0, 0
    with torch.no_grad():                       # windows of max_seq_len + 1, each target scored once
        for start in range(0, len(score) - 1, 16):
            w = score[start: start + 17][None]
            loss = F.cross_entropy(model(w[:, :-1]).transpose(1, 2).double(), w[:, 1:], reduction="sum")
            total, count = total + float(loss), count + w.shape[1] - 1
    assert abs(out["lm_loss"] - total / count) < 1e-5
    assert out["knn_loss"]["0"] == out["lm_loss"]
    assert out["knn_loss"]["1"] != out["lm_loss"]
    assert out["entries"] == retrieval.KNN_QUICK["store_tokens"] - 1


def test_long_text_retrieval_rows(tmp_path):
    out = tmp_path / "arena"
    assert main(["--task", "long_text", "--quick", "--variants", "no_memory,knn_lm,xl,spalm", "--out-dir", str(out),
                 "--threads", "1"]) == 0
    rec = json.loads((out / "long_text.json").read_text())
    rows, s = rec["rows"], rec["settings"]
    assert rows["knn_lm"]["loss"] == rows["no_memory"]["loss"]          # the same keywords and seed
    assert set(rows["knn_lm"]["knn_lm"]["knn_loss"]) == {"0.25", "0.5"}
    store = rows["spalm"]["datastore"]
    switch = s["budget"]["tokens"] // (s["batch"] * s["segment"]) // 2
    assert store["switch_step"] == switch
    assert store["entries"] == s["batch"] * (switch * s["segment"] + 1) - 1     # every position read, once
    assert rows["spalm"]["loss"] != rows["xl"]["loss"]
    md = (out / "long_text.md").read_text()
    assert "## SPALM's datastore" in md and "## kNN-LM: domain adaptation" in md
