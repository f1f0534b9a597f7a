"""The arena: every variant on the same tasks, data, seed, budget and optimiser.

    python -m benchmarks.arena --list
    python -m benchmarks.arena --task extrapolation [--variants rotary,alibi] [--budget 1.5M | 300s]
                               [--seed 0] [--out-dir docs/arena] [--threads 2] [--quick]

Writes `<out-dir>/<task>.json`, `<task>.md` and the task's PNG plots; running some variants again
replaces their rows and keeps the others (see record.py). `--quick` runs the same code on tiny
shapes into a temporary directory unless --out-dir is given (the test suite's smoke test).
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .harness import Budget
from .record import DEFAULT_DIR
from .tasks import task
from .variants import TASK_NAMES, VARIANTS, for_task, variant


def describe() -> str:
    lines = ["tasks:"]
    for name in TASK_NAMES:
        module = task(name)
        budget = f" (budget {module.DEFAULT_BUDGET})" if module.DEFAULT_BUDGET else ""
        lines.append(f"  {name:<14} {module.DESCRIPTION}{budget}")
        lines.append(f"  {'':<14} variants: {', '.join(for_task(name)) or '-'}")
    lines.append("variants:")
    for name, v in VARIANTS.items():
        keywords = ", ".join(f"{k}={val!r}" for k, val in {**v.layers, **v.wrapper}.items()) or "defaults"
        env = "".join(f" [{k}={val}]" for k, val in v.env.items())
        lines.append(f"  {name:<14} {v.summary} ({v.paper}); {keywords}{env}")
    return "\n".join(lines)


def setting(text: str) -> tuple[str, Any]:
    """'widths=64,128' -> ('widths', (64, 128)); values are Python literals, else strings."""
    name, eq, value = text.partition("=")
    if not eq or not name.strip():
        raise ValueError(f"--set: expected NAME=VALUE, got {text!r}")
    try:
        return name.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return name.strip(), value.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.arena", description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="list tasks and variants, then exit")
    p.add_argument("--task", choices=TASK_NAMES)
    p.add_argument("--variants", help="comma-separated variant names (default: the task's own list)")
    p.add_argument("--budget", help="training budget: tokens (500k, 2M) or time (90s, 5min); default per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="change one of the task's settings (repeatable), e.g. --set widths=64 --set lr=3e-3")
    p.add_argument("--out-dir", type=Path, default=None,
                   help=f"default {DEFAULT_DIR} ({tempfile.gettempdir()}/arena with --quick)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run in seconds")
    args = p.parse_args(argv)
    if args.list:
        print(describe())
        return 0
    if args.task is None:
        p.error("--task is required (or --list)")
    module = task(args.task)
    names = args.variants.split(",") if args.variants else for_task(args.task)
    try:
        variants = [variant(name.strip()) for name in names if name.strip()]
        budget = Budget.parse(args.budget) if args.budget else None
        changes = dict(setting(text) for text in args.set)
    except ValueError as err:
        p.error(str(err))
    if not variants:
        p.error(f"no variants for task {args.task!r}")
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) / "arena" if args.quick else DEFAULT_DIR)

    from ..common import log, set_threads

    set_threads(args.threads)
    start = time.perf_counter()
    try:
        module.run(variants, budget=budget, out_dir=out_dir, quick=args.quick, seed=args.seed, log=log,
                   changes=changes)
    except ValueError as err:
        if str(err).startswith("--set"):
            p.error(str(err))
        raise
    log(f"{args.task}: {len(variants)} variant(s) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
