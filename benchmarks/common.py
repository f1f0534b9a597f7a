"""Timing helpers shared by the benchmarks: the command line's setup (threads, a memory cap), warmup,
alternating rounds across competitors (undisturbed ones only, on a shared machine), medians, plots,
and a writer for the JSON record and its markdown twin (a resumable record measured point by point).

Benchmarks are run by hand (`python -m benchmarks.<name>`), never as timed tests: wall-clock
numbers depend on the machine and its load, so the record keeps the environment next to them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch

T = TypeVar("T")


def set_threads(n: int) -> None:
    """Intra-op threads for every competitor alike; inter-op threads too, when still settable."""
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:          # only settable before the first parallel work of the process
        pass


def cap_memory(gib: float) -> None:
    """Cap the address space, so an allocation past it raises (and is reported) rather than the OOM killer
    ending the run; 0: no cap."""
    if gib > 0:
        limit = int(gib * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def default_mem_limit() -> float:
    """Three quarters of the memory available now, at most 32 GiB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return min(32.0, 0.75 * int(line.split()[1]) / 2 ** 20)
    except OSError:
        pass
    return 16.0


def one_shot_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line of a benchmark measured in one go into its report: --quick, --repeats,
    --max-wait (for quiet, `quiet_rounds`), --threads, --out-dir."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-wait", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=None)
    return parser


def started(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """A benchmark's arguments (its parser has --threads, maybe --mem-limit), with warnings silenced, the
    threads set and the address space capped."""
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    set_threads(args.threads)
    cap_memory(getattr(args, "mem_limit", 0.0))
    return args


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


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _warm_up(competitors: list[Competitor], warmup: int) -> None:
    for c in competitors:
        for _ in range(warmup):
            c.run()


def rotated(items: Sequence[T], r: int) -> list[T]:
    """Round r's order: starting one further along the list each round."""
    return list(items[r % len(items):]) + list(items[:r % len(items)])


def alternating_rounds(competitors: list[Competitor], repeats: int, warmup: int = 1,
                       log: Callable[[str], None] | None = None) -> None:
    """Warm every competitor up, then run `repeats` rounds; each round times every competitor once,
    starting one further along the list each time, so drift in the machine's speed (thermal, other
    load) falls on all of them alike. Times are appended to each competitor's `seconds`."""
    _warm_up(competitors, warmup)
    for r in range(repeats):
        for c in rotated(competitors, r):
            wall, cpu = time_once(c.run)
            c.seconds.append(wall)
            c.cpu_seconds.append(cpu)
        if log is not None:
            log(f"round {r + 1}/{repeats}: " + ", ".join(
                f"{c.name} {c.seconds[-1] / c.units * 1e3:.2f} ms" for c in competitors))


# --- a shared machine -------------------------------------------------------------------------

QUIET = 0.25          # CPUs' worth of other processes' work during a round that disturbs it


class OthersMeter:
    """CPU seconds the rest of the machine spent (every CPU's busy and stolen time, from /proc/stat,
    minus this process's and its waited-for children's) since `start()`."""

    hz = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _machine() -> float:
        try:
            with open("/proc/stat") as fh:
                fields = [int(v) for v in fh.readline().split()[1:]]
        except OSError:
            return float("nan")
        return (sum(fields[:8]) - fields[3] - fields[4]) / OthersMeter.hz   # not idle, not iowait

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def start(self) -> "OthersMeter":
        self.machine, self.own, self.wall = self._machine(), self._own(), time.perf_counter()
        return self

    def cpus(self) -> float:
        """Average number of CPUs other processes kept busy since start()."""
        others = (self._machine() - self.machine) - (self._own() - self.own)
        return max(0.0, others) / max(1e-9, time.perf_counter() - self.wall)


def others_cpus(sample: float = 2.0) -> float:
    """CPUs other processes keep busy over `sample` seconds while this one sleeps (the load average
    lags by a minute; this does not)."""
    meter = OthersMeter().start()
    time.sleep(sample)
    return meter.cpus()


def wait_for_quiet(max_wait: float = 120.0, sample: float = 2.0) -> float:
    """Sleep until other processes use under QUIET CPUs over a `sample`-second window, or max_wait
    passes; return the last reading."""
    deadline = time.monotonic() + max_wait
    while True:
        busy = others_cpus(sample)
        if busy < QUIET or time.monotonic() > deadline:
            return busy
        log(f"  machine busy ({busy:.2f} CPUs used by other processes); waiting ...")


def quiet_rounds(competitors: list[Competitor], repeats: int, warmup: int = 1, max_rounds: int | None = None,
                 max_wait: float = 120.0) -> list[dict[str, Any]]:
    """`alternating_rounds`, on a shared machine: each timed call also records how many CPUs
    other processes used meanwhile; a round where that passed QUIET anywhere is disturbed, and
    rounds go on (waiting up to max_wait s for quiet after a disturbed one; 0: never) until `repeats`
    undisturbed rounds or `max_rounds` (default 3 * repeats). Each competitor's `seconds` /
    `cpu_seconds` then hold the undisturbed rounds only (all rounds if none was). Returns the log of
    every round."""
    max_rounds = max_rounds or 3 * repeats
    _warm_up(competitors, warmup)
    rounds: list[dict[str, Any]] = []
    r = 0
    while sum(x["quiet"] for x in rounds) < repeats and r < max_rounds:
        if rounds and not rounds[-1]["quiet"] and max_wait > 0:
            wait_for_quiet(max_wait)
        entry: dict[str, Any] = {"seconds": {}, "cpu_seconds": {}, "others_cpus": {}}
        for c in rotated(competitors, r):
            meter = OthersMeter().start()
            wall, cpu = time_once(c.run)
            entry["seconds"][c.name], entry["cpu_seconds"][c.name] = wall, cpu
            entry["others_cpus"][c.name] = meter.cpus()
        entry["quiet"] = max(entry["others_cpus"].values()) < QUIET
        rounds.append(entry)
        r += 1
        log(f"round {r} ({'quiet' if entry['quiet'] else 'DISTURBED'}): " + ", ".join(
            f"{c.name} {entry['seconds'][c.name]:.3f} s" + ("" if entry["others_cpus"][c.name] < QUIET else
                                                           f" (others {entry['others_cpus'][c.name]:.1f} CPUs)")
            for c in competitors))
    use = [x for x in rounds if x["quiet"]] or rounds
    for c in competitors:
        c.seconds = [x["seconds"][c.name] for x in use]
        c.cpu_seconds = [x["cpu_seconds"][c.name] for x in use]
    return rounds


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


def save_point(json_path: str | Path, record: dict[str, Any], key: str, env: dict[str, Any],
               markdown: Callable[[dict[str, Any]], str], **extra: Any) -> None:
    """After measuring point `key` of a resumable record: stamp the environment (this date) and the
    point's own date and commit, and rewrite the JSON and its markdown twin."""
    record["environment"] = {**env, "date": environment([])["date"], **extra}
    record["points"][key]["measured"] = {k: record["environment"][k] for k in ("date", "polyformer_commit")}
    write_report(json_path, record, markdown(record))
    log(f"{key}: saved to {json_path}")


def measure_points(json_path: str | Path, points: Iterable[tuple[str, Callable[[], dict[str, Any]]]], *,
                   redo: bool, repeats: int, env: dict[str, Any], markdown: Callable[[dict[str, Any]], str],
                   kept: Callable[[dict[str, Any]], bool] = lambda point: True, **extra: Any) -> int:
    """A resumable record at json_path: measure each (key, measure) point not there yet (or every one,
    with redo; a recorded point stays while `kept` says so), saving after each, then `finish_report`."""
    json_path = Path(json_path)
    record = json.loads(json_path.read_text()) if json_path.exists() else {"points": {}}
    for key, measure in points:
        point = record["points"].get(key)
        if not redo and point is not None and kept(point):
            log(f"{key}: in the record already (--redo to measure again)")
            continue
        log(f"{key}: measuring ({repeats} rounds)")
        record["points"][key] = measure()
        save_point(json_path, record, key, env, markdown, **extra)
    return finish_report(json_path, record, markdown)


def finish_report(json_path: str | Path, record: dict[str, Any], markdown: Callable[[dict[str, Any]], str]) -> int:
    """The end of a resumable run: rewrite and print the report (exit status 0)."""
    if "environment" not in record:
        log("nothing measured")
        return 0
    text = markdown(record)
    write_report(json_path, record, text)
    print(text)
    return 0


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (imported late: plotting is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_dir: Path, name: str) -> list[str]:
    """Lay out, write `out_dir/name` and close `fig`; the file names for a record's "plots"."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return [name]


def peaks_and_times(runs: dict[str, Callable[[], Any]], units: int, repeats: int, warmup: int = 1,
                    max_wait: float = 120.0, rows: dict[str, dict[str, Any]] | None = None
                    ) -> dict[str, dict[str, Any]]:
    """Each run's peak step memory (`features.peak_step_bytes`), then its time in alternating quiet rounds
    (`quiet_rounds`, `units` per call): {name: {"peak_bytes", "seconds" (`spread`)}}, added to `rows`' entries."""
    from .features import peak_step_bytes

    rows = {name: dict((rows or {}).get(name, {})) for name in runs}
    for name, run in runs.items():
        rows[name]["peak_bytes"] = peak_step_bytes(run)
        log(f"{name}: {rows[name]['peak_bytes'] / 2**20:.1f} MiB")
    competitors = [Competitor(name, run, units) for name, run in runs.items()]
    quiet_rounds(competitors, repeats, warmup=warmup, max_wait=max_wait)
    for c in competitors:
        rows[c.name]["seconds"] = spread(c.seconds)
    return rows
