"""Long-text language modelling with memories (Transformer-XL, arXiv:1901.02860, and the memories of
later issues): byte-level loss on the corpus's longest files, read in segments of 128 tokens, with
a memory of earlier segments against the same model without memory, at equal parameters.

The documents are the corpus's longest training files. The last `eval_tokens` bytes of the
`eval_files` longest are held out and never trained on; evaluation reads each of those tails from
its start, segment by segment, with the memory carried along, after the memory has read the
`warm_tokens` bytes before the tail (so both models see the same text, and a memory starts full).
Training reads `batch` streams through the rest of the documents (each stream starts at its own
offset; a step is one segment of every stream, and the memory carries from step to step, gradients
stopping at the segment boundary). The loss by position inside a segment shows where a memory
helps: the first positions of a segment have no context without one. (The validation split's
longest files are English documentation and character-map tables, unlike the code the model
trains on; a held-out stretch of the same documents measures what a memory adds, not the shift.)

Adaptive computation (issue 22): a model with exit layers trains on CALM's weighted average of its exit
layers' losses (`polyformer.early_exit.next_token_loss`) instead of the cross-entropy, and after training gets
its speed / quality curve (exit_curve.py, a section of the table and long_text_exit.png); every row records
the compute its adaptive mechanisms used (compute.py: learned spans, plotted in long_text_spans.png, ACT's
steps, early exit's layers per generated token) beside its time per training step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polyformer.attention.knn_memory import clear_knn_memories
from polyformer.early_exit import next_token_loss, policy_of
from polyformer.losses import AuxLosses, forward_with_losses, with_aux
from polyformer.memory.infini_carry import carries
from polyformer.memory.memories import Memories

from .. import compute, record
from ..data import text
from ..harness import Budget, Optimiser, with_changes, build_model, parameters, run_rows, train
from ..variants import Variant
from . import exit_curve, retrieval

DESCRIPTION = "byte LM on the longest files in segments of 128, with memories against none (Transformer-XL)"
DEFAULT_BUDGET = "2M"
FULL = dict(segment=128, dim=128, depth=4, heads=4, batch=8, train_files=48, eval_files=8,
            eval_tokens=16_384, warm_tokens=256, lr=2e-3, bin_width=16)
QUICK = dict(segment=16, dim=32, depth=2, heads=2, batch=2, train_files=4, eval_files=2,
             eval_tokens=128, warm_tokens=32, lr=2e-3, bin_width=4)


def settings(quick: bool, budget: Budget, seed: int, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**with_changes(QUICK if quick else FULL, changes, "long_text"), "budget": budget.to_json(),
            "seed": seed, "vocab": text.VOCAB}


class Reader:
    """Segment-by-segment forward over (b, N) streams, carrying the model's memories if it has any."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.mems: list[Tensor] | Memories | None = None     # a Memories record with a compressed memory
        self.aux = AuxLosses()          # the last call's auxiliary losses (an MoE's balance loss), added in training

    def __call__(self, x: Tensor) -> Tensor:
        if not carries(self.model):     # an XL memory (max_mem_len) or an Infini one (memory/infini_carry.py)
            logits, self.aux = forward_with_losses(self.model, x)
            return logits
        logits, record = self.model(x, mems=self.mems, return_intermediates=True)
        self.mems, self.aux = record.mems, record.losses        # (a compressed memory's reconstruction loss)
        return logits


@torch.no_grad()
def evaluate(model: nn.Module, streams: Tensor, segment: int, warm: int,
             read: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """(segment,) mean loss at each position of a segment over every segment of the streams (b, N),
    after the first `warm` tokens (a multiple of the segment) were read unscored; `read` gives a
    segment's logits (default: `Reader(model)`)."""
    clear_knn_memories(model)           # a kNN memory (knn_memory_layers) holds the training text: start empty
    read = read if read is not None else Reader(model)
    for start in range(0, warm, segment):
        read(streams[:, start:start + segment])
    total, count = torch.zeros(segment), 0
    for start in range(warm, streams.shape[1] - 1 - segment + 1, segment):
        seg = streams[:, start:start + segment + 1]
        loss = F.cross_entropy(read(seg[:, :-1]).transpose(1, 2).float(), seg[:, 1:], reduction="none")
        total += loss.sum(0)
        count += loss.shape[0]
    return total / count


def documents(s: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """(training text (N,), held-out streams (eval_files, warm + eval_tokens + 1)): the held-out
    streams are the last bytes of the longest documents, cut from the training text."""
    files = [t for _, t in text.longest_files(text.corpus_split()[0], s["train_files"])]
    held = s["warm_tokens"] + s["eval_tokens"] + 1
    if min(len(t) for t in files[:s["eval_files"]]) < 2 * held:
        raise ValueError(f"long_text: a document is too short to hold out {held} tokens")
    streams = torch.stack([t[-held:] for t in files[:s["eval_files"]]])
    kept = [t[:-held] if i < s["eval_files"] else t for i, t in enumerate(files)]
    return torch.cat(kept), streams


def run_variant(v: Variant, s: dict[str, Any], budget: Budget, train_text: Tensor, eval_streams: Tensor,
                log: Callable[[str], None], quick: bool = False) -> dict[str, Any]:
    n = s["segment"]
    if v.runner == "spalm":
        row = retrieval.spalm_row(v, s, budget, train_text, eval_streams, evaluate, log, quick)
        held_out = scored(row.pop("per_pos"), s, log)
        return {**row, **held_out, "compute": {}, "objective": "cross-entropy"}
    model = build_model(v, num_tokens=text.VOCAB, max_seq_len=n, dim=s["dim"], depth=s["depth"],
                        heads=s["heads"], causal=True, seed=s["seed"])
    read = Reader(model)
    span = len(train_text) // s["batch"]
    offsets = torch.arange(s["batch"]) * span

    exits = policy_of(model) is not None

    def step_loss(step: int) -> tuple[Tensor, int]:
        seg = text.slices(train_text, (offsets + step * n) % (len(train_text) - n - 1), n + 1)
        weighted = next_token_loss(model, seg[:, :-1], seg[:, 1:]) if exits else None     # CALM's, with aux losses
        if weighted is not None:
            return weighted[0], seg[:, 1:].numel()
        return with_aux(F.cross_entropy(read(seg[:, :-1]).transpose(1, 2), seg[:, 1:]), read.aux), seg[:, 1:].numel()

    trained = train(model, step_loss, budget, Optimiser(lr=s["lr"]), log=log)
    used = compute.compute_used(model)           # ACT's numbers: the last training forward's
    per_pos = evaluate(model, eval_streams, n, s["warm_tokens"])
    cmem = getattr(model, "compressive", None)        # states kept per layer: XL memory plus compressed memory
    kept = getattr(model, "max_mem_len", 0) + (cmem.max_cmem_len if cmem is not None else 0)
    extra: dict[str, Any] = {}
    if exits:
        curve, gens = exit_curve.measure(model, eval_streams, n, s["warm_tokens"],
                                         exit_curve.QUICK if quick else exit_curve.FULL, log)
        used = {**used, "exit": compute.compute_used(model, gens.get(policy_of(model)[1].threshold))["exit"]}
        extra["exit_curve"] = curve
    if v.runner == "knn_lm":
        extra["knn_lm"] = retrieval.knn_domain(model, quick, log)
    return {"parameters": parameters(model), "memory_len": kept, "compute": used,
            "objective": "CALM weighted exit loss" if exits else "cross-entropy", **extra,
            "train": trained.to_json(), **scored(per_pos, s, log)}


def scored(per_pos: Tensor, s: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """A row's held-out figures from its mean loss by position (segment,)."""
    loss = float(per_pos.mean())
    log(f"  held-out loss {loss:.4f} nats/byte ({loss / 0.6931:.3f} bits/byte)")
    return {"loss": loss, "bits_per_byte": loss / 0.6931471805599453,
            "loss_by_position": per_pos.view(-1, s["bin_width"]).mean(1).tolist()}


def markdown(rec: dict[str, Any]) -> str:
    from ...common import markdown_table

    s = rec["settings"]
    half = s["segment"] // 2
    rows = []
    for name, r in rec["rows"].items():
        bins = r["loss_by_position"]
        k = len(bins) // 2
        rows.append([f"`{name}`", str(r["memory_len"]), record.fmt(r["loss"]), record.fmt(r["bits_per_byte"]),
                     record.fmt(sum(bins[:k]) / k), record.fmt(sum(bins[k:]) / (len(bins) - k)),
                     f"{r['parameters']:,}", f"{r['train']['tokens_per_s']:,.0f}", record.mib(r["train"]["peak_mib"])])
    return (f"# Long text\n\n{DESCRIPTION}. Byte-level, dim {s['dim']}, depth {s['depth']}, {s['heads']} heads; "
            f"training reads {s['batch']} streams through the {s['train_files']} longest training files "
            f"({Budget(**s['budget']).describe()}, AdamW lr {s['lr']}); the loss is measured on the last "
            f"{s['eval_tokens']:,} bytes of each of the {s['eval_files']} longest, held out from training, "
            f"segment by segment, after the {s['warm_tokens']} bytes before them were read unscored (nats per "
            f"byte).\n\n"
            + markdown_table(["variant", "memory", "loss", "bits/byte", f"loss, positions < {half}",
                              f"loss, positions >= {half}", "params", "tok/s (train)", "step memory MiB"], rows)
            + objectives(rec) + compute.markdown(rec, reference) + exit_curve.markdown(rec) + retrieval.markdown(rec))


def reference(row: dict[str, Any]) -> str:
    """The row without adaptive mechanisms to time a row against: the same memory (XL's 128 states or none)."""
    return "xl" if row.get("memory_len") else "no_memory"


def objectives(rec: dict[str, Any]) -> str:
    """A note naming the rows trained on another loss than the cross-entropy ('' when none is)."""
    other = {k: r["objective"] for k, r in rec["rows"].items()
             if r.get("objective", "cross-entropy") != "cross-entropy"}
    if not other:
        return ""
    return ("\n\nTrained on another loss than the next-token cross-entropy: "
            + ", ".join(f"`{k}` ({o})" for k, o in other.items())
            + "; their loss above is still the full model's (every layer), in evaluation mode.")


def plot(rec: dict[str, Any], out_dir: Path) -> list[str]:
    from ...common import pyplot, save_figure

    plt = pyplot()
    s = rec["settings"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in rec["rows"].items():
        bins = r["loss_by_position"]
        ax.plot([(i + 0.5) * s["bin_width"] for i in range(len(bins))], bins, marker=".", label=name)
    ax.set_xlabel("position inside the segment")
    ax.set_ylabel("held-out loss (nats / byte)")
    ax.set_title(f"segments of {s['segment']}")
    ax.legend(fontsize=8)
    return (save_figure(fig, out_dir, "long_text.png") + exit_curve.plot(rec, out_dir, "long_text_exit.png")
            + compute.plot_spans(rec, out_dir, "long_text_spans.png"))


def run(variants: list[Variant], *, budget: Budget | None, out_dir: Path, quick: bool, seed: int,
        log: Callable[[str], None], changes: dict[str, Any] | None = None) -> dict[str, Any]:
    budget = budget or Budget.parse("2k" if quick else DEFAULT_BUDGET)
    s = settings(quick, budget, seed, changes)
    train_text, eval_streams = documents(s)
    rows = run_rows("long_text", variants,
                    lambda v: run_variant(v, s, budget, train_text, eval_streams, log, quick), log)
    return record.save(out_dir, "long_text", s, rows, markdown, plot)
