"""The arena's tasks, one module each. Every module has

    DESCRIPTION: str                      one line for --list
    DEFAULT_BUDGET: str | None            Budget.parse text; None where the task times fixed work
    def run(variants: list[Variant], *, budget: Budget | None, out_dir: Path, quick: bool, seed: int,
            log: Callable[[str], None], changes: dict | None = None) -> dict
            # writes out_dir/<task>.json, .md, .png; returns the record

`quick` is the smoke setting: the same code path on tiny shapes, in seconds. `changes` replaces
named settings of the task (`--set widths=64,128`); the record keeps the settings it ran with.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from ..variants import TASK_NAMES


def task(name: str) -> ModuleType:
    if name not in TASK_NAMES:
        raise ValueError(f"unknown task {name!r}; tasks are {', '.join(TASK_NAMES)}")
    return import_module(f"{__name__}.{name}")
