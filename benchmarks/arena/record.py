"""A task's record under `docs/arena/`: `<task>.json` (settings, environment, one entry per
variant), `<task>.md` (the table) and the task's PNG plots.

Variants can be run one at a time: a run replaces the rows of the variants it ran and keeps the
others, as long as the task's settings are the same; a run with other settings starts a new record.
Every row carries the commit and the wall time it was measured with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..common import environment, log

PACKAGES = ["torch", "polyformer", "einops", "matplotlib"]
ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_DIR = ROOT / "docs" / "arena"
MEMORY_NOTE = ("Step memory: the peak of tensor bytes allocated during one training forward + backward over "
               "those live at its start (activations, gradients, attention buffers; weights and optimiser "
               "state not counted), from the profiler's allocator total.")


def load(out_dir: Path, task: str) -> dict[str, Any] | None:
    path = out_dir / f"{task}.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        log(f"{path} is not valid JSON; starting a new record")
        return None


def merge(out_dir: Path, task: str, settings: dict[str, Any], rows: dict[str, Any]) -> dict[str, Any]:
    """The task's record with `rows` (variant -> result) replacing those variants' old rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    old = load(out_dir, task)
    env = environment(PACKAGES)
    for row in rows.values():
        row.setdefault("commit", env["polyformer_commit"])
        row.setdefault("date", env["date"])
        row.setdefault("threads", env["torch_threads"])       # tokens/s depend on it: shown when rows differ
        row.setdefault("cpu", env["cpu"])                       # and on the processor
    if old is not None and old.get("settings") == json.loads(json.dumps(settings)):
        kept = {k: v for k, v in old["rows"].items() if k not in rows}
        for row in kept.values():         # rows from before these were kept per row: their record's values
            row.setdefault("threads", old["environment"].get("torch_threads"))
            row.setdefault("cpu", old["environment"].get("cpu"))
        merged = {**kept, **rows}
    else:
        if old is not None:
            log(f"{task}: settings differ from the record in {out_dir}; its old rows are dropped")
        merged = rows
    return {"task": task, "settings": settings, "environment": env, "rows": merged}


def save(out_dir: Path, task: str, settings: dict[str, Any], rows: dict[str, Any],
         markdown: Callable[[dict[str, Any]], str], plot: Callable[[dict[str, Any], Path], list[str]],
         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Merge `rows` into the task's record (with `extra` facts of the run), plot and write it."""
    rec = {**merge(out_dir, task, settings, rows), **(extra or {})}
    write(out_dir, rec, markdown(rec), plot(rec, out_dir) if rec["rows"] else [])
    return rec


def most_common(rows: dict[str, Any], key: str, default: Any) -> tuple[dict[str, Any], Any]:
    """Each row's `key` (rows without it left out) and the value most rows have (`default` if none has one)."""
    values = {name: r.get(key) for name, r in rows.items() if r.get(key) is not None}
    listed = list(values.values())
    return values, max(set(listed), key=listed.count) if listed else default


def write(out_dir: Path, record: dict[str, Any], markdown: str, plots: list[str],
          speed_note: str = "their absolute speed is not comparable") -> Path:
    """Write the record as JSON and its markdown (the PNGs are already in out_dir). `speed_note`: what a
    row measured on another processor means for the task's table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    task = record["task"]
    record = {**record, "plots": plots}
    json_path = out_dir / f"{task}.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    tmp.replace(json_path)
    env = record["environment"]
    counts, usual = most_common(record["rows"], "threads", env["torch_threads"])
    cpus, usual_cpu = most_common(record["rows"], "cpu", env["cpu"])
    footer = (f"\n\nMeasured on {usual_cpu} ({env['cpu_count']} cores, {usual} torch threads), "
              f"torch {env['packages']['torch']}; rows carry their own commit and date "
              f"(this write: {env['polyformer_commit']}, {env['date']}). Settings: "
              f"`{json.dumps(record['settings'], sort_keys=True)}`.\n")
    trains = any("train" in r or "widths" in r for r in record["rows"].values())
    odd = sorted(name for name, n in counts.items() if n != usual)
    notes = [f"{MEMORY_NOTE} Tokens per second: training steps after the first, per wall-clock second."
             ] if trains else []
    if odd:
        notes.append("Rows measured with another number of torch threads (their speed is not comparable): "
                     + ", ".join(f"`{name}` ({counts[name]})" for name in odd) + ".")
    if odd_cpu := sorted(name for name, cpu in cpus.items() if cpu != usual_cpu):
        notes.append(f"Rows measured on another processor ({speed_note}): "
                     + ", ".join(f"`{name}` ({cpus[name]})" for name in odd_cpu) + ".")
    footer = ("\n\n" + " ".join(notes) if notes else "") + footer
    images = "".join(f"\n![{p}]({p})\n" for p in plots)
    (out_dir / f"{task}.md").write_text(markdown.rstrip() + "\n" + images + footer)
    index(out_dir)
    log(f"wrote {json_path}, {out_dir / (task + '.md')}" + "".join(f", {out_dir / p}" for p in plots))
    return json_path


def index(out_dir: Path) -> None:
    """`out_dir/README.md`: one line per task record present, rebuilt after every write."""
    lines = ["# The arena", "", "Every variant on the same tasks, data, seed, budget and optimiser "
             "(`python -m benchmarks.arena --list`). One page per task:", ""]
    for path in sorted(out_dir.glob("*.json")):
        rec = load(out_dir, path.stem)
        if not rec or "rows" not in rec:
            continue
        dates = sorted(str(r.get("date", "")) for r in rec["rows"].values())
        lines.append(f"- [{rec['task']}]({rec['task']}.md): {', '.join(f'`{n}`' for n in rec['rows'])} "
                     f"(measured {dates[0][:10]}{' to ' + dates[-1][:10] if dates[-1][:10] != dates[0][:10] else ''})")
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or x != x:
        return "–"
    return f"{x:.{digits}f}"


def mib(x: float | None) -> str:
    if x is None or x != x:
        return "–"
    return f"{x:.1f}" if abs(x) < 10 else f"{x:,.0f}"
