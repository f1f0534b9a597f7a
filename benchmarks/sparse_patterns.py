"""Sparse attention patterns against dense attention and against the libraries users would pick
instead: forward+backward time, inference time and the peak memory of each.

    python -m benchmarks.sparse_patterns [--quick] [--lengths 1024,2048,...] [--only dense,local,hf]
                                         [--repeats 5] [--redo] [--out-dir docs/sparse_patterns]

Comparisons (dim 512, 8 heads of 64, batch 1, float32, 2 threads), each at n in 1024 .. 16384:

- dense-layer / dense-model: polyformer causal dense (our fused CPU kernel) against
  `Decoder(..., attn_window=256)`, as one attention block (`custom_layers=("a",)`, timed with a floor: the
  block without its attention core) and as a 4-layer model (default layout, with feedforwards). Reported: the
  window's speed-up over dense, its memory ratio, and how its memory grows when n doubles (targets:
  >= 4x faster at 8k, growth <= 2.2x per doubling).
- local: polyformer's causal window-256 block against `local-attention`'s `LocalAttention(window_size=
  256, causal=True, look_backward=1, look_forward=0)` in a layer with the same projections and norms
  (`benchmarks/sparse_competitors.py`), without and with its rotary embedding.
- longformer / bigbird: bidirectional, against Hugging Face transformers' `LongformerAttention`
  (attention_window 512) and `BigBirdAttention` (block_sparse, block 64, 3 random blocks), with
  polyformer `Encoder` patterns matched to them (the correspondence is printed with the tables).

Method: every contender of a comparison is built once in this process; one point (comparison, n) times
all of them in alternating rounds (each round runs every contender's training step and inference
call once, starting one further along each round; one warmup round first) and takes medians; rounds in
which other processes used >= 0.25 CPUs are discarded and re-run after waiting up to --max-wait s
(`benchmarks/common.py`). Training step: forward with autograd and backward of a fixed output
gradient, the input requiring grad, parameter gradients set to None before (so they are allocated,
and counted, in the step). Inference: eval mode, `torch.no_grad()` forward. Memory: the peak tensor
bytes allocated during one call over those live at its start (`features.peak_step_bytes`, from
torch.profiler's allocator total). Which polyformer attention code ran (compiled CPU kernel, dense or
banded; ATen SDPA; block-sparse parts) is counted over one inference forward and printed. Ratios
are polyformer / competitor (< 1: polyformer is faster or smaller); for dense-vs-window, dense / window
speed-up and window / dense memory.

Every point is saved to `<out-dir>/sparse_patterns.json` (and the markdown twin rebuilt) as soon as it is
measured; a later run skips points already there unless --redo, so a long run can be resumed or
extended with more lengths. --quick: n 1024 and 2048, 2 repeats, output under /tmp unless --out-dir.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from .common import (Competitor, environment, log, markdown_table, measure_points, quiet_rounds, spread,
                     started)
from .features import peak_step_bytes
from .sparse_competitors import (BIGBIRD_NOTE, BLOCK, LOCAL_NOTE, WINDOW, Contender, dense_vs_window, hf,
                                 kernel_path, local_attention)

LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (1024, 2048)
GROUPS = {"dense": ("dense-layer", "dense-model"), "local": ("local",), "hf": ("longformer", "bigbird")}
COMPARISONS = tuple(c for group in GROUPS.values() for c in group)
MULTIPLE = {"dense-layer": 1, "dense-model": 1, "local": WINDOW, "longformer": 512, "bigbird": BLOCK}
PACKAGES = ["torch", "local-attention", "transformers"]
TARGET_SPEEDUP_8K, TARGET_GROWTH = 4.0, 2.2

TITLES = {
    "dense-layer": "polyformer dense vs causal window 256, one attention block",
    "dense-model": "polyformer dense vs causal window 256, 4-layer model",
    "local": "causal window 256: polyformer vs local-attention",
    "longformer": "bidirectional window: polyformer vs Hugging Face Longformer",
    "bigbird": "BigBird pattern: polyformer vs Hugging Face BigBird",
}
NOTES = {
    "dense-layer": "Dense: `Decoder(dim=512, depth=1, heads=8, custom_layers=(\"a\",))`; window: the same with "
                   f"attn_window={WINDOW} (each query sees its last {WINDOW} keys). Which kernel each ran is in the "
                   "last column of the measured table (the compiled CPU kernel takes dense attention and, where it "
                   "applies, the causal band; other patterns run `kernels/block_sparse.py`). Floor: the same block "
                   "without its attention core (norms, q/k/v and output projections, residual); a block's speed-up "
                   "is bounded by dense / floor, and the core's own is (dense - floor) / (window - floor).",
    "dense-model": "As above, `Decoder(dim=512, depth=4, heads=8[, attn_window=256])` with its feedforwards: "
                   "the attention's share of the step, and so the window's gain, is smaller.",
    "local": LOCAL_NOTE + " Both layers: pre-LayerNorm, bias-free q/k/v and output projections, residual, "
                          "final LayerNorm.",
    "longformer": "Both see |i - j| <= 256 (Longformer attention_window=512, polyformer attn_window=512), no "
                  "global tokens. HF: separate q/k/v projections with bias, post-LayerNorm output sublayer; "
                  "polyformer: pre-norm block and final norm.",
    "bigbird": BIGBIRD_NOTE,
}
# why polyformer can lose a comparison, printed next to a ratio > 1.05 (structural, from the two codes)
LOSS_REASONS = {
    "local": "polyformer's window ran on the block-sparse path (see its kernel column), which materialises "
             "scores and a float32 mask per group of 128 queries over 128 + 255 keys",
    "longformer": "polyformer's block-sparse path materialises, per group of 128 queries, scores over 128 + 512 "
                  "keys (HF: 513 per query) and a float32 additive mask of the same shape",
    "bigbird": "polyformer runs window, random and global parts separately (index gathers, a mask per part, a "
               "log-sum-exp merge); HF unrolls them into a few dense block matmuls",
    "dense": "at short n the window's fixed costs outweigh the keys it skips",
}
DENSE_MEMORY = ("Dense attention here never materialises the n x n scores (the compiled kernel works in "
                "tiles), so its memory is O(n) as well: the window cannot win memory by an n / w factor, only by "
                "the constant of what its kernel keeps.")


# --- measuring ------------------------------------------------------------------------------------

def steps(c: Contender, n: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(training step, inference call) of one contender on a fixed input of length n."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, n, 512, generator=g).requires_grad_()
    grad = torch.randn(1, n, 512, generator=g)
    params = list(c.module.parameters())

    def train() -> None:
        c.module.train()
        x.grad = None
        for p in params:
            p.grad = None
        c.call(x).backward(grad)

    def infer() -> Tensor:
        c.module.eval()
        with torch.no_grad():
            return c.call(x)
    return train, infer


def contenders(comparison: str, n: int, rotary_variant: bool) -> list[Contender]:
    if comparison in ("dense-layer", "dense-model"):
        return dense_vs_window(layer_only=comparison == "dense-layer")
    if comparison == "local":
        return local_attention(rotary_variant)
    return hf(n, comparison)


def measure(comparison: str, n: int, repeats: int, warmup: int, max_wait: float, rotary_variant: bool
            ) -> dict[str, Any]:
    cs = contenders(comparison, n, rotary_variant)
    comps: list[Competitor] = []
    info: dict[str, dict[str, Any]] = {}
    for c in cs:
        train, infer = steps(c, n)
        out = infer()
        if not torch.isfinite(out).all():
            raise SystemExit(f"{comparison} n={n}: {c.name} gives non-finite outputs")
        train()                                    # first call (index tables, lazy init) outside the peak
        info[c.name] = {"polyformer": c.polyformer, "params": c.params(), "kernel": kernel_path(c, infer),
                        "train_peak_bytes": peak_step_bytes(train), "infer_peak_bytes": peak_step_bytes(infer)}
        log(f"  {c.name}: step peak {info[c.name]['train_peak_bytes'] / 2 ** 20:.0f} MiB, "
            f"inference peak {info[c.name]['infer_peak_bytes'] / 2 ** 20:.0f} MiB")
        comps += [Competitor(f"{c.name} | train", train, n), Competitor(f"{c.name} | infer", infer, n)]
    log_ = quiet_rounds(comps, repeats, warmup, max_wait=max_wait)
    for comp in comps:
        name, part = comp.name.rsplit(" | ", 1)
        info[name][f"{part}_seconds"] = spread(comp.seconds)
        info[name][f"{part}_cpu_seconds"] = statistics.median(comp.cpu_seconds)
        info[name][f"{part}_all_seconds"] = comp.seconds
    return {"comparison": comparison, "n": n, "repeats": repeats, "contenders": info,
            "rounds": len(log_), "quiet_rounds": sum(x["quiet"] for x in log_),
            "others_cpus": [round(max(x["others_cpus"].values()), 2) for x in log_]}


# --- reporting ------------------------------------------------------------------------------------

def med(c: dict[str, Any], part: str) -> float:
    return c[f"{part}_seconds"]["median"]


def mib(b: float) -> str:
    return f"{b / 2 ** 20:.0f}"


def ratio_cell(r: float) -> str:
    return f"{r:.2f}"


def points_of(record: dict[str, Any], comparison: str) -> list[dict[str, Any]]:
    return sorted((p for p in record["points"].values() if p["comparison"] == comparison), key=lambda p: p["n"])


def measured_table(points: list[dict[str, Any]]) -> str:
    rows = []
    for p in points:
        for name, c in p["contenders"].items():
            rows.append([p["n"], name, f"{med(c, 'train') * 1e3:.0f}", f"{med(c, 'infer') * 1e3:.0f}",
                         mib(c["train_peak_bytes"]), mib(c["infer_peak_bytes"]),
                         f"{p['quiet_rounds']}/{p['rounds']}", c.get("kernel", "?")])
    return markdown_table(["n", "contender", "fwd+bwd ms", "inference ms", "step peak MiB", "inference peak MiB",
                           "quiet rounds", "polyformer attention calls (inference forward)"], rows)


def dense_tables(comparison: str, points: list[dict[str, Any]]) -> list[str]:
    rows, growth = [], []
    prev: dict[str, Any] | None = None
    for p in points:
        dense, window, *rest = list(p["contenders"].values())
        speed_t, speed_i = med(dense, "train") / med(window, "train"), med(dense, "infer") / med(window, "infer")
        mem_t = window["train_peak_bytes"] / dense["train_peak_bytes"]
        mem_i = window["infer_peak_bytes"] / dense["infer_peak_bytes"]
        verdict = "window faster" if speed_t >= 1 else f"window slower: {LOSS_REASONS['dense']}"
        if p["n"] == 8192:
            met = "met" if speed_t >= TARGET_SPEEDUP_8K else "MISSED"
            verdict += f"; target >= {TARGET_SPEEDUP_8K:.0f}x at 8k {met}"
        speed_c = dense["train_cpu_seconds"] / window["train_cpu_seconds"]
        core = "-"
        if rest:                                   # the floor: attention-core times with it subtracted
            floor = med(rest[0], "train")
            core = f"{(med(dense, 'train') - floor) / max(1e-9, med(window, 'train') - floor):.2f}x"
        rows.append([p["n"], f"{speed_t:.2f}x", f"{speed_c:.2f}x", f"{speed_i:.2f}x", core, ratio_cell(mem_t),
                     ratio_cell(mem_i), verdict])
        if prev is not None and p["n"] == 2 * prev["n"]:
            w0 = list(prev["contenders"].values())[1]
            g_t = window["train_peak_bytes"] / w0["train_peak_bytes"]
            g_i = window["infer_peak_bytes"] / w0["infer_peak_bytes"]
            growth.append([f"{prev['n']} -> {p['n']}", f"{g_t:.2f}x", f"{g_i:.2f}x",
                           f"{med(window, 'train') / med(w0, 'train'):.2f}x",
                           "met" if max(g_t, g_i) <= TARGET_GROWTH else "MISSED"])
        prev = p
    out = [markdown_table(["n", "speed-up fwd+bwd (dense / window)", "same, CPU time", "speed-up inference",
                           "attention core fwd+bwd speed-up (floor subtracted)", "memory ratio step (window / dense)",
                           "memory ratio inference", "verdict"], rows)]
    if growth:
        out += ["", "Window variant when n doubles:", "",
                markdown_table(["n", "step peak growth", "inference peak growth", "fwd+bwd time growth",
                                f"memory target <= {TARGET_GROWTH}x"], growth)]
    return out


def competitor_table(comparison: str, points: list[dict[str, Any]]) -> str:
    rows = []
    for p in points:
        ours = next(c for c in p["contenders"].values() if c["polyformer"])
        for name, c in p["contenders"].items():
            if c["polyformer"]:
                continue
            rt, ri = med(ours, "train") / med(c, "train"), med(ours, "infer") / med(c, "infer")
            rc = ours["train_cpu_seconds"] / c["train_cpu_seconds"]
            mt, mi = ours["train_peak_bytes"] / c["train_peak_bytes"], ours["infer_peak_bytes"] / c["infer_peak_bytes"]
            lost = [what for what, r in (("fwd+bwd time", rt), ("inference time", ri), ("step memory", mt),
                                         ("inference memory", mi)) if r > 1.05]
            verdict = "polyformer ahead" if not lost else f"loses on {', '.join(lost)}: {LOSS_REASONS[comparison]}"
            rows.append([p["n"], name, ratio_cell(rt), ratio_cell(rc), ratio_cell(ri), ratio_cell(mt),
                         ratio_cell(mi), verdict])
    return markdown_table(["n", "vs", "fwd+bwd time ratio", "fwd+bwd CPU-time ratio", "inference time ratio",
                           "step memory ratio",
                           "inference memory ratio", "verdict"], rows)


def markdown(record: dict[str, Any]) -> str:
    env = record["environment"]
    lines = ["# Sparse attention patterns", "",
             f"dim 512, 8 heads of 64, batch 1, float32, {env['torch_threads']} threads; medians of alternating "
             "rounds in one process (`benchmarks/sparse_patterns.py`, whose docstring gives the method). "
             "Ratios are polyformer / competitor: below 1 polyformer is faster or smaller. Memory: peak tensor "
             "bytes allocated during one call over those live at its start (torch.profiler). CPU time: this "
             "process's, the less disturbed measure when other processes share the cores. Where a point has no "
             "quiet round (see the last column of its measured table) its times come from disturbed rounds.", ""]
    for comparison in COMPARISONS:
        points = points_of(record, comparison)
        if not points:
            continue
        lines += [f"## {TITLES[comparison]}", "", NOTES[comparison], ""]
        if comparison.startswith("dense"):
            lines += [DENSE_MEMORY, ""]
        lines += dense_tables(comparison, points) if comparison.startswith("dense") else \
            [competitor_table(comparison, points)]
        lines += ["", measured_table(points), ""]
    pk = env["packages"]
    lines += [f"Measured {env['date']} on {env['cpu']} ({env['cpu_count']} cores), torch {pk.get('torch')}, "
              f"local-attention {pk.get('local-attention')}, transformers {pk.get('transformers')}, polyformer "
              f"commit {env['polyformer_commit']} (each point's own date and commit are in the JSON); quiet rounds: "
              "other processes used < 0.25 CPUs."]
    return "\n".join(lines)


# --- command line ---------------------------------------------------------------------------------

def selected(only: str | None) -> list[str]:
    if not only:
        return list(COMPARISONS)
    out: list[str] = []
    for word in only.split(","):
        word = word.strip()
        if word in GROUPS:
            out += GROUPS[word]
        elif word in COMPARISONS:
            out.append(word)
        else:
            raise SystemExit(f"--only: unknown {word!r}; pick from {', '.join([*GROUPS, *COMPARISONS])}")
    return [c for c in COMPARISONS if c in out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sparse_patterns", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n 1024 and 2048, 2 repeats, output under /tmp")
    parser.add_argument("--lengths", help="comma-separated sequence lengths (default 1024,...,16384)")
    parser.add_argument("--only", help="comma-separated groups (dense, local, hf) or comparisons "
                                       f"({', '.join(COMPARISONS)})")
    parser.add_argument("--repeats", type=int, help="undisturbed rounds per point (default 5; quick 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-wait", type=float, default=120.0,
                        help="seconds to wait for a quiet machine after a disturbed round (0: never)")
    parser.add_argument("--no-rotary-variant", action="store_true",
                        help="leave out local-attention with its rotary embedding")
    parser.add_argument("--redo", action="store_true", help="re-measure points already in the record")
    parser.add_argument("--out-dir", help="default docs/sparse_patterns (quick: /tmp/sparse_patterns_quick)")
    args = started(parser, argv)
    lengths = ([int(v) for v in args.lengths.split(",")] if args.lengths
               else list(QUICK_LENGTHS if args.quick else LENGTHS))
    repeats = args.repeats or (2 if args.quick else 5)
    out_dir = Path(args.out_dir or ("/tmp/sparse_patterns_quick" if args.quick else "docs/sparse_patterns"))
    points = []
    for comparison in selected(args.only):
        for n in lengths:
            if n % MULTIPLE[comparison]:
                log(f"{comparison}@{n}: skipped, n must be a multiple of {MULTIPLE[comparison]}")
                continue
            points.append((f"{comparison}@{n}", functools.partial(
                measure, comparison, n, repeats, args.warmup, args.max_wait, not args.no_rotary_variant)))
    # the environment is that of the code this process runs: taken before it measures
    return measure_points(out_dir / "sparse_patterns.json", points, redo=args.redo, repeats=repeats,
                          env=environment(PACKAGES), markdown=markdown)


if __name__ == "__main__":
    sys.exit(main())
