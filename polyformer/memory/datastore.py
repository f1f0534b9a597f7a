"""A kNN-LM datastore (Khandelwal et al. 2020, arXiv:1911.00172): keys (context representations of a
trained model) and the token that followed each, searched by squared L2 distance. kNN-LM and SPALM read
it through `search(queries, k) -> (distances, next tokens, ids)`.

On disk it is a directory written whole or not at all:

    DIR/keys.safetensors     "keys" (n, dim) float16 or float32
    DIR/values.safetensors   "values" (n,) int64 next-token ids
    DIR/index.safetensors    the faiss index (VectorIndex.state()); absent for the exact torch index
    DIR/meta.json            format, size, dim, key dtype, index spec, the model / tokenizer fingerprints
                             and key layer it was built with, sha256 and size of every file

`load` verifies every file against meta.json (a truncated or edited file is refused by name) and,
given the fingerprints of the model and tokenizer about to use it, refuses another."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import checks
from ..train.files import sha256_file
from .vector_index import IndexSpec, VectorIndex, exact_search

FORMAT = 1
KEYS, VALUES, INDEX, META = "keys.safetensors", "values.safetensors", "index.safetensors", "meta.json"
KEY_DTYPES = {"float16": torch.float16, "float32": torch.float32}
QUERY_BLOCK = 256


def model_fingerprint(model: nn.Module) -> str:
    """sha256 over the model's config (when it has one) and every state-dict tensor's name, dtype,
    shape and bytes: equal for the same weights, different after any change."""
    from ..build import model_config

    digest = hashlib.sha256()
    try:
        digest.update(json.dumps(model_config(model), sort_keys=True).encode())
    except (TypeError, ValueError, AttributeError):
        digest.update(type(model).__name__.encode())
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def text_fingerprint(data: bytes | str) -> str:
    """sha256 of a tokenizer's serialised form (e.g. a run's tokenizer.json) or any identity text."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


class Datastore:
    """keys (n, dim) and the next-token ids values (n,), with an index over the keys.

    `spec` picks the index (vector_index.IndexSpec, metric "l2"): flat on the torch backend searches
    the stored keys exactly (float16 keys are upcast chunk by chunk, no float32 copy); ivf / hnsw (or
    backend "faiss") build a faiss index over float32 copies. `meta` is free JSON data recorded with
    it (model, tokenizer, key layer, corpus)."""

    def __init__(self, keys: Tensor, values: Tensor, spec: IndexSpec | None = None,
                 meta: dict[str, Any] | None = None, index: VectorIndex | None = None):
        spec = spec or IndexSpec()
        if spec.metric != "l2":
            raise ValueError(f"a kNN-LM datastore searches by L2 distance; index metric must be 'l2', "
                             f"got {spec.metric!r}")
        if keys.dim() != 2 or values.shape != keys.shape[:1]:
            raise ValueError(f"keys must be (n, dim) and values (n,), got {tuple(keys.shape)} and "
                             f"{tuple(values.shape)}")
        if keys.dtype not in KEY_DTYPES.values():
            raise TypeError(f"keys must be float16 or float32, got {keys.dtype}")
        self.keys, self.values = keys, values.long()
        self.spec, self.meta = spec, dict(meta or {})
        self.index = index
        if index is None and spec.uses_faiss:
            self.index = VectorIndex(keys.shape[1], spec)
            for start in range(0, keys.shape[0], 1 << 16):
                self.index.add(keys[start: start + (1 << 16)].float())

    @property
    def dim(self) -> int:
        return self.keys.shape[1]

    def __len__(self) -> int:
        return self.keys.shape[0]

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """queries (m, dim) -> (squared L2 distances (m, k) float32, next tokens (m, k), ids (m, k)),
        nearest first; where fewer than k entries exist, ids and tokens are -1 and distances inf."""
        for problem in checks.whole(k, "knn k"):
            raise ValueError(problem)
        if queries.dim() != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must be (m, {self.dim}), got shape {tuple(queries.shape)}")
        if self.index is not None:
            distances, ids = self.index.search(queries.float(), k)
        else:                           # queries in blocks: bounded (block, chunk) score matrices
            keys = self.keys.to(queries.device)
            found = [exact_search(keys, q, k, "l2") for q in queries.float().split(QUERY_BLOCK)]
            distances, ids = torch.cat([d for d, _ in found]), torch.cat([i for _, i in found])
        values = self.values.to(ids.device)
        tokens = torch.where(ids >= 0, values[ids.clamp(min=0)], torch.full_like(ids, -1))
        return distances, tokens, ids

    def check_built_with(self, model: str | None = None, tokenizer: str | None = None, where: str = "datastore") -> None:
        """ValueError naming what differs when `model` / `tokenizer` (fingerprints) are not the ones
        recorded in meta."""
        check_built_with(self.meta, model, tokenizer, where)

    # --- disk ----------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Write DIR atomically (a temporary sibling renamed into place); DIR must be missing or
        empty (FileExistsError, nothing written)."""
        from ..train.files import save_tensors, write_dir_atomic

        def fill(tmp: Path) -> None:
            save_tensors({"keys": self.keys.contiguous().cpu()}, tmp / KEYS, {"format": str(FORMAT)})
            save_tensors({"values": self.values.contiguous().cpu()}, tmp / VALUES, {"format": str(FORMAT)})
            names = [KEYS, VALUES]
            if self.index is not None:
                save_tensors(self.index.state(), tmp / INDEX, {"format": str(FORMAT)})
                names.append(INDEX)
            meta = {**self.meta, "format": FORMAT, "size": len(self), "dim": self.dim,
                    "key_dtype": str(self.keys.dtype).removeprefix("torch."),
                    "index": dataclasses.asdict(self.spec),
                    "files": {n: {"sha256": sha256_file(tmp / n), "size": (tmp / n).stat().st_size} for n in names}}
            (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")

        return write_dir_atomic(directory, fill)

    @classmethod
    def load(cls, directory: str | os.PathLike, model: str | None = None, tokenizer: str | None = None) -> Datastore:
        """Read DIR, verifying each file's size and sha256 against meta.json; with `model` /
        `tokenizer` fingerprints, refuse a datastore built with others (ValueError naming which)."""
        from safetensors.torch import load_file

        root = Path(directory)
        meta = read_meta(root)
        where = f"datastore {str(root)!r}"
        check_built_with(meta, model, tokenizer, where)     # before reading any tensor
        for name, record in meta["files"].items():
            path = root / name
            if not path.is_file():
                raise ValueError(f"{where} is incomplete: {name} is missing")
            size = path.stat().st_size
            if size != record.get("size"):
                raise ValueError(f"{where} is corrupted: {name} has {size} bytes, meta.json records {record.get('size')} "
                                 "(truncated or replaced); build it again")
            if sha256_file(path) != record.get("sha256"):
                raise ValueError(f"{where} is corrupted: {name} does not match its sha256 in meta.json; build it again")
        keys, values = load_file(str(root / KEYS))["keys"], load_file(str(root / VALUES))["values"]
        if tuple(keys.shape) != (meta["size"], meta["dim"]) or tuple(values.shape) != (meta["size"],):
            raise ValueError(f"{where} is inconsistent: keys {tuple(keys.shape)} and values {tuple(values.shape)} "
                             f"for {meta['size']} entries of dim {meta['dim']}")
        spec = IndexSpec(**meta["index"])
        index = None
        if INDEX in meta["files"]:
            index = VectorIndex.from_state(meta["dim"], spec, load_file(str(root / INDEX)))
        return cls(keys, values, spec, {k: v for k, v in meta.items() if k not in _DERIVED}, index=index)


_DERIVED = ("format", "size", "dim", "key_dtype", "index", "files")


def check_built_with(meta: dict[str, Any], model: str | None, tokenizer: str | None, where: str) -> None:
    for what, given in (("model", model), ("tokenizer", tokenizer)):
        record = meta.get(what) if isinstance(meta.get(what), dict) else {}
        recorded = record.get("fingerprint")
        if given is not None and recorded != given:
            raise ValueError(f"{where} was built with another {what} ({what} fingerprint {str(recorded)[:12]}, "
                             f"from {record.get('source', 'unknown')}); this {what} is {given[:12]}. A "
                             "datastore's keys belong to the model and tokenizer that made them: build one "
                             "for this run (polyformer datastore)")


def read_meta(root: Path) -> dict[str, Any]:
    """DIR/meta.json, checked to be a datastore's of this format."""
    path = root / META
    if not root.is_dir():
        raise FileNotFoundError(f"datastore directory {str(root)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"{str(root)!r} is not a datastore: it has no {META} (make one with polyformer datastore)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"datastore {str(root)!r} is corrupted: {META} is not readable JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise ValueError(f"{str(path)!r} is not a datastore meta.json of format {FORMAT}")
    missing = [k for k in ("size", "dim", "index") if k not in meta] + [n for n in (KEYS, VALUES) if n not in meta["files"]]
    if missing:
        raise ValueError(f"datastore {str(root)!r} is corrupted: {META} lacks {', '.join(missing)}")
    return meta
