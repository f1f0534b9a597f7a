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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polyformer.attention.knn_memory import clear_knn_memories
from polyformer.losses import AuxLosses, forward_with_losses, with_aux
from polyformer.memory.memories import Memories

from .. import record
from ..data import text
from ..harness import Budget, Optimiser, with_changes, build_model, parameters, run_rows, train
from ..variants import Variant

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
        if not getattr(self.model, "max_mem_len", 0):
            logits, self.aux = forward_with_losses(self.model, x)
            return logits
        logits, record = self.model(x, mems=self.mems, return_intermediates=True)
        self.mems, self.aux = record.mems, record.losses        # (a compressed memory's reconstruction loss)
        return logits


@torch.no_grad()
def evaluate(model: nn.Module, streams: Tensor, segment: int, warm: int) -> Tensor:
    """(segment,) mean loss at each position of a segment over every segment of the streams (b, N),
    after the first `warm` tokens (a multiple of the segment) were read unscored."""
    clear_knn_memories(model)           # a kNN memory (knn_memory_layers) holds the training text: start empty
    read = Reader(model)
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
                log: Callable[[str], None]) -> dict[str, Any]:
    n = s["segment"]
    model = build_model(v, num_tokens=text.VOCAB, max_seq_len=n, dim=s["dim"], depth=s["depth"],
                        heads=s["heads"], causal=True, seed=s["seed"])
    read = Reader(model)
    span = len(train_text) // s["batch"]
    offsets = torch.arange(s["batch"]) * span

    def step_loss(step: int) -> tuple[Tensor, int]:
        seg = text.slices(train_text, (offsets + step * n) % (len(train_text) - n - 1), n + 1)
        return with_aux(F.cross_entropy(read(seg[:, :-1]).transpose(1, 2), seg[:, 1:]), read.aux), seg[:, 1:].numel()

    trained = train(model, step_loss, budget, Optimiser(lr=s["lr"]), log=log)
    per_pos = evaluate(model, eval_streams, n, s["warm_tokens"])
    loss = float(per_pos.mean())
    log(f"  held-out loss {loss:.4f} nats/byte ({loss / 0.6931:.3f} bits/byte)")
    cmem = getattr(model, "compressive", None)        # states kept per layer: XL memory plus compressed memory
    kept = getattr(model, "max_mem_len", 0) + (cmem.max_cmem_len if cmem is not None else 0)
    return {"parameters": parameters(model), "memory_len": kept,
            "train": trained.to_json(), "loss": loss, "bits_per_byte": loss / 0.6931471805599453,
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
                              f"loss, positions >= {half}", "params", "tok/s (train)", "step memory MiB"], rows))


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
    return save_figure(fig, out_dir, "long_text.png")


def run(variants: list[Variant], *, budget: Budget | None, out_dir: Path, quick: bool, seed: int,
        log: Callable[[str], None], changes: dict[str, Any] | None = None) -> dict[str, Any]:
    budget = budget or Budget.parse("2k" if quick else DEFAULT_BUDGET)
    s = settings(quick, budget, seed, changes)
    train_text, eval_streams = documents(s)
    rows = run_rows("long_text", variants, lambda v: run_variant(v, s, budget, train_text, eval_streams, log), log)
    return record.save(out_dir, "long_text", s, rows, markdown, plot)
