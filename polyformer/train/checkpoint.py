"""Checkpoints of a training run, kept in one run directory:

    RUN/config.json                      the run's config (see run.py)
    RUN/checkpoints/step-000123/
        model.safetensors                the weights (a tensor that aliases another is stored once)
        state.pt                         optimizer, scheduler, RNG, data position, step, extra: tensors
                                         and plain types only, read with torch.load(weights_only=True)
        manifest.json                    sha256 and size of both files, written last

A checkpoint is written into a hidden temporary directory and renamed into place (`os.replace`), so
a directory named step-N is complete; a truncated or edited file fails its checksum, and
`latest_checkpoint` falls back, with a warning, to the newest checkpoint that verifies. One process
writes a run directory (rank 0): hidden leftovers of an interrupted save are removed by the next one.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import uuid
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .files import fsync_dir, save_tensors, sha256_file
from .rng import restore_rng, rng_state

try:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file
except ImportError:  # pragma: no cover - exercised only without the optional extra
    safe_open = save_file = None
    SafetensorError = OSError

CHECKPOINT_FORMAT = 1        # manifest.json, state.pt and model.safetensors "format"
WEIGHTS, STATE, MANIFEST = "model.safetensors", "state.pt", "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)")
_HIDDEN = (".tmp-", ".old-", ".del-")   # a save in progress, a replaced step, a pruned step


class ResumeError(ValueError):
    """Resuming found nothing to resume: no run directory, no checkpoint, or none that verifies."""


def _need_safetensors() -> None:
    if save_file is None:
        raise ImportError("checkpoints need safetensors: pip install safetensors")


# ---- what goes into a checkpoint ------------------------------------------------------------------

def _check_plain(value: Any, where: str) -> None:
    """Only what torch.load(weights_only=True) reads back: tensors, dicts, lists, tuples, scalars."""
    kind = type(value)
    if kind in (type(None), bool, int, float, str, Tensor, nn.Parameter):
        return
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in (str, int):
                raise TypeError(f"{where} has a key of type {type(key).__name__} ({key!r}): use str or int keys")
            _check_plain(item, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, torch.Size):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {kind.__name__}: a checkpoint holds only tensors, dicts, lists, tuples, str, "
                    "int, float, bool and None (nothing that needs pickle to load)")


def _weights(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The state dict's tensors to store, and {alias: stored name} for names whose tensor is the same
    view of the same storage as an earlier one (tied weights): safetensors refuses shared storage."""
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        view = storage + (tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view in views and tensor.numel():
            aliases[name] = views[view]
            continue
        views[view] = name
        if storage in storages or not tensor.is_contiguous():      # overlaps another tensor: own copy
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        storages.add(storage)
        tensors[name] = tensor
    return tensors, aliases


def _write_manifest(directory: Path, step: int) -> None:
    files = {name: {"sha256": sha256_file(directory / name), "size": (directory / name).stat().st_size}
             for name in (WEIGHTS, STATE)}
    manifest = {"format": CHECKPOINT_FORMAT, "step": step, "files": files}
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


# ---- saving ---------------------------------------------------------------------------------------

def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """RUN/checkpoints/step-N directories, oldest step first (verified or not)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def _clean_leftovers(root: Path) -> None:
    """Remove what an interrupted save or prune left behind; a step moved aside just before its
    replacement took its name is put back."""
    for path in root.iterdir():
        if not path.name.startswith(_HIDDEN):
            continue
        if path.name.startswith(".old-"):
            final = root / path.name[len(".old-"):].rsplit("-", 1)[0]
            if not final.exists():
                os.replace(path, final)
                continue
        shutil.rmtree(path, ignore_errors=True)


def _remove(path: Path) -> None:
    doomed = path.parent / f".del-{path.name}-{uuid.uuid4().hex}"
    os.replace(path, doomed)            # gone from view at once, even if the delete is interrupted
    shutil.rmtree(doomed, ignore_errors=True)


def save_checkpoint(run_dir: str | os.PathLike, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None, scheduler: Any | None,
                    data_state: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                    keep_last: int = 3) -> Path:
    """Write RUN/checkpoints/step-NNNNNN atomically and keep the newest `keep_last` checkpoints.

    Args:
        run_dir: the run directory (created if missing).
        step: optimizer steps taken, >= 0; names the checkpoint. Saving a step again replaces it.
        model: its state dict goes to model.safetensors (load it into the same module class).
        optimizer, scheduler: their state dicts (None: not saved).
        data_state: where the data stream is (positions, generator states): tensors and plain types.
        extra: anything else of plain types (best loss, wall time ...), returned by `load_checkpoint`.
        keep_last: checkpoints kept, by step, >= 1; the one just written is never deleted.

    Returns the checkpoint directory. Nothing named step-N exists until every file is on disk.
    """
    _need_safetensors()
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if type(keep_last) is not int or keep_last < 1:
        raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    state = {"format": CHECKPOINT_FORMAT, "step": step, "rng": rng_state(),
             "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "data_state": dict(data_state or {}), "extra": dict(extra or {})}
    for key in ("data_state", "extra", "optimizer", "scheduler"):
        _check_plain(state[key], key)
    tensors, aliases = _weights(model)
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex}"
    old = root / f".old-{final.name}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        save_tensors(tensors, tmp / WEIGHTS, metadata={"format": "polyformer.checkpoint",
                                                       "version": str(CHECKPOINT_FORMAT),
                                                       "aliases": json.dumps(aliases, sort_keys=True)})
        with open(tmp / WEIGHTS, "rb+") as f:
            os.fsync(f.fileno())
        with open(tmp / STATE, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        _write_manifest(tmp, step)
        fsync_dir(tmp)
        if final.exists():              # a directory cannot be renamed onto a non-empty one
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    for path in list_checkpoints(run_dir)[:-keep_last]:
        if path != final:
            _remove(path)
    return final


# ---- verifying and loading ------------------------------------------------------------------------

def _problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or None if its manifest verifies."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{MANIFEST} is missing (the save did not finish, or files were copied by hand)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{MANIFEST} is unreadable ({error})"
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        return f"{MANIFEST} has format {found!r}; this polyformer reads checkpoint format {CHECKPOINT_FORMAT}"
    files = manifest.get("files")
    if not isinstance(files, dict) or any(name not in files for name in (WEIGHTS, STATE)):
        return f"{MANIFEST} does not list {WEIGHTS} and {STATE}"
    for name, entry in files.items():
        file = path / name
        if Path(name).name != name or not isinstance(entry, dict) or {"sha256", "size"} - set(entry):
            return f"{MANIFEST} has a malformed entry {name!r}"
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{name} is {size} bytes, the manifest says {entry['size']} (truncated?)"
        if sha256_file(file) != entry["sha256"]:
            return f"{name} does not match its sha256 checksum (corrupted or edited)"
    match = _STEP_DIR.fullmatch(path.name)
    if match is None or manifest.get("step") != int(match.group(1)):
        return f"{MANIFEST} is for step {manifest.get('step')!r}, not for {path.name!r}"
    return None


def _scan(run_dir: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies, and (path, problem) of every newer one."""
    skipped = []
    for path in reversed(list_checkpoints(run_dir)):
        problem = _problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint whose manifest verifies (sizes and sha256); a warning names each newer
    one skipped and what failed. None when there is none."""
    path, skipped = _scan(run_dir)
    for bad, problem in skipped:
        warnings.warn(f"skipping checkpoint {str(bad)!r}: {problem}", stacklevel=2)
    return path


def resume_checkpoint(run_dir: str | os.PathLike) -> Path:
    """The checkpoint `--resume` continues from: `latest_checkpoint`, or ResumeError saying why none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ResumeError(f"nothing to resume: run directory {str(run_dir)!r} does not exist")
    path, skipped = _scan(run_dir)
    if path is None and not skipped:
        raise ResumeError(f"nothing to resume: {str(run_dir)!r} has no checkpoints "
                          f"(expected {str(run_dir / 'checkpoints')!r}/step-NNNNNN)")
    if path is None:
        reasons = "; ".join(f"{bad.name}: {problem}" for bad, problem in skipped)
        raise ResumeError(f"nothing to resume: no checkpoint in {str(run_dir)!r} verifies ({reasons})")
    for bad, problem in skipped:
        warnings.warn(f"skipping checkpoint {str(bad)!r}: {problem}", stacklevel=2)
    return path


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of a checkpoint directory named step-NNNNNN (a verified manifest agrees with it)."""
    match = _STEP_DIR.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{str(path)!r} is not a checkpoint directory (step-NNNNNN)")
    return int(match.group(1))


def _read_weights(path: Path, model: nn.Module) -> dict[str, Tensor]:
    """The stored tensors under every state-dict name; ValueError listing every mismatch with `model`."""
    try:
        with safe_open(str(path / WEIGHTS), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        aliases = json.loads(metadata.get("aliases", "{}"))
        tensors.update({alias: tensors[name] for alias, name in aliases.items()})
    except (SafetensorError, OSError, RuntimeError, ValueError, KeyError, AttributeError) as error:
        raise ValueError(f"checkpoint {str(path)!r}: {WEIGHTS} is unreadable ({error})") from error
    expected = model.state_dict()
    missing = [name for name in expected if name not in tensors]
    unexpected = [name for name in tensors if name not in expected]
    wrong = [f"{name} (checkpoint {tuple(tensors[name].shape)} {tensors[name].dtype}, "
             f"model {tuple(t.shape)} {t.dtype})"
             for name, t in expected.items() if name in tensors and not name.endswith("._extra_state")   # any size
             and (tensors[name].shape != t.shape or tensors[name].dtype != t.dtype)]
    if missing or unexpected or wrong:
        parts = [f"{len(missing)} missing from the checkpoint: {', '.join(missing)}" if missing else "",
                 f"{len(unexpected)} not in the model: {', '.join(unexpected)}" if unexpected else "",
                 f"{len(wrong)} of another shape or dtype: {'; '.join(wrong)}" if wrong else ""]
        raise ValueError(f"checkpoint {str(path)!r} does not fit this {type(model).__name__}: "
                         + " | ".join(p for p in parts if p))
    return tensors


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        raise ValueError(f"checkpoint {str(path)!r}: {STATE} is unreadable ({error})") from error
    keys = {"format", "step", "rng", "optimizer", "scheduler", "data_state", "extra"}
    if not isinstance(state, dict) or keys - set(state) or state["format"] != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {str(path)!r}: {STATE} is not a polyformer checkpoint state of format "
                         f"{CHECKPOINT_FORMAT}")
    return state


def _restore(path: Path, state: dict[str, Any], optimizer: Any | None, scheduler: Any | None) -> None:
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler)):
        if obj is None:
            continue
        if state[name] is None:
            raise ValueError(f"checkpoint {str(path)!r} has no {name} state")
        try:
            obj.load_state_dict(state[name])
        except (ValueError, KeyError, TypeError, RuntimeError) as error:
            raise ValueError(f"checkpoint {str(path)!r}: the saved {name} state does not fit this "
                             f"{type(obj).__name__} ({error})") from error


def load_checkpoint(path: str | os.PathLike, model: nn.Module | None, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any | None = None, rng: bool = True) -> dict[str, Any]:
    """Restore a checkpoint written by `save_checkpoint`.

    Args:
        path: a checkpoint directory (from `latest_checkpoint` / `resume_checkpoint`).
        model: gets the weights, strictly: a missing, unexpected or differently shaped / typed tensor
            raises ValueError listing every mismatch, before anything is changed (None: left alone,
            e.g. a sharded model's optimizer restored after its weights).
        optimizer, scheduler: get their saved state (None: left alone).
        rng: restore the torch / Python / numpy RNG states (`restore_rng`).

    Returns {"step", "data_state", "extra", "path"}. Raises FileNotFoundError for a missing
    directory, ValueError for a corrupt checkpoint (naming what failed) or one that does not fit.
    """
    _need_safetensors()
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    problem = _problem(path)
    if problem is not None:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt: {problem}")
    state = _read_state(path)
    tensors = _read_weights(path, model) if model is not None else None
    _restore(path, state, optimizer, scheduler)
    if tensors is not None:
        with torch.no_grad():
            model.load_state_dict(tensors, strict=True)
    if rng:
        restore_rng(state["rng"])
    return {"step": state["step"], "data_state": state["data_state"], "extra": state["extra"], "path": path}
