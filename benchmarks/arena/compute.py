"""The compute a model's adaptive mechanisms actually used (issue 22): ACT's steps, adaptive span's learned
spans and the keys its kernel reads, early exit's layers per generated token; each beside the most it could
use, so an arena table can set a variant's time per training step against the work it did.

    row["compute"] = compute_used(model)          # after train(): ACT's numbers are its last forward's

Read from what the model exposes: `act.Halting.last` (the last forward's halting: steps N per position),
`AdaptiveSpan.spans()` / `reach()` (the spans z = S clamp(p, 0, 1) now, and w, the keys a query reads), and an
`ExitGeneration` (generate/early_exit.py) for early exit, whose training forward runs every layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from polyformer.act import Halting
from polyformer.attention.kernels.adaptive_span import AdaptiveSpan
from polyformer.early_exit import policy_of
from polyformer.generate.early_exit import ExitGeneration


def compute_used(model: nn.Module, generation: ExitGeneration | None = None) -> dict[str, Any]:
    """{"act": ..., "span": ..., "exit": ...} for the mechanisms `model` has (an empty dict: none).

    act: of the last forward (after `train`, the last training step's batch): `mean_steps` ACT's N per position,
    `row_steps` the unit applications per batch row (a row runs until its last position halts: the work done),
    `max_steps`. span: `spans` (layer, head) z in positions, `mean_span`, `reach` per layer (the keys a query
    reads, floor(max z + R) + 1), `max_span` S, `ramp` R, `fraction` mean reach / (S + R). exit: `depth`,
    `exits`, `threshold` (exit_threshold), and with `generation` its `mean_layers` and `fraction` of the depth."""
    out: dict[str, Any] = {}
    halting = [m for m in model.modules() if isinstance(m, Halting) and m.last is not None]
    if halting:
        steps = torch.cat([m.last.steps.float().flatten() for m in halting])
        rows = torch.cat([m.last.steps.float().amax(-1) for m in halting])
        most = max(m.steps for m in halting)
        out["act"] = {"mean_steps": float(steps.mean()), "row_steps": float(rows.mean()), "max_steps": most,
                      "fraction": float(rows.mean()) / most}
    kernels = [m for m in model.modules() if isinstance(m, AdaptiveSpan)]
    if kernels:
        with torch.no_grad():
            spans = [k.spans().tolist() for k in kernels]
            reach = [k.reach() for k in kernels]
        top = kernels[0].max_span + kernels[0].ramp
        out["span"] = {"spans": spans, "mean_span": sum(map(sum, spans)) / sum(map(len, spans)), "reach": reach,
                       "max_span": kernels[0].max_span, "ramp": kernels[0].ramp,
                       "fraction": sum(reach) / len(reach) / top}
    found = policy_of(model)
    if found is not None:
        policy = found[1]
        out["exit"] = {"depth": policy.depth, "exits": list(policy.exits), "threshold": policy.threshold}
        if generation is not None:
            out["exit"].update(mean_layers=generation.mean_layers, fraction=generation.mean_layers / policy.depth)
    return out


def describe(compute: dict[str, Any] | None) -> str:
    """One table cell: the compute used against the most, e.g. 'ACT 2.31 of 4 steps per position (3.00 per row)'."""
    parts = []
    compute = compute or {}
    if "act" in compute:
        a = compute["act"]
        parts.append(f"ACT {a['mean_steps']:.2f} of {a['max_steps']} steps per position ({a['row_steps']:.2f} per row)")
    if "span" in compute:
        s = compute["span"]
        reads = sum(s["reach"]) / len(s["reach"])
        parts.append(f"mean span {s['mean_span']:.1f} of {s['max_span']}; reads {reads:.0f} "
                     f"of {s['max_span'] + s['ramp']} keys")
    if "exit" in compute and "mean_layers" in compute["exit"]:
        e = compute["exit"]
        parts.append(f"{e['mean_layers']:.2f} of {e['depth']} layers per generated token at threshold "
                     f"{e['threshold']:g}")
    return "; ".join(parts) or "no adaptive mechanism: all of it"


NOTE = ("Compute used: what the adaptive mechanisms did (benchmarks/arena/compute.py): ACT's steps of the last "
        "training forward, per position and per batch row (a row runs until its last position halts); the mean learned "
        "span and the keys the adaptive-span kernel reads per query (its band); early exit's layers per generated "
        "token (greedy, held-out prompts; its training runs every layer). Time per step is the training's.")


def markdown(rec: dict[str, Any], reference: Callable[[dict[str, Any]], str]) -> str:
    """A table section: time per training step against the compute used, for the rows whose models have
    adaptive mechanisms, each timed against the row `reference(row)` names (one without them, the same
    memory), which the table shows too ('' when no row has any)."""
    from ..common import markdown_table

    def ms(r: dict[str, Any]) -> float:                  # steps after the first, as tokens per second counts
        t = r["train"]
        return t["tokens"] / max(1, t["steps"]) / t["tokens_per_s"] * 1e3

    every = rec["rows"]
    rows = {k: r for k, r in every.items() if r.get("compute")}
    if not rows:
        return ""
    refs = {k: reference(r) for k, r in rows.items()}
    shown = {**{name: every[name] for name in refs.values() if name in every and name not in rows}, **rows}
    table = [[f"`{k}`", f"{ms(r):.1f}",
              f"{ms(r) / ms(every[refs[k]]):.2f} (`{refs[k]}`)" if refs.get(k) in every else "–",
              describe(r.get("compute"))] for k, r in shown.items()]
    return ("\n\n## Compute actually used\n\n" + NOTE + "\n\n"
            + markdown_table(["variant", "ms / training step", "time vs reference", "compute used"], table))


def plot_spans(rec: dict[str, Any], out_dir: Path, name: str) -> list[str]:
    """The learned span of every head of every layer, each layer's heads sorted by span, one panel per row that
    has spans (the adaptive-span paper's figure of spans per head and layer, on its log scale)."""
    from ..common import pyplot, save_figure

    rows = {k: r["compute"]["span"] for k, r in rec["rows"].items() if "span" in (r.get("compute") or {})}
    if not rows:
        return []
    plt = pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(6.5 * len(rows), 4), squeeze=False)
    for ax, (variant, s) in zip(axes[0], rows.items()):
        heads = len(s["spans"][0])
        width = 0.8 / heads
        for layer, spans in enumerate(s["spans"]):
            ax.bar([layer + 1 + (h - (heads - 1) / 2) * width for h in range(heads)], sorted(spans), width,
                   color=[plt.cm.viridis(h / max(1, heads - 1)) for h in range(heads)])
        ax.axhline(s["max_span"], color="grey", lw=0.8, ls="--", label=f"maximum span S = {s['max_span']}")
        ax.set_yscale("symlog", linthresh=1)
        ax.set_xticks(range(1, len(s["spans"]) + 1))
        ax.set_xlabel("layer (its heads sorted by span)")
        ax.set_ylabel("learned span z (positions)")
        ax.set_title(f"{variant}: mean span {s['mean_span']:.1f} of {s['max_span']}")
        ax.legend(fontsize=8)
    return save_figure(fig, out_dir, name)
