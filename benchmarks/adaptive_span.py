"""Adaptive attention span (issue 22): time and peak memory of a training step against the spans the
heads have learned, showing that the cost follows the span (keys beyond it are never read).

    python -m benchmarks.adaptive_span [--quick] [--repeats 3] [--max-wait 30] [--out-dir docs/adaptive_span]

A Decoder stack (dim 256, 4 heads of 64, depth 2, ff_mult 4, rotary) on a (1, 4096, 256) float32
input that requires grad, 2 threads, `attn_adaptive_span=2048`, ramp 32; every head's span z set by
hand (the learned parameter, p = z / S) to 1024, 256 and 64: the kernel then reads w = z + R + 1 keys
back. Against it, the same stack with dense causal attention (our fused CPU kernel / SDPA), which
reads every earlier key. Training step: forward and backward of a fixed output gradient. Time:
alternating rounds (`common.quiet_rounds`), medians. Memory: peak tensor bytes allocated during one
step over those live at its start (`features.peak_step_bytes`). Expected: from span 1024 to 64 the
attention part shrinks ~10x, so the step time falls until the span-independent work (projections,
feedforward) dominates. --quick: n 1024, spans 256 / 64, one round, output under /tmp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from polyformer import Decoder
from polyformer.attention.kernels.adaptive_span import AdaptiveSpan

from .common import (Competitor, environment, finish_report, log, markdown_table, one_shot_parser, quiet_rounds,
                     spread, started)
from .features import peak_step_bytes
from .reversible import training_step

DIM, HEADS, DIM_HEAD, DEPTH, SEQ, MAX_SPAN, RAMP, SPANS = 256, 4, 64, 2, 4096, 2048, 32, (1024, 256, 64)


def build(span: int | None) -> torch.nn.Module:
    """The stack with every head's span set to `span` (None: dense causal attention)."""
    torch.manual_seed(0)
    keywords: dict[str, Any] = {} if span is None else dict(attn_adaptive_span=MAX_SPAN, attn_adaptive_span_ramp=RAMP)
    model = Decoder(dim=DIM, depth=DEPTH, heads=HEADS, attn_dim_head=DIM_HEAD, rotary_pos_emb=True, **keywords).train()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, AdaptiveSpan):
                m.fraction.fill_(span / MAX_SPAN)
    return model


def measure(seq: int, spans: tuple[int, ...], repeats: int, warmup: int, max_wait: float) -> dict[str, Any]:
    x = torch.randn(1, seq, DIM, generator=torch.Generator().manual_seed(0)).requires_grad_()
    grad = torch.randn(1, seq, DIM, generator=torch.Generator().manual_seed(1))
    rows: dict[str, dict[str, Any]] = {}
    competitors = []
    for span in (*spans, None):
        label = "dense causal" if span is None else f"adaptive span {span}"
        model = build(span)
        step = training_step(model, x, grad, keep_grads=True)
        step()                                                           # gradients exist from here on
        kernel = next((m for m in model.modules() if isinstance(m, AdaptiveSpan)), None)
        rows[label] = {"span": span, "keys_back": kernel.reach() if kernel is not None else seq,
                       "peak_bytes": peak_step_bytes(step)}
        log(f"{label}: reads {rows[label]['keys_back']} keys back, peak {rows[label]['peak_bytes'] / 2**20:.1f} MiB")
        competitors.append(Competitor(label, step, 1))
    quiet_rounds(competitors, repeats, warmup=warmup, max_wait=max_wait)
    for c in competitors:
        rows[c.name]["seconds"] = spread(c.seconds)
    return rows


def markdown(record: dict[str, Any]) -> str:
    rows = record["rows"]
    dense = rows["dense causal"]["seconds"]["median"]
    table = markdown_table(
        ["attention", "keys read back (w)", "step (s, median)", "step / dense", "peak step memory (MiB)"],
        [[name, str(r["keys_back"]), f"{r['seconds']['median']:.3f}", f"{r['seconds']['median'] / dense:.2f}x",
          f"{r['peak_bytes'] / 2**20:.1f}"] for name, r in rows.items()])
    env = record["environment"]
    return "\n\n".join([
        "# Adaptive attention span: training step against the learned span",
        f"Decoder stack, dim {DIM}, depth {DEPTH}, {HEADS} heads of {DIM_HEAD}, ff_mult 4, rotary, batch 1, "
        f"n {record['seq']}, float32, `attn_adaptive_span={MAX_SPAN}`, ramp {RAMP}, every head's span set by hand; "
        f"{env['torch_threads']} threads; {env['cpu']}; torch {env['packages'].get('torch')}; {env['date']}, "
        f"commit {env['polyformer_commit']}. Method: `benchmarks/adaptive_span.py` (docstring).",
        table,
        "The kernel reads only the keys within the largest current span (w = floor(max z + R) + 1), in groups "
        "of queries against the keys within reach, so attention costs O(n w): the step shrinks with the span "
        "until the projections and the feedforward, which do not depend on it, dominate. Dense causal attention "
        "reads every earlier key (our fused CPU kernel).",
    ])


def main(argv: list[str] | None = None) -> int:
    args = started(one_shot_parser("python -m benchmarks.adaptive_span", __doc__.split("\n\n")[0]), argv)
    seq, spans, repeats, warmup = (1024, (256, 64), 1, 0) if args.quick else (SEQ, SPANS, args.repeats, 1)
    out_dir = args.out_dir or (Path("/tmp/adaptive_span") if args.quick else Path("docs/adaptive_span"))
    rows = measure(seq, spans, repeats, warmup, args.max_wait)
    record = {"seq": seq, "rows": rows, "environment": environment(["torch"])}
    return finish_report(out_dir / "adaptive_span.json", record, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
