"""Inference forward at long sequence lengths (issue 6): time and peak memory of a batch-1 forward,
polyformer against x-transformers 2.31.10 (default attention and `attn_flash=True`) and Hugging Face
GPT-2 of the same shape (vocab 256, dim 512, depth 6, 8 heads, float32, max_seq_len = the length).

    python -m benchmarks.run --suite inference [--quick]

Every (library, length) runs in a fresh process (`benchmarks/inference_worker.py`), so one run's
memory never inflates another's peak; for each length the libraries go in a rotated order. Each
worker caps its address space (`RLIMIT_AS`, default 12 GiB of this 24 GiB machine): a model that
needs more fails an allocation and is recorded as out of memory, and its longer lengths are not
tried. Memory is the worker's resident high-water mark (`VmHWM`) over its baseline just before the
first forward (interpreter, libraries, weights and input), and the whole-process peak. A run
during which other processes kept the machine busy is run again (up to RETRIES times).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import QUIET, OthersMeter, log, markdown_table, pyplot, rotated, save_figure, wait_for_quiet

LENGTHS = (1024, 2048, 4096, 8192, 16384)
LIBRARIES = ("polyformer", "x-transformers", "x-transformers flash", "HF GPT-2")
LIMIT_GIB = 12.0
TIMEOUT = 1800
RETRIES = 2           # a run other processes disturbed is run again, at most this many times


def schedule(length: int, quick: bool) -> tuple[int, int]:
    """(warmup, timed) forwards in one worker: long forwards take tens of seconds each, and their
    one-time start-up costs are small next to that, so they skip the warmup."""
    if quick:
        return (1, 1)
    if length <= 2048:
        return (1, 3)
    return (1, 2) if length <= 4096 else (0, 2)


def run_worker(library: str, length: int, warmup: int, repeats: int, threads: int,
               limit_gib: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.inference_worker", "--library", library, "--length", str(length),
           "--warmup", str(warmup), "--repeats", str(repeats), "--threads", str(threads),
           "--limit-gib", str(limit_gib)]
    root = Path(__file__).resolve().parent.parent
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=root)
    except subprocess.TimeoutExpired:
        return {"library": library, "length": length, "status": "timeout", "error": f"over {TIMEOUT} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or "").strip().splitlines()[-3:]
    # a worker killed by the kernel (SIGKILL = -9) or aborted in a library is also a memory failure
    status = "killed" if proc.returncode < 0 else "error"
    return {"library": library, "length": length, "status": status, "returncode": proc.returncode,
            "error": " | ".join(tail)[:500]}


def run(quick: bool = False, out_dir: Path | None = None, threads: int = 2, limit_gib: float = LIMIT_GIB,
        lengths: tuple[int, ...] | None = None) -> dict[str, Any]:
    lengths = lengths or ((1024, 2048) if quick else LENGTHS)
    results: dict[str, dict[str, Any]] = {lib: {} for lib in LIBRARIES}
    failed_at: dict[str, int] = {}
    for n_index, length in enumerate(lengths):
        order = rotated(LIBRARIES, n_index)
        warmup, repeats = schedule(length, quick)
        for lib in order:
            if lib in failed_at:
                results[lib][str(length)] = {"library": lib, "length": length, "status": "skipped",
                                             "error": f"out of memory at {failed_at[lib]} tokens (limit {limit_gib:g} GiB)"}
                log(f"inference {lib} {length}: skipped (out of memory at {failed_at[lib]})")
                continue
            others = 0.0
            for attempt in range(1 + RETRIES):
                if attempt:
                    log(f"inference {lib} {length}: disturbed ({others:.2f} CPUs used by others); again")
                    wait_for_quiet()
                load = os.getloadavg()[0]
                meter = OthersMeter().start()
                r = run_worker(lib, length, warmup, repeats, threads, limit_gib)
                others = meter.cpus()
                if others < QUIET or r["status"] != "ok":
                    break
            r.update(load_average_before=load, others_cpus=others, attempts=attempt + 1)
            results[lib][str(length)] = r
            if r["status"] != "ok":
                failed_at[lib] = length
            log(f"inference {lib} {length}: {r['status']} "
                + (f"{r['median_seconds']:.2f} s, forward peak {r['forward_peak_mib']:.0f} MiB, "
                   f"process peak {r['peak_rss_mib']:.0f} MiB" if r["status"] == "ok" else r.get("error", "")))
    record: dict[str, Any] = {"lengths": list(lengths), "libraries": list(LIBRARIES), "threads": threads,
                              "limit_gib": limit_gib, "quick": quick, "results": results,
                              "config": {"vocab": 256, "dim": 512, "depth": 6, "heads": 8, "batch": 1,
                                         "dtype": "float32", "mode": "torch.inference_mode"}}
    record["growth"] = {lib: growth(results[lib], lengths) for lib in LIBRARIES}
    record["targets"] = targets(results, lengths)
    record["markdown"] = markdown(record)
    if out_dir is not None:
        record["plots"] = plots(record, out_dir)
    return record


def growth(rows: dict[str, Any], lengths: tuple[int, ...]) -> dict[str, Any]:
    """Log-log slope of the forward's memory against length over the two longest measured lengths
    (1 = linear, 2 = quadratic) and over all of them."""
    ok = [(n, rows[str(n)]["forward_peak_mib"]) for n in lengths
          if rows.get(str(n), {}).get("status") == "ok" and rows[str(n)]["forward_peak_mib"] > 0]
    out: dict[str, Any] = {"points": len(ok)}
    if len(ok) >= 2:
        (n0, m0), (n1, m1) = ok[-2], ok[-1]
        out["slope_last"] = math.log(m1 / m0) / math.log(n1 / n0)
        xs, ys = [math.log(n) for n, _ in ok], [math.log(m) for _, m in ok]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        out["slope_fit"] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        out["range"] = [ok[-2][0], ok[-1][0]]
    return out


def targets(results: dict[str, dict[str, Any]], lengths: tuple[int, ...]) -> dict[str, Any]:
    """Issue 6: polyformer's memory at 8k and 16k no more than HF GPT-2's, and linear in length."""
    out: dict[str, Any] = {}
    for n in (8192, 16384):
        ours, hf = results["polyformer"].get(str(n), {}), results["HF GPT-2"].get(str(n), {})
        if ours.get("status") == "ok" and hf.get("status") == "ok":
            out[str(n)] = {"forward_peak_ratio": ours["forward_peak_mib"] / hf["forward_peak_mib"],
                           "process_peak_ratio": ours["peak_rss_mib"] / hf["peak_rss_mib"]}
    return out


def _cell(r: dict[str, Any], key: str, fmt: str) -> str:
    if r.get("status") == "ok":
        return fmt.format(r[key])
    if r.get("status") in ("oom", "skipped", "killed"):
        return "out of memory" if r.get("status") != "skipped" else "not run (OOM below)"
    return r.get("status", "-")


def markdown(record: dict[str, Any]) -> str:
    lengths, results = record["lengths"], record["results"]
    cfg = record["config"]
    head = ["library"] + [f"{n // 1024}k" for n in lengths]
    t_rows = [[lib] + [_cell(results[lib].get(str(n), {}), "median_seconds", "{:.2f}") for n in lengths]
              for lib in LIBRARIES]
    f_rows = [[lib] + [_cell(results[lib].get(str(n), {}), "forward_peak_mib", "{:.0f}") for n in lengths]
              for lib in LIBRARIES]
    p_rows = [[lib] + [_cell(results[lib].get(str(n), {}), "peak_rss_mib", "{:.0f}") for n in lengths]
              for lib in LIBRARIES]
    g_rows = []
    for lib in LIBRARIES:
        g = record["growth"][lib]
        if "slope_last" in g:
            g_rows.append([lib, f"{g['range'][0] // 1024}k -> {g['range'][1] // 1024}k",
                           f"{g['slope_last']:.2f}", f"{g['slope_fit']:.2f}"])
        else:
            g_rows.append([lib, "-", "-", "-"])
    sched = ", ".join(f"{n // 1024}k: {w} + {r}" for n in lengths for w, r in [schedule(n, record["quick"])])
    ooms = [f"{lib} at {n // 1024}k: {r.get('error', '')}" for lib in LIBRARIES
            for n, r in ((int(k), v) for k, v in results[lib].items()) if r.get("status") in ("oom", "killed", "error",
                                                                                                 "timeout")]
    lines = ["## Inference forward", "",
             f"Batch 1, vocab {cfg['vocab']} / dim {cfg['dim']} / depth {cfg['depth']} / {cfg['heads']} heads, "
             f"float32, `torch.inference_mode`, {record['threads']} threads, max_seq_len = the length. Every "
             "(library, length) in a fresh process, libraries in a rotated order per length; each process's "
             f"address space capped at {record['limit_gib']:g} GiB (`RLIMIT_AS`). Forwards per process "
             f"(warmup + timed, median of timed): {sched}.", "",
             "### Time (s per forward)", "", markdown_table(head, t_rows), "",
             "### Memory the forward adds (MiB): peak RSS over the RSS just before the first forward", "",
             markdown_table(head, f_rows), "",
             "### Whole-process peak RSS (MiB): interpreter, libraries, weights and the forward", "",
             markdown_table(head, p_rows), "",
             "### Growth of the forward's memory with length (log-log slope: 1 linear, 2 quadratic)", "",
             markdown_table(["library", "last doubling", "slope", "fit over all lengths"], g_rows), ""]
    t = record["targets"]
    if t:
        lines += ["Target (polyformer memory at 8k and 16k <= HF GPT-2's): " + "; ".join(
            f"{int(n) // 1024}k: forward {v['forward_peak_ratio']:.2f}x, process {v['process_peak_ratio']:.2f}x of HF"
            for n, v in t.items()) + ".", ""]
    if ooms:
        lines += ["Failures: " + "; ".join(ooms), ""]
    noisy = [f"{lib} {n // 1024}k ({r['others_cpus']:.2f})" for lib in LIBRARIES for n in lengths
             for r in [results[lib].get(str(n), {})] if r.get("others_cpus", 0) >= QUIET]
    lines += ["Runs still disturbed by other processes after retries (CPUs they used): "
              + ("; ".join(noisy) if noisy else "none") + ".", ""]
    return "\n".join(lines)


def plots(record: dict[str, Any], out_dir: Path) -> list[str]:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for lib in LIBRARIES:
        rows = record["results"][lib]
        ok = [(n, rows[str(n)]) for n in record["lengths"] if rows.get(str(n), {}).get("status") == "ok"]
        if not ok:
            continue
        line = axes[0].plot([n for n, _ in ok], [r["median_seconds"] for _, r in ok], marker="o", label=lib)[0]
        axes[1].plot([n for n, _ in ok], [r["forward_peak_mib"] for _, r in ok], marker="o", label=lib,
                     color=line.get_color())
        failed = [n for n in record["lengths"] if rows.get(str(n), {}).get("status") in ("oom", "killed")]
        for n in failed:
            axes[1].annotate("OOM", (n, ok[-1][1]["forward_peak_mib"]), color=line.get_color(), fontsize=8)
    n0 = record["lengths"][0]
    ref = record["results"]["polyformer"].get(str(n0), {})
    if ref.get("status") == "ok":
        m0 = ref["forward_peak_mib"]
        xs = record["lengths"]
        axes[1].plot(xs, [m0 * n / n0 for n in xs], color="grey", linestyle=":", label="linear from polyformer 1k")
        axes[1].plot(xs, [m0 * (n / n0) ** 2 for n in xs], color="grey", linestyle="--", label="quadratic")
    for ax, title, unit in ((axes[0], "forward time", "seconds"), (axes[1], "memory the forward adds", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (batch 1)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.set_xticks(record["lengths"])
        ax.set_xticklabels([f"{n // 1024}k" for n in record["lengths"]])
    measured = [r["forward_peak_mib"] for lib in LIBRARIES for r in record["results"][lib].values()
                if r.get("status") == "ok"]
    if measured:       # the quadratic guide would otherwise stretch the axis past every measurement
        axes[1].set_ylim(min(measured) / 1.5, max(measured) * 3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Inference forward, float32, {record['threads']} threads, dim 512 depth 6 heads 8")
    return save_figure(fig, out_dir, "inference.png")
