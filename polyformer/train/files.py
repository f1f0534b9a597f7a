"""Durable file writes: atomic replace with fsync, and file checksums."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO, Callable


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (where directories can be opened: not on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def usual_mode() -> int:
    """The mode an ordinary new file gets here: 0o666 less the process's umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def save_tensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """safetensors' `save_file`, leaving the file with the usual permissions (it creates it 0600)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, usual_mode())


def replace_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(file)` on a temporary file beside `path`, fsync it, then rename it onto `path`."""
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    replace_atomic(path, lambda f: f.write(data))


def check_fresh(target: str | os.PathLike) -> Path:
    """`target` as a Path if it is missing or an empty directory, else FileExistsError."""
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{str(target)!r} exists and is not empty: choose a new directory")
    return target


def write_dir_atomic(target: str | os.PathLike, fill: Callable[[Path], object]) -> Path:
    """Write the directory `target` whole or not at all: `fill(tmp)` writes into a temporary
    sibling, whose files are fsynced before it is renamed onto `target` (missing or empty). An
    existing non-empty target raises FileExistsError before anything is written."""
    target = check_fresh(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        fill(tmp)
        for name in os.listdir(tmp):
            if (tmp / name).is_file():
                with open(tmp / name, "rb+") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
