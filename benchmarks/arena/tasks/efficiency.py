"""Long-range efficiency, in the shape of Table 2 of the Long Range Arena paper (Tay et al. 2020,
arXiv:2011.04006): forward + backward time and peak memory of one layer and of a 4-layer stack, at
1k to 16k tokens, for every attention variant, as speed-up and memory ratio against "dense".

Each variant's layer stack alone (`build_layers`, bidirectional as in LRA unless CAUSAL) takes a
random (1, n, 512) float32 input that requires grad; a step is `stack(x).sum().backward()`. Every
(variant, depth, length) runs in a fresh process (`efficiency_worker.py`), so no run's memory
inflates another's peak and an oversize one fails under its RLIMIT_AS cap ("oom"), after which its
longer lengths are not tried. Each round runs every measurement once, the variants of each (depth,
length) in a rotated order, so that drift in the machine's speed falls on all alike. Time is the
median over rounds; peak memory, the resident high-water mark a worker's steps added over its
baseline, is the largest over rounds.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from ...common import QUIET, markdown_table, pyplot, rotated, save_figure, wait_for_quiet
from .. import record as rec
from ..harness import Budget, with_changes
from ..variants import Variant, variant
from .efficiency_worker import PRIMER

DESCRIPTION = "LRA Table 2: forward + backward time and peak memory of 1 and 4 layers, 1k-16k tokens, vs dense"
DEFAULT_BUDGET: str | None = None     # fixed work: every variant times the same steps

BASELINE = "dense"
LENGTHS = (1024, 2048, 4096, 8192, 16384)
DEPTHS = (1, 4)
DIM, HEADS = 512, 8
CAUSAL = False        # LRA's efficiency table is of bidirectional (encoder) attention
ROUNDS = 2
WARMUP, REPEATS = 1, 1  # steps per worker; the rounds give the repeats
THREADS = 2
LIMIT_GIB = 12.0      # each worker's address space, of this 24 GiB machine
TIMEOUT = 1800        # seconds per worker
RETRIES = 2           # a measurement other processes disturbed is run again (not in quick mode)
QUICK = dict(lengths=(128, 256), depths=(1, 2), dim=64, heads=4, rounds=1, retries=0)
ROOT = Path(__file__).resolve().parents[3]


def cannot_run(v: Variant) -> str | None:
    """Why this task cannot measure `v`, or None."""
    if v.causal_only and not CAUSAL:
        return "cannot run: needs a causal stack; this task is bidirectional (CAUSAL = False)"
    if v.encoder_only and CAUSAL:
        return "cannot run: needs a bidirectional stack; this task is causal (CAUSAL = True)"
    if v.wrapper:   # the task times the layer stack alone; wrapper keywords would silently not apply
        return f"cannot run: its keywords {sorted(v.wrapper)} go on TransformerWrapper, not the layer stack"
    return None


def run_worker(name: str, depth: int, length: int, s: dict[str, Any], seed: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.arena.tasks.efficiency_worker", "--variant", name,
           "--depth", str(depth), "--length", str(length), "--repeats", str(REPEATS), "--warmup", str(WARMUP),
           "--threads", str(s["threads"]), "--limit-gib", str(s["limit_gib"]), "--dim", str(s["dim"]),
           "--heads", str(s["heads"]), "--seed", str(seed)] + (["--causal"] if s["causal"] else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": f"error: over the {TIMEOUT} s timeout"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = " | ".join((proc.stderr or "").strip().splitlines()[-3:])[:300]
    # SIGKILL is the kernel's OOM killer (the cap should have caught it first); other deaths are errors
    if proc.returncode == -9:
        return {"status": "oom", "error": f"killed by signal 9 {tail}"}
    return {"status": f"error: exit {proc.returncode}: {tail}"}


def measure(name: str, depth: int, length: int, s: dict[str, Any], seed: int,
            log: Callable[[str], None]) -> dict[str, Any]:
    """`run_worker`, again (after waiting for quiet) while other processes took over QUIET CPUs during
    its timed step: with 2 threads on 2 shared cores, one busy core stalls every parallel region."""
    out, attempts = run_worker(name, depth, length, s, seed), 1
    while out["status"] == "ok" and (out.get("others_cpus") or 0.0) >= QUIET and attempts <= s["retries"]:
        log(f"  {name}, {depth} layer(s), {length}: others used {out['others_cpus']:.2f} CPUs; waiting for quiet")
        wait_for_quiet()
        out, attempts = run_worker(name, depth, length, s, seed), attempts + 1
    return {**out, "attempts": attempts}


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from its rounds: any failing round makes the cell fail (a borderline fit is not a fit)."""
    bad = [r["status"] for r in rounds if r["status"] != "ok"]
    if bad:
        return {"status": bad[0], "seconds": None, "peak_mib": None, "rounds": rounds}
    peaks = [r["peak_mib"] for r in rounds if r.get("peak_mib") is not None]
    return {"status": "ok", "seconds": statistics.median(r["seconds"] for r in rounds),
            "peak_mib": max(peaks) if peaks else None, "rounds": rounds}


def baseline_of(results: dict[str, Any]) -> dict[str, Any]:
    """The dense cells a row's ratios are taken against: status, seconds and peak of each (depth, length)."""
    return {depth: {length: {k: cell[k] for k in ("status", "seconds", "peak_mib") if k in cell}
                    for length, cell in cells.items()} for depth, cells in results.items()}


def pin_baselines(rows: dict[str, Any], measured: dict[str, Any], old: dict[str, Any] | None) -> None:
    """Give every row the dense cells of its own run (dense is re-measured in every run): the rows just
    `measured` this run's, rows kept from the `old` record (before rows carried theirs) the old dense row's,
    so a row's ratios never mix two runs (or two processors)."""
    now = baseline_of(measured.get(BASELINE, {}).get("results", {}))
    before = baseline_of((old or {}).get("rows", {}).get(BASELINE, {}).get("results", {}))
    for name, row in rows.items():
        if name != BASELINE:
            row.setdefault("baseline", now if name in measured else before)


def add_ratios(rows: dict[str, Any]) -> None:
    """Speed-up (dense time / variant time) and memory ratio (variant peak / dense peak) in place,
    against the dense cells measured in the row's own run (`baseline`; the dense row's for itself)."""
    for name, row in rows.items():
        base = row.get("baseline") if name != BASELINE else row.get("results", {})
        base = base if base is not None else rows.get(BASELINE, {}).get("results", {})
        for depth, cells in row.get("results", {}).items():
            for length, cell in cells.items():
                d = base.get(depth, {}).get(length, {})
                ok = cell["status"] == "ok" and d.get("status") == "ok"
                cell["speedup"] = d["seconds"] / cell["seconds"] if ok and cell["seconds"] else None
                cell["memory_ratio"] = (cell["peak_mib"] / d["peak_mib"] if ok and cell["peak_mib"] is not None
                                        and d.get("peak_mib") else None)


def short(status: str) -> str:
    return status if status in ("ok", "oom") else status.split(":")[0]


def markdown(record: dict[str, Any]) -> str:
    s, rows = record["settings"], record["rows"]
    lengths, depths = [str(n) for n in s["lengths"]], [str(d) for d in s["depths"]]
    names = [BASELINE] + sorted(k for k in rows if k != BASELINE)
    others = [c.get("others_cpus") or 0.0 for row in rows.values() for cells in row.get("results", {}).values()
              for cell in cells.values() for c in cell.get("rounds", [])]
    again = f" (a measurement other processes disturbed was run again, up to {s['retries']} times)" \
        if s["retries"] else ""
    text = [f"# Long-range efficiency (LRA Table 2 shape)\n\n"
            f"Forward + backward of each variant's layer stack alone ({'causal' if s['causal'] else 'bidirectional'}, "
            f"dim {s['dim']}, {s['heads']} heads) on one random float32 sequence of n tokens, loss = output.sum(). "
            f"Every (variant, depth, length) ran in a fresh process with {s['threads']} torch threads and a "
            f"{s['limit_gib']:g} GiB address-space cap (over it: oom, and longer lengths are not tried): "
            f"{s['warmup']} untimed step, then {s['repeats']} timed, in each of {s['rounds']} round(s), the variants "
            f"in a rotated order each round{again}. Time is the median over rounds. Peak memory is the resident "
            f"high-water mark (VmHWM) the steps added over the process's size after building the stack and "
            f"the input and one untimed {PRIMER}-token step (so one-time loading is not counted); the largest over "
            f"rounds. Speed-up = dense time / variant time; memory ratio = variant peak / dense peak (LRA Table 2), "
            f"dense as measured in the variant's own run."]
    if others and max(others) >= QUIET:
        text.append(f"Other processes used up to {max(others):.1f} CPUs during some timed steps "
                    f"(each round's `others_cpus` in the JSON).")
    fails = {k: row["status"] for k, row in rows.items() if row.get("status", "ok") != "ok"}
    if fails:
        text.append("\n".join(f"- {k}: {why}" for k, why in fails.items()))

    def cell(name: str, depth: str, length: str, key: str) -> str:
        c = rows[name].get("results", {}).get(depth, {}).get(length)
        if c is None:
            return short(rows[name].get("status", "–"))
        return rec.fmt(c[key], 2) if c["status"] == "ok" else short(c["status"])

    live = [k for k in names if k not in fails]
    for depth in depths:
        title = "1 layer" if depth == "1" else f"{depth} layers"
        for key, what in (("speedup", "Speed-up vs dense"), ("memory_ratio", "Memory ratio vs dense")):
            text.append(f"## {what}, {title}\n\n" + markdown_table(
                ["variant"] + lengths, [[k] + [cell(k, depth, n, key) for n in lengths] for k in live]))
    absolute = []
    for k in live:
        for depth in depths:
            cells = [rows[k]["results"].get(depth, {}).get(n, {"status": "–"}) for n in lengths]
            params = rows[k].get("parameters", {}).get(depth)
            absolute.append([k, depth, f"{params:,}" if params is not None else "–"]
                            + [f"{rec.fmt(c['seconds'], 3)} s · {rec.mib(c['peak_mib'])} MiB"
                               if c["status"] == "ok" else short(c["status"]) for c in cells])
    text.append("## Seconds per step and peak MiB\n\n"
                + markdown_table(["variant", "layers", "params"] + lengths, absolute))
    return "\n\n".join(text)


def plot(record: dict[str, Any], out_dir: Path) -> list[str]:
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter
    s, rows = record["settings"], record["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = ["-", "--", ":", "-."]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = [BASELINE] + sorted(k for k in rows if k != BASELINE and rows[k].get("results"))
    for i, name in enumerate(names):
        for j, depth in enumerate(str(d) for d in s["depths"]):
            cells = rows[name].get("results", {}).get(depth, {})
            pts = [(int(n), c) for n, c in cells.items() if c["status"] == "ok"]
            for ax, key in zip(axes, ("seconds", "peak_mib")):
                xy = [(n, c[key]) for n, c in pts if c[key] is not None and c[key] > 0]
                if xy:
                    ax.plot(*zip(*sorted(xy)), styles[j % len(styles)], marker="o", ms=3,
                            color=colours[i % len(colours)], label=f"{name}, {depth} layer{'s' * (depth != '1')}")
    plain = FuncFormatter(lambda y, _: f"{y:g}")     # 0.3, not 3 x 10^-1
    some = FuncFormatter(lambda y, _: f"{y:g}" if f"{y:.0e}"[0] in "235" else "")   # minor: 2, 3, 5 only
    for ax, label in zip(axes, ("seconds per forward + backward", "peak memory added (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(some)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, handlelength=3)   # long enough to show solid vs dashed
    fig.suptitle(f"Long-range efficiency: dim {s['dim']}, {s['heads']} heads, "
                 f"{'causal' if s['causal'] else 'bidirectional'}, {s['threads']} threads")
    return save_figure(fig, out_dir, "efficiency.png")


def run(variants: list[Variant], *, budget: Budget | None, out_dir: Path, quick: bool, seed: int,
        log: Callable[[str], None], changes: dict[str, Any] | None = None) -> dict[str, Any]:
    del budget          # fixed work: every variant times the same steps
    shape = with_changes(QUICK if quick else dict(lengths=LENGTHS, depths=DEPTHS, dim=DIM, heads=HEADS, rounds=ROUNDS,
                                                  retries=RETRIES), changes, "efficiency")
    s: dict[str, Any] = {**shape, "causal": CAUSAL, "warmup": WARMUP, "repeats": REPEATS, "threads": THREADS,
                         "limit_gib": LIMIT_GIB, "seed": seed, "quick": quick,
                         "step": "layers(randn(1, n, dim, requires_grad)).sum().backward()"}
    s = json.loads(json.dumps(s))       # tuples as lists, as the stored record has them (record.merge)
    if BASELINE not in [v.name for v in variants]:
        log(f"efficiency: added {BASELINE!r}, the baseline every ratio is taken against")
        variants = [variant(BASELINE)] + list(variants)
    rows: dict[str, Any] = {v.name: {"summary": v.summary, "paper": v.paper, "layers": v.layers, "env": v.env}
                            for v in variants}
    for v in variants:
        if (why := cannot_run(v)) is not None:
            rows[v.name]["status"] = why
            log(f"efficiency {v.name}: {why}")
    names = [v.name for v in variants if "status" not in rows[v.name]]
    runs: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    stopped: dict[tuple[str, int], tuple[int, str]] = {}      # (variant, depth) -> (length, status)
    combos = [(d, n) for d in s["depths"] for n in s["lengths"]]
    for r in range(s["rounds"]):
        for k, (depth, length) in enumerate(combos):
            for name in rotated(names, r + k):
                if (name, depth) in stopped and length >= stopped[(name, depth)][0]:    # shorter ones still run
                    at, status = stopped[(name, depth)]
                    out = {"status": status, "error": f"not run: {short(status)} at {at} tokens"}
                else:
                    out = measure(name, depth, length, s, seed, log)
                    if out["status"] != "ok":
                        stopped[(name, depth)] = (length, out["status"])
                    if "parameters" in out:
                        rows[name].setdefault("parameters", {})[str(depth)] = out["parameters"]
                keep = ("status", "error", "seconds", "all_seconds", "cpu_seconds", "warmup_seconds", "peak_mib",
                        "baseline_rss_mib", "others_cpus", "attempts", "load_average")
                runs.setdefault((name, depth, length), []).append({x: out[x] for x in keep if x in out})
                took = f"{out['seconds']:.3f} s, {rec.mib(out.get('peak_mib'))} MiB" if out["status"] == "ok" \
                    else out["status"] + (f" ({out['error']})" if out.get("error") else "")
                log(f"efficiency round {r + 1}/{s['rounds']}, {depth} layer(s), {length} tokens, {name}: {took}")
    for (name, depth, length), rounds in runs.items():
        rows[name].setdefault("results", {}).setdefault(str(depth), {})[str(length)] = summarise(rounds)
    old = rec.load(out_dir, "efficiency")
    record = rec.merge(out_dir, "efficiency", s, rows)
    pin_baselines(record["rows"], rows, old if old is not None and old.get("settings") == s else None)
    add_ratios(record["rows"])
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot(record, out_dir)
    rec.write(out_dir, record, markdown(record), plots,
              speed_note="its seconds are not comparable; its ratios are, taken against dense in the same run")
    return record
