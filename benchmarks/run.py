"""The benchmark suite of issue 6, one entry point:

    python -m benchmarks.run --suite training|inference|features|generation|all [--quick]

- training: forward + backward + AdamW steps/s and model FLOPs utilisation, polyformer against
  x-transformers 2.31.10 (default and attn_flash=True) and Hugging Face GPT-2 of the same shape;
  polyformer's bf16 autocast and torch.compile (`benchmarks/training.py`).
- attention: the attention kernel alone at the training shapes, polyformer's CPU kernel against
  ATen's fused kernel and the explicit path (`benchmarks/attention.py`).
- inference: batch-1 forward time and peak memory at 1k..16k tokens, a fresh process per run
  (`benchmarks/inference.py`).
- features: time / memory ratio of each optional feature against the plain model, and whether it
  keeps the fused attention path (`benchmarks/features.py`).
- generation: `python -m benchmarks.generation` in a subprocess, its fresh record embedded here.

Each suite writes `<out-dir>/<suite>.json` and `<suite>.md` (and PNG plots; the generation suite
writes `generation_summary.*`, leaving the generation benchmark's own record alone); the page
`<out-dir>.md` (default `docs/benchmarks.md`) is then rebuilt from whatever suites' records exist,
so one suite can be re-run without losing the others. `--quick` is a smoke run (smaller shapes,
fewer repeats and lengths) and writes under /tmp unless `--out-dir` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import environment, log, markdown_table, others_cpus, set_threads, wait_for_quiet

SUITES = ("training", "attention", "inference", "features", "generation")
PACKAGES = ["torch", "polyformer", "x-transformers", "transformers", "einops", "entmax", "matplotlib"]
ROOT = Path(__file__).resolve().parent.parent


def conditions(args: argparse.Namespace) -> dict[str, Any]:
    busy = wait_for_quiet(args.wait_quiet) if args.wait_quiet else others_cpus()
    return {"busy_cpus_before": busy, "load_average_before": list(os.getloadavg())}


def conditions_line(rec: dict[str, Any]) -> str:
    env, c = rec["environment"], rec["conditions"]
    return (f"Measured {env['date']} on {env['cpu']} ({env['cpu_count']} cores), torch {env['packages']['torch']}, "
            f"polyformer commit {env['polyformer_commit']}; {rec.get('duration_s', 0) / 60:.1f} min. Before the suite: "
            f"other processes used {c['busy_cpus_before']:.2f} CPUs, 1-min load average "
            f"{c['load_average_before'][0]:.2f}; after: {c.get('load_average_after', [float('nan')])[0]:.2f}.")


def save(out_dir: Path, suite: str, rec: dict[str, Any]) -> None:
    section = rec.pop("markdown")
    (out_dir / f"{suite}.json").write_text(json.dumps(rec, indent=2, default=str) + "\n")
    (out_dir / f"{suite}.md").write_text(section.rstrip() + "\n\n" + conditions_line(rec) + "\n")
    log(f"wrote {out_dir / (suite + '.json')} and {out_dir / (suite + '.md')}")


def run_suite(suite: str, args: argparse.Namespace, out_dir: Path) -> None:
    cond = conditions(args)
    log(f"=== {suite} (other processes use {cond['busy_cpus_before']:.2f} CPUs) ===")
    start = time.perf_counter()
    if suite == "training":
        from . import training
        rec = training.run(quick=args.quick, repeats=args.repeats, out_dir=out_dir)
    elif suite == "attention":
        from . import attention
        rec = attention.run(args.repeats or (2 if args.quick else 7))
        rec["markdown"] = attention.markdown(rec, footer=False)
    elif suite == "features":
        from . import features
        rec = features.run(quick=args.quick, repeats=args.repeats, out_dir=out_dir)
    elif suite == "inference":
        from . import inference
        lengths = tuple(int(n) for n in args.lengths.split(",")) if args.lengths else None
        rec = inference.run(quick=args.quick, out_dir=out_dir, threads=args.threads,
                            limit_gib=args.limit_gib, lengths=lengths)
    else:
        rec = generation(args, out_dir)
    rec["duration_s"] = time.perf_counter() - start
    cond["load_average_after"] = list(os.getloadavg())
    rec["conditions"] = cond
    rec["environment"] = environment(PACKAGES)
    save(out_dir, record_name(suite), rec)


def record_name(suite: str) -> str:
    """generation.json / .md are generation.py's own record (the README quotes it): not overwritten."""
    return "generation_summary" if suite == "generation" else suite


# --- generation: the issue-3 benchmark, run as it is ------------------------------------------

def generation(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """Run benchmarks/generation.py as it is, into a temporary file: its own record
    (docs/benchmarks/generation.json, quoted by the README) is left alone; this suite's record
    embeds the fresh one."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "generation.json"
        cmd = [sys.executable, "-m", "benchmarks.generation", "--out", str(out)]
        if args.quick:
            cmd += ["--repeats", "2", "--new-tokens", "64", "--skip-check"]
        log("running " + " ".join(cmd[1:]))
        proc = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.DEVNULL)
        if proc.returncode not in (0, 1):      # 1: ran, but the correctness check failed (reported)
            raise RuntimeError(f"benchmarks.generation exited with status {proc.returncode}")
        gen = json.loads(out.read_text())
        page_md = out.with_suffix(".md").read_text()
    res = gen["results"]
    rows = [[name, f"{r['ms_per_token']['median']:.2f}", f"{r['tokens_per_s']:.1f}",
             "-" if name.startswith("polyformer") else f"{res['polyformer']['tokens_per_s'] / r['tokens_per_s']:.2f}x"]
            for name, r in res.items() if not name.startswith("reference")]
    body = page_md.split("\n", 1)[1].replace("\n## ", "\n### ").strip()       # drop its title
    md = ["## Generation", "",
          "The generation issue's benchmark, run as it is (`python -m benchmarks.generation"
          + (" --repeats 2 --new-tokens 64 --skip-check" if args.quick else "") + "`; note: one thread, "
          "as that issue specifies). Summary:", "",
          markdown_table(["run", "ms/token", "tokens/s", "polyformer speedup"], rows), "",
          "Its full report:", "", body, ""]
    return {"generation": gen, "markdown": "\n".join(md)}


# --- the page ---------------------------------------------------------------------------------

def page(out_dir: Path) -> Path:
    """Rebuild `<out-dir>.md` from the sections present in out_dir."""
    env = environment(PACKAGES)
    parts = ["# Benchmarks", "",
             "Issue 6's suite: polyformer, x-transformers 2.31.10 and Hugging Face GPT-2 of the same shape, run "
             "in the same process (fresh processes for inference), alternating, medians of several repeats. "
             "Random weights and tokens; nothing is downloaded. Reproduce with "
             "`pip install -e \".[bench]\"` and `python -m benchmarks.run --suite all` "
             "(or one of training, attention, inference, features, generation; `--quick` for a smoke run).", "",
             f"Machine: {env['cpu']}, {env['cpu_count']} cores, python {env['python']}; "
             + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v) + ". "
             "Wall-clock numbers depend on the machine and its load; each section states the load it was "
             "measured under, and the JSON records beside this page keep every timing.", ""]
    for suite in SUITES:
        md, js = out_dir / f"{record_name(suite)}.md", out_dir / f"{record_name(suite)}.json"
        if not md.exists():
            continue
        text = md.read_text().rstrip()
        rec = json.loads(js.read_text()) if js.exists() else {}
        for png in rec.get("plots", []):
            text += f"\n\n![{suite}]({out_dir.name}/{png})"
        parts += [text, ""]
    path = out_dir.with_suffix(".md")
    path.write_text("\n".join(parts).rstrip() + "\n")
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=SUITES + ("all",), default="all")
    p.add_argument("--quick", action="store_true", help="smoke run: small shapes, few repeats")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, 2 with --quick)")
    p.add_argument("--lengths", default=None, help="inference lengths, e.g. 1024,2048,4096,8192")
    p.add_argument("--limit-gib", type=float, default=12.0, help="address-space cap of each inference process")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each suite, wait up to this many seconds for other processes to go quiet")
    p.add_argument("--out-dir", default=None,
                   help="default docs/benchmarks (/tmp/polyformer-benchmarks-quick/benchmarks with --quick)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir or ("/tmp/polyformer-benchmarks-quick/benchmarks" if args.quick else ROOT / "docs/benchmarks"))
    out_dir.mkdir(parents=True, exist_ok=True)
    set_threads(args.threads)
    for suite in SUITES if args.suite == "all" else (args.suite,):
        run_suite(suite, args, out_dir)
    path = page(out_dir)
    print(path.read_text())
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
