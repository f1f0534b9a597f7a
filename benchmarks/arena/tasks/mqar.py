"""Multi-query associative recall (Arora et al. 2023, "Zoology", arXiv:2312.04927): key-value pairs,
then every key again; the model must answer each with its value. Accuracy by model width.

Zoology's finding: softmax attention solves MQAR at small width, while gated-convolution and
linear / kernel attention need far more width or fail. Every variant trains a 2-layer causal model
per width on the same examples in the same order, and is scored on the same held-out examples.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from polyformer.losses import forward_with_losses, with_aux

from .. import record
from ..compute import compute_used, describe
from ..data import mqar
from ..harness import Budget, Optimiser, with_changes, build_model, parameters, run_rows, train
from ..variants import Variant

DESCRIPTION = "multi-query associative recall: accuracy by width, 2-layer causal models (Zoology)"
DEFAULT_BUDGET = "12M"
# Zoology's defaults (zoology/config.py): 2 layers, 1 head, batch 32, lr 1e-3, vocabulary 256 at
# length 64, stopping once test accuracy reaches 99%; they train up to 100 epochs of 10k examples.
# Positions as Zoology's models have them: a learned vector per position added to the input, in place of
# each variant's rotary embedding, so that rows differ in their attention alone. With rotary, exact
# attention stays at 26-34% of queries at every width within the budget, while learned positions solve
# width 128 in 8.2M tokens (the first record of this task, `positions="own"`).
POSITIONS = ("learned", "own")
FULL = dict(seq_len=64, num_pairs=8, vocab=256, widths=(32, 64, 128), depth=2, heads=1, batch=32,
            train_examples=20_000, test_examples=1_000, lr=1e-3, solved=0.99, check_every=500,
            positions="learned")
QUICK = dict(seq_len=24, num_pairs=4, vocab=64, widths=(16, 32), depth=2, heads=1, batch=8,
             train_examples=64, test_examples=16, lr=1e-3, solved=0.99, check_every=10, positions="learned")


def settings(quick: bool, budget: Budget, seed: int, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    s = {**with_changes(QUICK if quick else FULL, changes, "mqar"), "budget": budget.to_json(), "seed": seed}
    if s["positions"] not in POSITIONS:
        raise ValueError(f"--set positions: expected one of {POSITIONS}, got {s['positions']!r}")
    return s


def positioned(v: Variant, positions: str) -> Variant:
    """The variant with learned absolute positions in place of its rotary embedding ("learned"), or as
    it is ("own")."""
    if positions == "own":
        return v
    layers = {k: x for k, x in v.layers.items() if k != "rotary_pos_emb"}
    return replace(v, layers=layers, wrapper={**v.wrapper, "use_abs_pos_emb": True})


@torch.no_grad()
def accuracy(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batch: int = 250
             ) -> tuple[float, float]:
    """(share of queries answered right, share of examples with every query right)."""
    right, asked, whole = 0, 0, 0
    for i in range(0, len(inputs), batch):
        x, y = inputs[i:i + batch], targets[i:i + batch]
        guess = model(x).argmax(-1)
        scored = y != -100
        hit = (guess == y) & scored
        right += int(hit.sum())
        asked += int(scored.sum())
        whole += int((hit.sum(1) == scored.sum(1)).sum())
    return right / asked, whole / len(inputs)


def run_width(v: Variant, s: dict[str, Any], width: int, budget: Budget, data: tuple[torch.Tensor, ...],
              log: Callable[[str], None]) -> dict[str, Any]:
    train_x, train_y, test_x, test_y = data
    model = build_model(positioned(v, s["positions"]), num_tokens=s["vocab"], max_seq_len=s["seq_len"], dim=width,
                        depth=s["depth"], heads=s["heads"], causal=True, seed=s["seed"])
    per_epoch = len(train_x) // s["batch"]

    @lru_cache(maxsize=1)
    def order(epoch: int) -> torch.Tensor:      # a fresh order each epoch, the same for every variant
        seed = s["seed"] if epoch == 0 else s["seed"] * 7919 + epoch
        return torch.randperm(len(train_x), generator=torch.Generator().manual_seed(seed))

    def step_loss(step: int) -> tuple[torch.Tensor, int]:
        epoch, i = divmod(step, per_epoch)
        pick = order(epoch)[i * s["batch"]:(i + 1) * s["batch"]]
        x, y = train_x[pick], train_y[pick]
        logits, aux = forward_with_losses(model, x)       # auxiliary terms: ACT's ponder cost, routing, ...
        return with_aux(F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100), aux), x.numel()

    trained = train(model, step_loss, budget, Optimiser(lr=s["lr"]), log=log, log_every=500,
                    done=lambda: accuracy(model, test_x, test_y)[0] >= s["solved"], check_every=s["check_every"])
    used = compute_used(model)          # ACT's steps of the last training forward (before evaluation's)
    acc, whole = accuracy(model, test_x, test_y)
    log(f"  width {width}: accuracy {acc:.3f} (all queries right in {whole:.1%} of examples)")
    return {"parameters": parameters(model), "train": trained.to_json(), "accuracy": acc, "all_right": whole,
            "compute": used}


def solved(tokens: int | None) -> str:
    return "not reached" if tokens is None else f"{tokens / 1e6:.1f}M"


def markdown(rec: dict[str, Any]) -> str:
    from ...common import markdown_table

    s = rec["settings"]
    widths = [str(w) for w in s["widths"]]
    rows = []
    for name, r in rec["rows"].items():
        by = r["widths"]
        rows.append([f"`{name}`"] + [record.fmt(by[w]["accuracy"]) for w in widths]
                    + [" / ".join(solved(by[w]["train"]["solved_at"]) for w in widths),
                       " / ".join(f"{by[w]['train']['tokens_per_s']:,.0f}" for w in widths),
                       " / ".join(record.mib(by[w]["train"]["peak_mib"]) for w in widths),
                       " / ".join(f"{by[w]['parameters']:,}" for w in widths)])
    headers = (["variant"] + [f"accuracy, width {w}" for w in widths]
               + [f"tokens to {s['solved']:.0%} by width", "tok/s by width", "step memory MiB by width",
                  "params by width"])
    return (f"# Associative recall (MQAR)\n\n{DESCRIPTION}. Sequences of {s['seq_len']} tokens: "
            f"{s['num_pairs']} key-value pairs, then every key again (vocabulary {s['vocab']}, keys and values "
            f"from separate halves); accuracy over the queries of {s['test_examples']} held-out examples. "
            + ("Learned absolute positions in every row (in place of rotary, as Zoology's models), "
               if s["positions"] == "learned" else "Each variant's own positions, ")
            + f"{s['depth']} layers, {s['heads']} heads, {s['train_examples']:,} training examples, "
            f"batch {s['batch']}, "
            f"{Budget(**s['budget']).describe()} per model at most, AdamW lr {s['lr']}, seed {s['seed']}; "
            "as in Zoology, "
            f"training stops once the held-out accuracy (checked every {s['check_every']} steps) reaches "
            f"{s['solved']:.0%}.\n\n"
            + markdown_table(headers, rows) + compute_section(rec))


def compute_section(rec: dict[str, Any]) -> str:
    """What ACT (or another adaptive mechanism) did at each width, for the rows that have one."""
    from ...common import markdown_table

    widths = [str(w) for w in rec["settings"]["widths"]]
    rows = [[f"`{name}`"] + [describe(r["widths"][w].get("compute")) for w in widths]
            for name, r in rec["rows"].items() if any(r["widths"][w].get("compute") for w in widths)]
    if not rows:
        return ""
    return ("\n\n## Compute actually used\n\nACT's steps of the last training forward, per position and per batch "
            "row (benchmarks/arena/compute.py).\n\n"
            + markdown_table(["variant"] + [f"width {w}" for w in widths], rows))


def plot(rec: dict[str, Any], out_dir: Path) -> list[str]:
    from ...common import pyplot, save_figure

    plt = pyplot()
    s = rec["settings"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rec["rows"].items():
        ax.plot(s["widths"], [r["widths"][str(w)]["accuracy"] for w in s["widths"]], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("model width (dim)")
    ax.set_ylabel("MQAR accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"MQAR, {s['num_pairs']} pairs in {s['seq_len']} tokens")
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir, "mqar.png")


def run(variants: list[Variant], *, budget: Budget | None, out_dir: Path, quick: bool, seed: int,
        log: Callable[[str], None], changes: dict[str, Any] | None = None) -> dict[str, Any]:
    budget = budget or Budget.parse("2k" if quick else DEFAULT_BUDGET)
    s = settings(quick, budget, seed, changes)
    shape = dict(seq_len=s["seq_len"], num_pairs=s["num_pairs"], vocab_size=s["vocab"])
    data = (*mqar.generate(s["train_examples"], seed, **shape), *mqar.generate(s["test_examples"], seed + 1, **shape))
    rows = run_rows("mqar", variants,
                    lambda v: {"widths": {str(w): run_width(v, s, w, budget, data, log) for w in s["widths"]}}, log)
    return record.save(out_dir, "mqar", s, rows, markdown, plot)
