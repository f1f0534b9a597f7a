"""Reversible layers (issue 18): peak training memory and step time of a reversible stack against the
ordinary one, at two depths.

    python -m benchmarks.reversible [--quick] [--repeats 3] [--max-wait 30] [--out-dir docs/reversible]

A Decoder stack (dim 256, 4 heads of 64, ff_mult 4) on a (1, 1024, 256) float32 input that requires
grad, 2 threads; depths 2 and 12; ordinary, reversible (`reversible=True`) and reversible with
`ff_chunks=4`. Training step: forward and backward of a fixed output gradient.

Memory: peak tensor bytes allocated during one step over those live at its start
(`features.peak_step_bytes`, as `benchmarks/linear_attention.py` measures), two ways: "activations",
with the parameters' gradients kept from an earlier step (zeroed in place, so they are live at the
start and the peak is what the step holds for its backward plus its work space), and "with gradients",
the gradients set to None first, so they are allocated within the step and count (they grow with depth
in any model, reversible or not). Time: alternating rounds (`common.quiet_rounds`: rounds disturbed by
other processes are run again), medians. Targets (issue 18): reversible 12-layer / 2-layer peak <= 1.3x,
the ordinary stack about 6x; the recomputation costs time (about 1.5-2x the ordinary step).
--quick: n 256, one round without warmup, output under /tmp unless --out-dir.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from polyformer import Decoder

from .common import (Competitor, environment, finish_report, log, markdown_table, one_shot_parser, quiet_rounds,
                     spread, started)
from .features import peak_step_bytes

DIM, HEADS, DIM_HEAD, SEQ, DEPTHS = 256, 4, 64, 1024, (2, 12)
STACKS: dict[str, dict[str, Any]] = {
    "ordinary": {},
    "reversible": {"reversible": True},
    "reversible, ff_chunks=4": {"reversible": True, "ff_chunks": 4},
}


def build(depth: int, keywords: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(0)
    return Decoder(dim=DIM, depth=depth, heads=HEADS, attn_dim_head=DIM_HEAD, **keywords).train()


def training_step(model: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, keep_grads: bool) -> Callable[[], None]:
    """One forward and backward; gradients zeroed in place (keep_grads) or set to None first."""
    def run() -> None:
        if keep_grads:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        else:
            model.zero_grad(set_to_none=True)
        x.grad = None
        model(x).backward(grad)

    return run


def measure(seq: int, repeats: int, warmup: int, max_wait: float) -> dict[str, Any]:
    x = torch.randn(1, seq, DIM, generator=torch.Generator().manual_seed(0)).requires_grad_()
    grad = torch.randn(1, seq, DIM, generator=torch.Generator().manual_seed(1))
    rows: dict[str, dict[str, Any]] = {}
    competitors = []
    for name, keywords in STACKS.items():
        for depth in DEPTHS:
            label = f"{name}, depth {depth}"
            model = build(depth, keywords)
            training_step(model, x, grad, keep_grads=False)()            # gradients exist from here on
            rows[label] = {
                "stack": name, "depth": depth,
                "activations_bytes": peak_step_bytes(training_step(model, x, grad, keep_grads=True)),
                "with_gradients_bytes": peak_step_bytes(training_step(model, x, grad, keep_grads=False)),
            }
            log(f"{label}: {rows[label]['activations_bytes'] / 2**20:.1f} MiB activations, "
                f"{rows[label]['with_gradients_bytes'] / 2**20:.1f} MiB with gradients")
            competitors.append(Competitor(label, training_step(model, x, grad, keep_grads=True), 1))
    quiet_rounds(competitors, repeats, warmup=warmup, max_wait=max_wait)
    for c in competitors:
        rows[c.name]["seconds"] = spread(c.seconds)
    return rows


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per stack: deep / shallow peaks, and each depth's step time over the ordinary stack's."""
    out: dict[str, dict[str, float]] = {}
    lo, hi = DEPTHS
    for name in STACKS:
        a, b = rows[f"{name}, depth {lo}"], rows[f"{name}, depth {hi}"]
        entry = {f"activations {hi}/{lo}": b["activations_bytes"] / a["activations_bytes"],
                 f"with gradients {hi}/{lo}": b["with_gradients_bytes"] / a["with_gradients_bytes"]}
        for depth in DEPTHS:
            mine = rows[f"{name}, depth {depth}"]["seconds"]["median"]
            entry[f"time / ordinary, depth {depth}"] = mine / rows[f"ordinary, depth {depth}"]["seconds"]["median"]
        out[name] = entry
    return out


def markdown(record: dict[str, Any]) -> str:
    rows, found = record["rows"], record["ratios"]
    lo, hi = DEPTHS
    table = markdown_table(
        ["stack", "depth", "peak, activations (MiB)", "peak, with gradients (MiB)", "step (s, median)"],
        [[r["stack"], r["depth"], f"{r['activations_bytes'] / 2**20:.1f}", f"{r['with_gradients_bytes'] / 2**20:.1f}",
          f"{r['seconds']['median']:.3f}"] for r in rows.values()])
    summary = markdown_table(
        ["stack", f"activations {hi}/{lo}", f"with gradients {hi}/{lo}", f"time / ordinary, depth {lo}",
         f"time / ordinary, depth {hi}"],
        [[name, *(f"{v:.2f}x" for v in entry.values())] for name, entry in found.items()])
    env = record["environment"]
    return "\n\n".join([
        "# Reversible layers: training memory and time",
        f"Decoder stack, dim {DIM}, {HEADS} heads of {DIM_HEAD}, ff_mult 4, batch 1, n {record['seq']}, float32, "
        f"{env['torch_threads']} threads; {env['cpu']}; torch {env['packages'].get('torch')}; "
        f"{env['date']}, commit {env['polyformer_commit']}. Method: `benchmarks/reversible.py` (docstring).",
        table, summary,
        "Targets (issue 18): reversible 12-layer / 2-layer peak <= 1.3x, the ordinary stack about 6x. "
        "'activations' keeps the parameters' gradients from an earlier step (the step's own memory); "
        "'with gradients' allocates them within the step: they grow with depth in every model.",
    ])


def main(argv: list[str] | None = None) -> int:
    args = started(one_shot_parser("python -m benchmarks.reversible", __doc__.split("\n\n")[0]), argv)
    seq, repeats, warmup = (256, 1, 0) if args.quick else (SEQ, args.repeats, 1)
    out_dir = args.out_dir or (Path("/tmp/reversible") if args.quick else Path("docs/reversible"))
    rows = measure(seq, repeats, warmup, args.max_wait)
    record = {"seq": seq, "rows": rows, "ratios": ratios(rows), "environment": environment(["torch"])}
    return finish_report(out_dir / "reversible.json", record, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
