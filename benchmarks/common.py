"""Timing helpers shared by the benchmarks: thread setup, warmup, alternating rounds across
competitors, medians, and a writer for the JSON record and its markdown twin.

Benchmarks are run by hand (`python -m benchmarks.<name>`), never as timed tests: wall-clock
numbers depend on the machine and its load, so the record keeps the environment next to them.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch


def set_threads(n: int) -> None:
    """Intra-op threads for every competitor alike; inter-op threads too, when still settable."""
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:          # only settable before the first parallel work of the process
        pass


@dataclass
class Competitor:
    """One thing to time. `run()` does the whole measured call; `units` is what one call produces
    (new tokens), so per-unit times are `seconds / units`."""

    name: str
    run: Callable[[], Any]
    units: int
    seconds: list[float] = field(default_factory=list)         # wall time of each timed call
    cpu_seconds: list[float] = field(default_factory=list)     # this process's CPU time of each call

    @property
    def per_unit(self) -> list[float]:
        return [s / self.units for s in self.seconds]

    def median_per_unit(self) -> float:
        return statistics.median(self.per_unit)


def time_once(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call, with the garbage collector collected before and
    held off during it (as `timeit` does), so no competitor pays for another's garbage. On a shared
    machine CPU time is the less disturbed of the two when other processes take the cores."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - start, time.process_time() - cpu
    finally:
        if was_enabled:
            gc.enable()


def alternating_rounds(competitors: list[Competitor], repeats: int, warmup: int = 1,
                       log: Callable[[str], None] | None = None) -> None:
    """Warm every competitor up, then run `repeats` rounds; each round times every competitor once,
    starting one further along the list each time, so drift in the machine's speed (thermal, other
    load) falls on all of them alike. Times are appended to each competitor's `seconds`."""
    for c in competitors:
        for _ in range(warmup):
            c.run()
    for r in range(repeats):
        order = competitors[r % len(competitors):] + competitors[:r % len(competitors)]
        for c in order:
            wall, cpu = time_once(c.run)
            c.seconds.append(wall)
            c.cpu_seconds.append(cpu)
        if log is not None:
            log(f"round {r + 1}/{repeats}: " + ", ".join(
                f"{c.name} {c.seconds[-1] / c.units * 1e3:.2f} ms" for c in competitors))


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of a sample (seconds or any unit)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "polyformer"],
                               capture_output=True, text=True, check=True, timeout=10)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(packages: list[str]) -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "packages": {p: version(p) for p in packages},
        "polyformer_commit": _git_commit(Path(__file__).resolve().parent.parent),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table; numbers are expected already formatted as strings."""
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(json_path: str | Path, record: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write `record` as JSON at json_path and `markdown` next to it (same name, .md)."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    md_path = json_path.with_suffix(".md")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path
