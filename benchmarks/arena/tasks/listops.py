"""ListOps (Nangia & Bowman 2018), the Long Range Arena task (Tay et al. 2020, arXiv:2011.04006):
nested MAX / MIN / MED / SM expressions over digits, generated locally with the published grammar;
the model reads the whole expression and classifies its value (ten classes).

A bidirectional stack read at its first position (right padding: always a real token, the outermost
operator), as LRA's CLS pooling, then a linear classifier. Every variant
trains on the same examples in the same order (batches of similar lengths, so padding stays small)
and is scored on the same held-out examples. LRA reports accuracies of 35-38% for every efficient
variant and the vanilla transformer at 2k tokens; the task needs hierarchical long-range structure.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polyformer.losses import AuxLosses, forward_with_losses, with_aux

from .. import compute, record
from ..compute import compute_used
from ..data import listops
from ..harness import Budget, Optimiser, with_changes, build_model, parameters, run_rows, train
from ..variants import Variant

DESCRIPTION = "ListOps (LRA): classify nested MAX/MIN/MED/SM expressions, accuracy after a fixed budget"
DEFAULT_BUDGET = "3M"
# LRA's lengths are 500-2000 (`--set min_len=500 --set max_len=2000`); on two CPU cores that gives
# 400 steps of 3M tokens, and top-k attention's explicit path runs at 1.1k tokens/s there (46 minutes),
# so the default here is 100-500 tokens: three times the steps for the same budget.
# The classifier reads the first position's output ("first": LRA's CLS pooling; the first token is the
# outermost operator) or the mean over the real tokens ("mean"). At the default budget the dense row
# reached 0.352 with "first" and 0.170 with "mean" (majority class 0.163; lr 3e-4 did not help "mean").
POOLS = ("first", "mean")
FULL = dict(min_len=100, max_len=500, max_depth=10, max_args=10, dim=64, depth=4, heads=4, batch=8,
            train_examples=20_000, test_examples=400, lr=1e-3, pool="first")
QUICK = dict(min_len=8, max_len=40, max_depth=4, max_args=4, dim=32, depth=2, heads=2, batch=4,
             train_examples=32, test_examples=16, lr=1e-3, pool="first")


class Classifier(nn.Module):
    """The variant's encoder, its first position's output or its mean over the real tokens (`pool`), then
    one linear layer; the encoder's auxiliary losses (ponder cost, routing commitment, span L1) are kept
    for the training loss."""

    def __init__(self, encoder: nn.Module, dim: int, classes: int, pool: str = "first"):
        super().__init__()
        if pool not in POOLS:
            raise ValueError(f"pool: expected one of {POOLS}, got {pool!r}")
        self.encoder, self.pool = encoder, pool
        self.head = nn.Linear(dim, classes)
        self.aux = AuxLosses()          # the last call's auxiliary losses (ACT's ponder cost, ...), added in training

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h, self.aux = forward_with_losses(self.encoder, ids, mask=mask, return_embeddings=True)   # (b, n, dim)
        if self.pool == "first":
            return self.head(h[:, 0])
        keep = mask[..., None].to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))                # (b, classes)


def settings(quick: bool, budget: Budget, seed: int, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**with_changes(QUICK if quick else FULL, changes, "listops"), "budget": budget.to_json(), "seed": seed}


def batches_by_length(examples: list, batch: int, seed: int, whole: bool = False) -> list[list[int]]:
    """Indices in batches of similar lengths, the batches in an order drawn from `seed`; a last,
    smaller batch only when `whole` (evaluation sees every example)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    end = len(order) if whole else len(order) - batch + 1
    groups = [order[i:i + batch] for i in range(0, end, batch)]
    perm = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
    return [groups[i] for i in perm]


@torch.no_grad()
def accuracy(model: Classifier, examples: list, batch: int) -> float:
    right = 0
    for group in batches_by_length(examples, batch, 0, whole=True):
        ids, mask, labels = listops.batch([examples[i] for i in group])
        right += int((model(ids, mask).argmax(-1) == labels).sum())
    return right / len(examples)


def run_variant(v: Variant, s: dict[str, Any], budget: Budget, train_set: list, test_set: list,
                log: Callable[[str], None]) -> dict[str, Any]:
    if v.min_len > s["min_len"]:
        raise ValueError(f"variant {v.name!r} takes inputs of at least {v.min_len} tokens; this run's shortest "
                         f"is {s['min_len']} (--set min_len={v.min_len})")
    encoder = build_model(v, num_tokens=len(listops.VOCAB), max_seq_len=s["max_len"], dim=s["dim"],
                          depth=s["depth"], heads=s["heads"], causal=False, seed=s["seed"])
    model = Classifier(encoder, s["dim"], listops.NUM_CLASSES, s["pool"])
    @lru_cache(maxsize=1)
    def groups(epoch: int) -> list[list[int]]:  # a fresh batch order each epoch, the same for every variant
        return batches_by_length(train_set, s["batch"], s["seed"] if epoch == 0 else s["seed"] * 7919 + epoch)

    per_epoch = len(groups(0))

    def step_loss(step: int) -> tuple[Tensor, int]:
        epoch, i = divmod(step, per_epoch)
        ids, mask, labels = listops.batch([train_set[j] for j in groups(epoch)[i]])
        return with_aux(F.cross_entropy(model(ids, mask), labels), model.aux), int(mask.sum())

    trained = train(model, step_loss, budget, Optimiser(lr=s["lr"]), log=log, log_every=50)
    used = compute_used(model)          # ACT's steps of the last training forward (evaluation overwrites them)
    acc = accuracy(model, test_set, s["batch"])
    log(f"  accuracy {acc:.3f}")
    return {"parameters": parameters(model), "train": trained.to_json(), "accuracy": acc, "compute": used}


def markdown(rec: dict[str, Any]) -> str:
    from ...common import markdown_table

    s = rec["settings"]
    rows = [[f"`{name}`", record.fmt(r["accuracy"]), f"{r['parameters']:,}", f"{r['train']['tokens_per_s']:,.0f}",
             record.mib(r["train"]["peak_mib"]), f"{r['train']['steps']:,}",
             record.fmt(r["train"]["final_loss"])] for name, r in rec["rows"].items()]
    return (f"# ListOps\n\n{DESCRIPTION}. Expressions of {s['min_len']}-{s['max_len']} tokens (depth up to "
            f"{s['max_depth']}, up to {s['max_args']} arguments), {s['train_examples']:,} training and "
            f"{s['test_examples']} held-out examples; majority class: {rec.get('majority', float('nan')):.3f}; "
            f"the training set's most common answer per outermost operator (no model reads more): "
            f"{rec.get('operator_majority', float('nan')):.3f}. "
            f"Encoder dim {s['dim']}, depth {s['depth']}, {s['heads']} heads, "
            + ("the first position's output (the outermost operator; LRA's CLS pooling)" if s["pool"] == "first"
               else "mean-pooled over the real tokens")
            + f" into a linear classifier, batch {s['batch']}, "
            f"{Budget(**s['budget']).describe()} (real tokens), AdamW lr {s['lr']}, seed {s['seed']}.\n\n"
            + markdown_table(["variant", "accuracy", "params", "tok/s (train)", "step memory MiB", "steps",
                              "final train loss"], rows)
            + compute.markdown(rec, lambda r: "dense"))


def plot(rec: dict[str, Any], out_dir: Path) -> list[str]:
    from ...common import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = list(rec["rows"])
    left.barh(names, [rec["rows"][n]["accuracy"] for n in names])
    left.axvline(rec.get("majority", 0), color="grey", linestyle=":", label="majority class")
    left.axvline(rec.get("operator_majority", 0), color="grey", linestyle="--", label="majority per operator")
    left.set_xlabel("accuracy"); left.legend(fontsize=7)
    for n in names:
        steps, losses = zip(*rec["rows"][n]["train"]["losses"]) if rec["rows"][n]["train"]["losses"] else ((), ())
        right.plot(steps, losses, label=n)
    right.set_xlabel("step"); right.set_ylabel("train loss"); right.legend(fontsize=7)
    return save_figure(fig, out_dir, "listops.png")


def run(variants: list[Variant], *, budget: Budget | None, out_dir: Path, quick: bool, seed: int,
        log: Callable[[str], None], changes: dict[str, Any] | None = None) -> dict[str, Any]:
    budget = budget or Budget.parse("2k" if quick else DEFAULT_BUDGET)
    s = settings(quick, budget, seed, changes)
    shape = dict(min_len=s["min_len"], max_len=s["max_len"], max_depth=s["max_depth"], max_args=s["max_args"])
    train_set = listops.generate(s["train_examples"], seed, **shape)
    test_set = listops.generate(s["test_examples"], seed + 1, **shape)
    labels = torch.tensor([label for _, label in test_set])
    rows = run_rows("listops", variants, lambda v: run_variant(v, s, budget, train_set, test_set, log), log)
    majority = float(torch.bincount(labels, minlength=listops.NUM_CLASSES).max()) / len(labels)
    return record.save(out_dir, "listops", s, rows, markdown, plot,
                       extra={"majority": majority, "operator_majority": operator_majority(train_set, test_set)})


def operator_majority(train_set: list, test_set: list) -> float:
    """Held-out accuracy of answering each expression with the training set's most common answer for its
    outermost operator: what a model that reads only the first token can reach."""
    answers: dict[str, list[int]] = {}
    for tokens, label in train_set:
        answers.setdefault(tokens[0], []).append(label)
    best = {op: max(set(found), key=found.count) for op, found in answers.items()}
    return sum(best.get(tokens[0]) == label for tokens, label in test_set) / len(test_set)
