"""A corpus that needs no download: the Python standard library's own sources, read from the
running interpreter's install in a fixed order."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path


def stdlib_files() -> list[Path]:
    """The standard library's .py files (no site-packages, no tests), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "dist-packages", "test", "tests", "idlelib") or "tests" in rel:
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_bytes(max_bytes: int | None = None) -> bytes:
    """The concatenated sources, each file followed by a blank line, cut at `max_bytes`."""
    chunks, total = [], 0
    for path in stdlib_files():
        data = path.read_bytes() + b"\n\n"
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    out = b"".join(chunks)
    if not out:
        raise RuntimeError("found no standard-library sources next to this interpreter")
    return out[:max_bytes] if max_bytes is not None else out


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
