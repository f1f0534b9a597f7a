"""The corpus a run was trained on, recorded in RUN/corpus.json (its sha256 and each file's name,
size and digest) and compared when the run is resumed or its validation split scored: changed
text is refused naming the files, never trained on or measured silently."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .corpus import Corpus
from .files import write_atomic
from .run import load_run_config

RECORD = "corpus.json"
SHOWN = 5                    # file names listed per kind of change


class CorpusChanged(ValueError):
    """The corpus on disk is not the one the run recorded; the message names what changed."""


def files_of(corpus: Corpus) -> list[list[Any]]:
    """[name, size, sha256 (16 hex digits)] per file, in reading order."""
    return [[name, len(content), hashlib.sha256(content).hexdigest()[:16]] for name, content in corpus.contents()]


def save_record(run_dir: Path, corpus: Corpus) -> Path:
    path = run_dir / RECORD
    text = json.dumps({"sha256": corpus.sha256, "files": files_of(corpus)}, ensure_ascii=False)
    write_atomic(path, (text + "\n").encode("utf-8"))
    return path


def recorded(run_dir: Path) -> tuple[str | None, list[list[Any]] | None]:
    """(sha256, files) of the run's corpus: from corpus.json, else (runs written before it) the
    sha256 in config.json with no file list; (None, None) for a run without a corpus."""
    path = run_dir / RECORD
    if path.is_file():
        record = json.loads(path.read_text(encoding="utf-8"))
        return record["sha256"], record["files"]
    return load_run_config(run_dir).get("train", {}).get("corpus_sha256"), None


def _listed(kind: str, names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{kind} {', '.join(names[:SHOWN])}{more}"


def check_corpus(run_dir: Path, corpus: Corpus) -> None:
    """Raise CorpusChanged naming the changed, missing and new files when `corpus` is not the
    corpus the run recorded."""
    sha256, files = recorded(run_dir)
    if sha256 is None or sha256 == corpus.sha256:
        return
    head = f"the corpus changed since the run recorded it (sha256 {sha256[:16]}, now {corpus.sha256[:16]})"
    if files is None:
        raise CorpusChanged(f"{head}; the run did not record its files, so which ones differ is not known")
    before = {name: digest for name, _, digest in files}
    now = {name: digest for name, _, digest in files_of(corpus)}
    changed = [n for n in now if n in before and now[n] != before[n]]
    missing = [n for n in before if n not in now]
    new = [n for n in now if n not in before]
    parts = [_listed(kind, names) for kind, names in (("changed:", changed), ("missing:", missing), ("new:", new))
             if names]
    if not parts:
        parts = ["the same files in another order"]
    raise CorpusChanged(f"{head}: {'; '.join(parts)}")
