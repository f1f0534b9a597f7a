"""Length extrapolation (the shape of Press et al. 2022, arXiv:2108.12409, Figure 1): a small causal
byte-level LM trained at one length, its loss evaluated at 1x, 2x, 4x and 8x that length.

Every variant trains on the same windows of the built-in corpus (the standard library's sources) in
the same order, and is evaluated on the same held-out windows: at each evaluation length L the
windows start at the same offsets, so the first `train_len` positions are the same text at every L
and any change in the mean is what the positions past the training length add. A scheme that
cannot run past `max_seq_len` (learned absolute positions) is recorded so, not skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import record
from ..data import text
from ..harness import Budget, Optimiser, with_changes, build_model, parameters, run_rows, train
from ..variants import Variant

DESCRIPTION = "causal LM trained at length 128, loss at 1x-8x the training length (ALiBi Figure 1)"
DEFAULT_BUDGET = "1.5M"
FULL = dict(train_len=128, factors=(1, 2, 4, 8), dim=128, depth=4, heads=4, batch=16, eval_windows=32,
            eval_batch=8, lr=2e-3, bin_width=32)
QUICK = dict(train_len=16, factors=(1, 2, 4), dim=32, depth=2, heads=2, batch=4, eval_windows=4,
             eval_batch=4, lr=2e-3, bin_width=8)


def settings(quick: bool, budget: Budget, seed: int, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**with_changes(QUICK if quick else FULL, changes, "extrapolation"), "budget": budget.to_json(),
            "seed": seed, "vocab": text.VOCAB}


@torch.no_grad()
def position_losses(model: torch.nn.Module, windows: torch.Tensor, batch: int) -> torch.Tensor:
    """(L,) mean next-token loss at each position over the windows (b, L + 1)."""
    total = torch.zeros(windows.shape[1] - 1)
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.transpose(1, 2).float(), w[:, 1:], reduction="none")   # (b, L)
        total += loss.sum(0)
    return total / len(windows)


def run_variant(v: Variant, s: dict[str, Any], budget: Budget, log: Callable[[str], None]) -> dict[str, Any]:
    train_data, val = text.split_tokens()
    n = s["train_len"]
    model = build_model(v, num_tokens=text.VOCAB, max_seq_len=n, dim=s["dim"], depth=s["depth"],
                        heads=s["heads"], causal=True, seed=s["seed"])

    def step_loss(step: int) -> tuple[torch.Tensor, int]:
        w = text.windows(train_data, s["batch"], n + 1, seed=s["seed"] * 1_000_003 + step)
        logits = model(w[:, :-1])
        return F.cross_entropy(logits.transpose(1, 2), w[:, 1:]), w[:, 1:].numel()

    trained = train(model, step_loss, budget, Optimiser(lr=s["lr"]), log=log)
    longest = n * max(s["factors"])
    evals: dict[str, Any] = {}
    windows = text.spaced_windows(val, s["eval_windows"], longest + 1)
    for factor in s["factors"]:
        length = n * factor
        try:
            per_pos = position_losses(model, windows[:, :length + 1], s["eval_batch"])
        except ValueError as err:             # refused by name: longer than the model allows
            evals[str(factor)] = {"length": length, "status": f"cannot run: {err}"}
            log(f"  {length} tokens: cannot run ({err})")
            continue
        bins = per_pos.view(-1, s["bin_width"]).mean(1).tolist()
        evals[str(factor)] = {"length": length, "status": "ok", "loss": float(per_pos.mean()),
                              "loss_past_train": float(per_pos[n:].mean()) if length > n else None,
                              "loss_by_position": bins}
        log(f"  {length} tokens: loss {float(per_pos.mean()):.4f}")
    return {"parameters": parameters(model), "train": trained.to_json(), "eval": evals}


def markdown(rec: dict[str, Any]) -> str:
    s = rec["settings"]
    factors = [str(f) for f in s["factors"]]
    headers = (["variant", "params", "tok/s (train)", "step memory MiB"]
               + [f"loss @ {s['train_len'] * int(f)}" for f in factors]
               + ["8x / 1x" if "8" in factors else "last / 1x"])
    rows = []
    for name, r in rec["rows"].items():
        losses = [r["eval"][f].get("loss") for f in factors]
        first, last = losses[0], losses[-1]
        ratio = record.fmt(last / first) if first and last else "cannot run"
        rows.append([f"`{name}`", f"{r['parameters']:,}", f"{r['train']['tokens_per_s']:,.0f}",
                     record.mib(r["train"]["peak_mib"])]
                    + [record.fmt(x) if x is not None else "cannot run" for x in losses] + [ratio])
    from ...common import markdown_table

    return (f"# Extrapolation\n\n{DESCRIPTION}. Byte-level, dim {s['dim']}, depth {s['depth']}, {s['heads']} heads, "
            f"trained on {Budget(**s['budget']).describe()} (batch {s['batch']} x {s['train_len']}, AdamW, "
            f"lr {s['lr']}, warmup and cosine decay), seed {s['seed']}; evaluated on {s['eval_windows']} held-out "
            "windows of the validation files (the same text at every length: its first positions are the same "
            "tokens at every length). Loss in nats per byte, mean over all positions of the window.\n\n"
            + markdown_table(headers, rows))


def plot(rec: dict[str, Any], out_dir: Path) -> list[str]:
    from ...common import pyplot, save_figure

    plt = pyplot()
    s = rec["settings"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    longest = str(max(s["factors"]))
    for name, r in rec["rows"].items():
        ev = r["eval"]
        lengths = [ev[str(f)]["length"] for f in s["factors"] if ev[str(f)].get("loss") is not None]
        losses = [ev[str(f)]["loss"] for f in s["factors"] if ev[str(f)].get("loss") is not None]
        right.plot(lengths, losses, marker="o", label=name)
        best = max((f for f in s["factors"] if ev[str(f)].get("loss") is not None), default=None)
        if best is not None:
            bins = ev[str(best)]["loss_by_position"]
            xs = [(i + 0.5) * s["bin_width"] for i in range(len(bins))]
            left.plot(xs, bins, label=f"{name} (to {ev[str(best)]['length']})" if str(best) != longest else name)
    for ax in (left, right):
        ax.axvline(s["train_len"], color="grey", linestyle=":", linewidth=1)
        ax.set_ylabel("loss (nats / byte)")
    left.set_xlabel("position"); left.set_title("loss by position (longest length each can run)")
    right.set_xscale("log", base=2); right.set_xlabel("evaluation length"); right.set_title("mean loss by length")
    left.legend(fontsize=7); right.legend(fontsize=7)
    return save_figure(fig, out_dir, "extrapolation.png")


def run(variants: list[Variant], *, budget: Budget | None, out_dir: Path, quick: bool, seed: int,
        log: Callable[[str], None], changes: dict[str, Any] | None = None) -> dict[str, Any]:
    budget = budget or Budget.parse("2k" if quick else DEFAULT_BUDGET)
    s = settings(quick, budget, seed, changes)
    rows = run_rows("extrapolation", variants, lambda v: run_variant(v, s, budget, log), log)
    return record.save(out_dir, "extrapolation", s, rows, markdown, plot)
