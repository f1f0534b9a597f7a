"""A corpus that needs no download: the Python standard library's own sources, read from the
running interpreter's install in a fixed order, or the user's own text files and folders."""

from __future__ import annotations

import errno
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

from .batches import integer_at_least

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

SEPARATOR = b"\n\n"            # after every file, so files do not run into each other
VALIDATION_FRACTION = 0.05
_SNIFF = 8192                  # bytes read first to spot a binary file before reading all of it
_NOT_STDLIB = ("site-packages", "dist-packages", "test", "tests", "idlelib")


def stdlib_files() -> list[Path]:
    """The standard library's .py files (no site-packages, no tests), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for top, dirs, names in os.walk(root, followlinks=True):
        here = Path(top)
        # pruned, not filtered: site-packages can be far larger than the standard library
        dirs[:] = [d for d in dirs if d != "tests" and not (here == root and d in _NOT_STDLIB)]
        files += [here / name for name in names if name.endswith(".py")]
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


def validation_score(name: str) -> float:
    """A stable number in [0, 1) from a file's relative name: the file is held out for validation
    when it falls below the validation fraction, whatever other files the corpus has."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


@dataclass(frozen=True)
class Corpus:
    """Files read in a fixed order.

    files: (relative name, size) per file, in order; size counts the file's bytes in `data`
        (the last file may be cut by max_bytes), not its separator.
    data: every file's bytes followed by SEPARATOR (a blank line).
    sha256: hex digest of `data`, to record with a run.
    source: where the files came from, for logs.
    """

    files: list[tuple[str, int]] = field(repr=False)
    data: bytes = field(repr=False)
    sha256: str
    source: str = ""

    @classmethod
    def from_pieces(cls, pieces: Sequence[tuple[str, bytes]], source: str = "") -> Corpus:
        data = b"".join(content + SEPARATOR for _, content in pieces)
        return cls([(name, len(content)) for name, content in pieces], data,
                   hashlib.sha256(data).hexdigest(), source)

    def contents(self) -> list[tuple[str, bytes]]:
        """(relative name, bytes) per file, without separators."""
        out, offset = [], 0
        for name, size in self.files:
            out.append((name, self.data[offset: offset + size]))
            offset += size + len(SEPARATOR)
        return out

    def pieces(self) -> list[bytes]:
        """Each file's stretch of `data` (its bytes and separator); they concatenate to `data`."""
        return [content + SEPARATOR for _, content in self.contents()]

    def split(self, val_fraction: float = VALIDATION_FRACTION) -> tuple[Corpus, Corpus]:
        """(train, validation), by file: a file is held out when `validation_score` of its name is
        below val_fraction, so adding files never moves the others. With two files or more each
        side gets at least one (the lowest / highest score moves over); a single file is cut
        at 1 - val_fraction of its bytes."""
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        contents = self.contents()
        if len(contents) == 1:
            name, content = contents[0]
            if len(content) < 2:
                raise ValueError(f"cannot split a corpus of one file of {len(content)} byte(s) into "
                                 "train and validation")
            cut = min(max(1, round(len(content) * (1 - val_fraction))), len(content) - 1)
            return (Corpus.from_pieces([(name, content[:cut])], self.source),
                    Corpus.from_pieces([(name, content[cut:])], self.source))
        scores = [validation_score(name) for name, _ in contents]
        held = [s < val_fraction for s in scores]
        if not any(held):
            held[scores.index(min(scores))] = True
        if all(held):
            held[scores.index(max(scores))] = False
        train = [c for c, h in zip(contents, held) if not h]
        val = [c for c, h in zip(contents, held) if h]
        return Corpus.from_pieces(train, self.source), Corpus.from_pieces(val, self.source)

    def tokens(self, tokenizer: Tokenizer | None = None) -> Tensor:
        """The corpus as one (N,) long tensor: raw bytes when `tokenizer` is None or byte-level,
        else the tokenizer's ids, file by file."""
        if tokenizer is None or tokenizer.kind == "byte":
            return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).long()
        ids = [i for piece in tokenizer.encode_batch(self.pieces()) for i in piece]
        return torch.tensor(ids, dtype=torch.long)

    def summary(self) -> str:
        return f"{len(self.files):,} files, {len(self.data):,} bytes, sha256 {self.sha256[:16]}"


def _read_text(path: Path) -> bytes | None:
    """The file's bytes, or None when it is binary (holds a NUL byte); a binary file's head
    usually shows it, so large ones are not read in full."""
    with path.open("rb") as f:
        head = f.read(_SNIFF)
        if b"\0" in head:
            return None
        content = head + f.read()
    return None if b"\0" in content else content


def _walk(folder: Path) -> list[tuple[str, Path]]:
    """Regular files under folder, hidden files and folders (a leading '.') left out, sorted by
    relative path; names are prefixed with the folder's own name."""
    base = folder.resolve().name
    found = []
    for top, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = Path(top) / name
            if name.startswith(".") or not path.is_file():
                continue
            rel = path.relative_to(folder).as_posix()
            found.append((f"{base}/{rel}" if base else rel, path))
    return sorted(found, key=lambda item: item[0])


def _candidates(paths: Sequence[str | os.PathLike] | None) -> tuple[list[tuple[str, Path, bool]], str]:
    """(relative name, path, named explicitly) in reading order, and a description of the source."""
    if paths is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [(p.relative_to(root).as_posix(), p, False) for p in stdlib_files()]
        return files, f"standard library at {root}"
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise TypeError(f"paths must be a list of files or folders, got a single {type(paths).__name__}: "
                        f"use [{paths!r}]")
    if not paths:
        raise ValueError("corpus is empty: no paths given (pass None to read the standard library)")
    out, seen = [], set()
    for entry in paths:
        path = Path(entry)
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "corpus path does not exist", str(entry))
        found = [(n, p, False) for n, p in _walk(path)] if path.is_dir() else [(path.name, path, True)]
        for name, p, explicit in found:
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                out.append((name, p, explicit))
    return out, ", ".join(str(p) for p in paths)


def load_corpus(paths: Sequence[str | os.PathLike] | None = None, max_bytes: int | None = None) -> Corpus:
    """Read a corpus in a fixed order.

    Args:
        paths: None reads the running interpreter's standard-library sources (sorted by relative
            path, no tests or site-packages). Otherwise files and folders, read in the order
            given; folders are walked recursively in sorted order of relative path, skipping
            hidden entries (a leading '.') and binary files (any NUL byte). A file named
            explicitly that is binary is an error. Empty files are left out.
        max_bytes: stop once `data` holds this many bytes (the last file is cut to fit).

    Raises:
        FileNotFoundError: a path does not exist (the error names it).
        ValueError: no text at all ("corpus is empty"), a binary file named explicitly, or
            max_bytes not a positive integer.
    """
    if max_bytes is not None:
        integer_at_least("max_bytes", max_bytes)
    candidates, source = _candidates(paths)
    pieces, total = [], 0
    for name, path, explicit in candidates:
        room = None if max_bytes is None else max_bytes - total - len(SEPARATOR)
        if room is not None and room < 1:
            break
        content = _read_text(path)
        if content is None and explicit:
            raise ValueError(f"corpus file {str(path)!r} is binary (holds NUL bytes); only text files are read")
        if not content:
            continue
        content = content[:room] if room is not None else content
        pieces.append((name, content))
        total += len(content) + len(SEPARATOR)
    if not pieces:
        raise ValueError(f"corpus is empty: no text found in {source}")
    return Corpus.from_pieces(pieces, source)
