"""What `train --resume` may change and what it says: the settings of the command (the original
command plus --resume is accepted, a setting that differs is refused naming both values), a run
that is already complete, and the learning-rate schedule when --steps goes past the steps the
run was planned with (the schedule keeps its plan: past its end the rate holds its final value,
lr * min_lr_ratio, as nanoGPT does past lr_decay_iters)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from ..config import flatten
from .run import CONFIG, load_run_config
from .settings import RunSettings, from_dict, resolve, set_value, to_dict, validate

CHANGEABLE = ("train.steps", "train.progress", "train.tensorboard")   # what a resume may change: length, display


def settings_for(run_dir: Path, preset: str | None, config_file: str | None, overrides: list[tuple[str, str]],
                 resume: bool) -> tuple[RunSettings, dict[str, Any] | None]:
    """The settings a run trains with, and (when resuming) the run's config.json."""
    if run_dir.exists() and not run_dir.is_dir():
        raise SystemExit(f"polyformer: --out {str(run_dir)!r} is a file; a run is a directory: choose another --out "
                         "(nothing was changed)")
    if not resume:
        if (run_dir / CONFIG).exists():
            raise SystemExit(f"polyformer: {str(run_dir)!r} already holds a run; pass --resume to continue it "
                             "or choose another --out (nothing was changed)")
        return resolve(preset, config_file, overrides), None
    config = load_run_config(run_dir)
    if config["train"].get("converted_from"):
        raise SystemExit(f"polyformer: {str(run_dir)!r} was converted from a Hugging Face checkpoint "
                         "(polyformer convert): it can be sampled and evaluated, not resumed")
    settings = from_dict(config["train"]["settings"])
    fixed = [(dotted, value) for dotted, value in overrides if dotted not in CHANGEABLE]
    differ = differences(settings, preset, config_file, fixed)
    if differ:
        listed = "; ".join(f"--{dotted} is {given!r} here but {ran!r} in the run" for dotted, given, ran in differ)
        raise SystemExit(f"polyformer: --resume continues {str(run_dir)!r} with its own settings, and this command "
                         f"differs: {listed}. Only --train.steps, --train.progress and --train.tensorboard may "
                         "change; drop the others or start a new run with another --out")
    for dotted, value in overrides:
        if dotted in CHANGEABLE:
            set_value(settings, dotted, value, source=f"--{dotted}")
    validate(settings)
    return settings, config


def differences(settings: RunSettings, preset: str | None, config_file: str | None,
                overrides: list[tuple[str, str]]) -> list[tuple[str, object, object]]:
    """(setting, this command's value, the run's value) where the command repeated with --resume
    asks for something else than the run has. With --preset / --config the command's whole settings
    are compared (the original command plus --resume is accepted); without, only the settings it names."""
    if preset or config_file:
        given = resolve(preset, config_file, overrides)
    else:
        given = copy.deepcopy(settings)
        for dotted, value in overrides:
            set_value(given, dotted, value, source=f"--{dotted}")
    ours, theirs = flatten(to_dict(given)), flatten(to_dict(settings))
    return [(k, ours[k], theirs.get(k)) for k in ours if k not in CHANGEABLE and ours[k] != theirs.get(k)]


def planned_steps(config: dict[str, Any]) -> int:
    """The steps the run's learning-rate schedule was planned for: its steps when it started."""
    train = config["train"]
    return int(train.get("schedule_steps", train["settings"]["train"]["steps"]))


class Complete(Exception):
    """The run has taken all its steps: resuming it has nothing to do (the message says so)."""


def check_remaining(run_dir: Path, checkpoint: Path, done: int, settings: RunSettings, plan: int) -> str | None:
    """Before anything is loaded or written: `Complete` when the run has taken all its steps,
    SystemExit naming --steps when it is past them; else what resuming does to the learning-rate
    schedule (None when the steps are the planned ones)."""
    t = settings.train
    if done == t.steps:
        raise Complete(f"polyformer: {str(run_dir)!r} is complete: its newest checkpoint ({checkpoint.name}) has all "
                       f"{t.steps} steps, and nothing was changed. To train further, resume with a larger --steps "
                       f"(past the {plan} steps its learning-rate schedule was planned for, the rate holds its "
                       "final value)")
    if done > t.steps:
        raise SystemExit(f"polyformer: {str(run_dir)!r} is already at step {done} ({checkpoint.name}), past "
                         f"--steps {t.steps}: give a larger --steps to train further (nothing was changed)")
    if t.steps > plan:
        return (f"learning rate: the schedule was planned for {plan} steps; steps {max(plan, done) + 1}-{t.steps} "
                f"hold its final rate {t.lr * t.min_lr_ratio:g} (train.lr x train.min_lr_ratio)")
    if t.steps < plan:
        return (f"learning rate: the run stops at step {t.steps}, before the end of the schedule it was planned "
                f"with ({plan} steps), which it keeps following")
    return None


def updated_config(config: dict[str, Any], settings: RunSettings, plan: int, corpus_sha256: str | None) -> dict:
    """config.json after a resume: the steps now asked for (what a later `--resume` alone continues
    to), the schedule's plan, and the corpus as now recorded."""
    train = {**config["train"], "settings": to_dict(settings), "schedule_steps": plan, "corpus_sha256": corpus_sha256}
    return {**config, "train": train}
