"""The markdown twin of `benchmarks/linear_attention.py`'s JSON record: per section, what was measured,
the ratios and whether each target is met."""

from __future__ import annotations

from typing import Any

from .common import markdown_table
from .linear_competitors import BY_NAME, VERSUS

TARGET_GROWTH, TARGET_DECODE = 2.2, 1.2
DIRECTIONS = {"causal": "causal mixers, each in a Decoder, against dense causal attention",
              "bidirectional": "bidirectional mixers, each in an Encoder, against dense bidirectional attention"}


def med(c: dict[str, Any], part: str) -> float | None:
    s = c.get(f"{part}_seconds")
    return None if s is None else s["median"]


def ms(c: dict[str, Any], part: str) -> str:
    t = med(c, part)
    return "failed" if t is None else f"{t * 1e3:.0f}"


def mib(c: dict[str, Any], key: str, digits: int = 0) -> str:
    return "-" if c.get(key) is None else f"{c[key] / 2 ** 20:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def cell(r: float | None, suffix: str = "") -> str:
    return "-" if r is None else f"{r:.2f}{suffix}"


def points_of(record: dict[str, Any], section: str, group: str) -> list[dict[str, Any]]:
    return sorted((p for p in record["points"].values() if p["section"] == section and p["group"] == group),
                  key=lambda p: p["n"])


def errors_cell(c: dict[str, Any]) -> str:
    return "; ".join(f"{part}: {msg}" for part, msg in c.get("errors", {}).items()) or ""


def measured_table(points: list[dict[str, Any]]) -> str:
    rows = []
    for p in points:
        for name, c in p["contenders"].items():
            rows.append([p["n"], name, ms(c, "train"), ms(c, "infer"), mib(c, "train_peak_bytes"),
                         mib(c, "infer_peak_bytes"), f"{p['quiet_rounds']}/{p['rounds']}", kernel(c),
                         errors_cell(c)])
    return markdown_table(["n", "contender", "fwd+bwd ms", "inference ms", "step peak MiB", "inference peak MiB",
                           "quiet rounds", "polyformer attention calls (inference)", "errors"], rows)


def kernel(c: dict[str, Any]) -> str:
    label = c.get("kernel", "-")
    return "no dense attention call" if label == "other" else label


def notes(points: list[dict[str, Any]]) -> list[str]:
    """Each contender's keywords (or build), once."""
    seen: dict[str, str] = {}
    for p in points:
        seen.update({name: c["note"] for name, c in p["contenders"].items() if c.get("note")})
    return [f"- {name}: {note}" for name, note in seen.items()]


def skipped(points: list[dict[str, Any]]) -> list[str]:
    notes: dict[str, str] = {}
    for p in points:
        notes.update(p.get("skipped", {}))
    return [f"- not measured: {name}: {why}" for name, why in notes.items()]


# --- 1. scaling -----------------------------------------------------------------------------------

def growth_table(points: list[dict[str, Any]]) -> str:
    rows = []
    for prev, p in zip(points, points[1:]):
        if p["n"] != 2 * prev["n"]:
            continue
        for name, c in p["contenders"].items():
            c0 = prev["contenders"].get(name)
            if c0 is None:
                continue
            g = [ratio(med(c, "train"), med(c0, "train")), ratio(med(c, "infer"), med(c0, "infer")),
                 ratio(c.get("train_peak_bytes"), c0.get("train_peak_bytes")),
                 ratio(c.get("infer_peak_bytes"), c0.get("infer_peak_bytes"))]
            known = [x for x in g if x is not None]
            verdict = "-" if not known else ("met" if max(known) <= TARGET_GROWTH else "MISSED")
            if name.startswith("polyformer dense"):
                verdict = "(reference: quadratic time expected)"
            rows.append([name, f"{prev['n']} -> {p['n']}", *(cell(x, "x") for x in g), verdict])
    rows.sort(key=lambda r: (r[0], int(r[1].split()[0])))
    return markdown_table(["contender", "n", "fwd+bwd time", "inference time", "step memory", "inference memory",
                           f"all <= {TARGET_GROWTH}x"], rows)


def crossover_table(points: list[dict[str, Any]]) -> str:
    """Per mixer: its speed-up over dense (dense / mixer) at each n, and the smallest n where it is faster."""
    if not points:
        return ""
    dense_name = next(iter(points[0]["contenders"]))
    names = [n for p in points for n in p["contenders"] if n != dense_name]
    names = list(dict.fromkeys(names))
    rows = []
    for name in names:
        row: list[Any] = [name]
        cross = {"train": None, "infer": None}
        for p in points:
            d, c = p["contenders"].get(dense_name, {}), p["contenders"].get(name)
            if c is None:
                row.append("-")
                continue
            sp = {part: ratio(med(d, part), med(c, part)) for part in ("train", "infer")}
            for part, s in sp.items():
                if s is not None and s > 1 and cross[part] is None:
                    cross[part] = p["n"]
            mem = ratio(c.get("train_peak_bytes"), d.get("train_peak_bytes"))
            row.append(f"{cell(sp['train'], 'x')} / {cell(sp['infer'], 'x')} / {cell(mem)}")
        top = points[-1]["n"]
        row += [cross["train"] or f"none <= {top}", cross["infer"] or f"none <= {top}"]
        rows.append(row)
    return markdown_table(["mixer", *(f"n={p['n']}: speed-up fwd+bwd / inference / step memory ratio"
                                      for p in points), "crossover fwd+bwd", "crossover inference"], rows)


def scaling_section(record: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for group, title in DIRECTIONS.items():
        points = points_of(record, "scaling", group)
        if not points:
            continue
        lines += [f"### {title}", "", *notes(points), *skipped(points), ""]
        if any(name == "polyformer gau" for p in points for name in p["contenders"]):
            lines += ["A gau unit is attention and feedforward in one (e = 2 x 512 gated hidden units), so its block "
                      "does more work than the others' attention-only block.", ""]
        lines += ["Growth when n doubles (target: time and memory <= 2.2x per doubling):", "",
                  growth_table(points), "",
                  "Against dense (speed-up = dense time / mixer time, > 1: the mixer is faster; memory ratio = "
                  "mixer / dense step peak). Crossover: the smallest measured n where the mixer is faster.", "",
                  crossover_table(points), "", "Measured:", "", measured_table(points), ""]
    return lines


# --- 2. versus the packages -----------------------------------------------------------------------

def versus_table(points: list[dict[str, Any]]) -> str:
    rows = []
    for p in points:
        ours = next((c for c in p["contenders"].values() if c["polyformer"]), None)
        for name, c in p["contenders"].items():
            if c["polyformer"] or ours is None:
                continue
            rt, ri = ratio(med(ours, "train"), med(c, "train")), ratio(med(ours, "infer"), med(c, "infer"))
            rc = ratio(ours.get("train_cpu_seconds"), c.get("train_cpu_seconds"))
            mt = ratio(ours.get("train_peak_bytes"), c.get("train_peak_bytes"))
            mi = ratio(ours.get("infer_peak_bytes"), c.get("infer_peak_bytes"))
            lost = [what for what, r in (("fwd+bwd time", rt), ("inference time", ri), ("step memory", mt),
                                         ("inference memory", mi)) if r is not None and r > 1.05]
            verdict = "polyformer ahead or level" if not lost else f"polyformer loses on {', '.join(lost)}"
            failed = [f"{who} {part} failed" for who, x in (("polyformer", ours), ("package", c))
                      for part in x.get("errors", {})]
            if failed:
                verdict += " (" + ", ".join(failed) + ")"
            rows.append([p["n"], name, cell(rt), cell(rc), cell(ri), cell(mt), cell(mi), verdict])
    return markdown_table(["n", "vs", "fwd+bwd time ratio", "fwd+bwd CPU-time ratio", "inference time ratio",
                           "step memory ratio", "inference memory ratio", "verdict (> 1.05 counts as a loss)"], rows)


def versus_section(record: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for which, v in VERSUS.items():
        points = points_of(record, "versus", which)
        if not points:
            continue
        direction = "causal" if v.causal else "bidirectional"
        lines += [f"### polyformer {v.ours} vs {v.label} ({direction})", "", v.note, "", *skipped(points), ""]
        measured = [p for p in points if p["contenders"]]
        if measured:
            lines += [versus_table(measured), "", measured_table(measured), ""]
    return lines


# --- 3. decode ------------------------------------------------------------------------------------

def decode_section(record: dict[str, Any]) -> list[str]:
    points = points_of(record, "decode", "decode")
    if not points:
        return []
    rows = []
    for p in points:
        for name, c in p["contenders"].items():
            t = med(c, "step")
            rows.append([p["n"], name, "failed" if t is None else f"{t * 1e3:.2f}", mib(c, "state_bytes"),
                         "-" if c.get("recurrent_bytes") is None else f"{c['recurrent_bytes'] / 2 ** 10:.0f}",
                         mib(c, "keys_bytes"), mib(c, "step_peak_bytes", 2), f"{p['quiet_rounds']}/{p['rounds']}",
                         errors_cell(c)])
    lines = ["Measured (ms per token: single-token cached steps, each followed by `state.rollback(1)`; the peak "
             "is that of one timed call, transient bytes over the state):", "",
             markdown_table(["context", "model", "ms / token", "state MiB (nbytes)", "recurrent part KiB",
                             "keys / values MiB", f"peak MiB of {points[0].get('step_tokens', 8)} steps",
                             "quiet rounds", "errors"], rows), ""]
    first, last = points[0], points[-1]
    target = []
    for name in first["contenders"]:
        c0, c1 = first["contenders"][name], last["contenders"].get(name, {})
        growth = ratio(med(c1, "step"), med(c0, "step"))
        rec = [p["contenders"].get(name, {}).get("recurrent_bytes") for p in points]
        constant = "-" if not any(rec) else ("constant" if len(set(rec)) == 1 else "GROWS")
        vs_dense = []
        for p in points:
            d, c = p["contenders"].get("dense (KV cache)", {}), p["contenders"].get(name, {})
            vs_dense.append(f"{p['n']}: {cell(ratio(med(c, 'step'), med(d, 'step')))} / "
                            f"{cell(ratio(c.get('state_bytes'), d.get('state_bytes')), '')}")
        met = "-" if growth is None or name.startswith("dense") else \
            ("met" if growth <= TARGET_DECODE else "MISSED")
        target.append([name, cell(growth, "x"), met, constant, "; ".join(vs_dense)])
    lines += [f"Per-token time at context {last['n']} over {first['n']} (target <= {TARGET_DECODE}x for the "
              "recurrent states), whether the recurrent summaries' bytes stay constant, and the ratio to dense "
              "decoding at each context (time / state bytes; < 1: smaller or faster than the KV cache):", "",
              markdown_table(["model", f"time {last['n']} / {first['n']}", f"<= {TARGET_DECODE}x",
                              "recurrent bytes", "vs dense (time / state bytes)"], target), "",
              "nbytes() of a recurrent state still counts positions and padding flags (9 bytes per position of "
              "max_len); its summaries are kept for the latest position and the one before (history=1, for "
              "rollback).", ""]
    return lines


def markdown(record: dict[str, Any]) -> str:
    env = record["environment"]
    lines = ["# Linear-time attention", "",
             f"dim 512, 8 heads of 64, batch 1, float32, {env['torch_threads']} threads; medians of alternating "
             "rounds in one process (`benchmarks/linear_attention.py`, whose docstring gives the method). Memory: "
             "peak tensor bytes allocated during one call over those live at its start (torch.profiler). Ratios "
             "against packages are polyformer / package: below 1 polyformer is faster or smaller. Where a point "
             "has no quiet round (see its quiet-rounds column) its times come from disturbed rounds.", "",
             "Mixers: " + ", ".join(f"{m.name} ({m.paper})" for m in BY_NAME.values()) + ".", "",
             "## 1. Scaling with length", ""]
    lines += scaling_section(record)
    lines += ["## 2. Against the PyPI packages", ""] + versus_section(record)
    lines += ["## 3. Decoding with a recurrent state", "",
              "`TransformerWrapper(num_tokens=256, attn_layers=Decoder(dim=512, depth=4, heads=8, ...))` with "
              "random weights; dense keeps keys and values, the kernels a fixed-size summary per block.", ""]
    lines += decode_section(record)
    pk = env["packages"]
    lines += [f"Measured {env['date']} on {env['cpu']} ({env['cpu_count']} cores), address space capped at "
              f"{env.get('mem_limit_gib', 0):.0f} GiB, " + ", ".join(f"{k} {v}" for k, v in pk.items())
              + f", polyformer commit {env['polyformer_commit']} (each point's own date and commit are in the "
              "JSON); quiet rounds: other processes used < 0.25 CPUs."]
    return "\n".join(lines)
