"""The run directory's config.json: the model's config and the training settings, with the run format
so that a directory written by an incompatible version is refused, never overwritten."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from ..build import build_model, model_config
from .files import write_atomic

RUN_FORMAT = 1               # config.json "polyformer_run_format"
CONFIG = "config.json"


def run_config(model: nn.Module, train: dict[str, Any]) -> dict[str, Any]:
    """The whole config of a run: {"model": model_config(model), "train": the training settings}."""
    return {"model": model_config(model), "train": dict(train)}


def save_run_config(run_dir: str | os.PathLike, config: dict[str, Any], overwrite: bool = False) -> Path:
    """Write RUN/config.json atomically, adding "polyformer_run_format" and "polyformer_version".

    Refuses (ValueError) a run directory written by an incompatible version, and (FileExistsError)
    an existing config unless `overwrite=True`; in both cases nothing is written.
    """
    from .. import __version__

    run_dir = Path(run_dir)
    path = run_dir / CONFIG
    if path.exists():
        load_run_config(run_dir)          # another version's run directory is never overwritten
        if not overwrite:
            raise FileExistsError(f"{str(path)!r} exists: resume that run, use a new run directory, "
                                  "or pass overwrite=True")
    full = {**config, "polyformer_run_format": RUN_FORMAT, "polyformer_version": __version__}
    try:
        text = json.dumps(full, indent=2, sort_keys=True)
    except (TypeError, ValueError) as error:
        raise TypeError(f"run config must be plain JSON data (dict, list, str, number, bool, None): {error}") from error
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (text + "\n").encode())
    return path


def load_run_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """RUN/config.json; FileNotFoundError for a missing run directory or config, ValueError for a
    run directory written by an incompatible version of polyformer."""
    from .. import __version__

    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(f"{str(run_dir)!r} is a file, not a run directory (one that `polyformer train "
                                 "--out` made)")
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    path = run_dir / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist: {str(run_dir)!r} is not a polyformer run directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"run config {str(path)!r} is not readable JSON ({error})") from error
    found = config.get("polyformer_run_format") if isinstance(config, dict) else None
    if found != RUN_FORMAT:
        what = "no run format" if found is None else f"run format {found!r}"
        version = config.get("polyformer_version", "unknown") if isinstance(config, dict) else "unknown"
        raise ValueError(f"run directory {str(run_dir)!r} was written by an incompatible version of polyformer "
                         f"({CONFIG} has {what}, polyformer {version}); this polyformer {__version__} reads run "
                         f"format {RUN_FORMAT}. Nothing was changed: use a new run directory")
    return config


def model_from_run(run_dir: str | os.PathLike) -> nn.Module:
    """A freshly initialised model built from RUN/config.json ("model"), ready for `load_checkpoint`."""
    config = load_run_config(run_dir)
    if not isinstance(config.get("model"), dict):
        raise ValueError(f"{str(Path(run_dir) / CONFIG)!r} has no 'model' entry (a model_config dict)")
    return build_model(config["model"])
