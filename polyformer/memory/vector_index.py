"""Nearest neighbours over a growing set of vectors, for the memories that retrieve (Memorizing
Transformer, kNN-LM, SPALM): exact search in torch or faiss's flat index (the same neighbours), and
faiss's approximate IVF and HNSW indexes (`pip install polyformer[memory]` for faiss-cpu).

Ids are insertion order among the vectors held: 0 is the oldest. `keep_last(n)` forgets the oldest
vectors and renumbers the rest, so a bounded memory evicts first-in first-out. A faiss index keeps the
forgotten vectors (stale) and searches only the live ids, until the stale part outgrows the live part:
then it is rebuilt from the live vectors, so eviction costs amortised O(1) additions per vector."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

KINDS = ("flat", "ivf", "hnsw")
METRICS = ("l2", "ip")
BACKENDS = ("auto", "torch", "faiss")


def have_faiss() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class IndexSpec:
    """kind: "flat" (exact), "ivf" (k-means cells, `nprobe` searched), "hnsw" (graph, `hnsw_m`
    links, `ef_search` candidates). metric: "l2" (squared distance, nearest first) or "ip" (inner
    product, largest first). An IVF index searches exactly until it holds `train_size` vectors, then
    trains its `nlist` cells (0: 4·sqrt(n), at most n / 39) on them. backend "auto" is faiss for
    ivf / hnsw and torch for flat."""

    kind: str = "flat"
    metric: str = "l2"
    backend: str = "auto"
    nlist: int = 0
    nprobe: int = 8
    train_size: int = 4096
    hnsw_m: int = 32
    ef_search: int = 64

    def __post_init__(self) -> None:
        for name, value, allowed in (("kind", self.kind, KINDS), ("metric", self.metric, METRICS),
                                     ("backend", self.backend, BACKENDS)):
            if value not in allowed:
                raise ValueError(f"index {name} must be one of {', '.join(allowed)}, got {value!r}")
        for name in ("nprobe", "train_size", "hnsw_m", "ef_search"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"index {name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.nlist, int) or self.nlist < 0:
            raise ValueError(f"index nlist must be an integer >= 0 (0: chosen from the size), got {self.nlist!r}")
        if self.kind != "flat" and self.backend == "torch":
            raise ValueError(f"a {self.kind} index needs the faiss backend; torch searches exactly (kind='flat')")
        if self.uses_faiss and not have_faiss():
            raise ImportError(f"a {self.kind} index with backend {self.backend!r} needs faiss: "
                              "pip install polyformer[memory] (faiss-cpu)")

    @property
    def uses_faiss(self) -> bool:
        return self.backend == "faiss" or (self.backend == "auto" and self.kind != "flat")


def exact_search(db: Tensor, q: Tensor, k: int, metric: str, chunk: int = 65536) -> tuple[Tensor, Tensor]:
    """Exact top-k of q (m, d) among db (n, d): (scores (m, k) float32, ids (m, k) int64), nearest
    first; -1 ids (and inf / -inf scores) where n < k. Works through db `chunk` rows at a time."""
    m, n = q.shape[0], db.shape[0]
    q = q.float()
    worst = math.inf if metric == "l2" else -math.inf
    best_s = q.new_full((m, k), worst)
    best_i = torch.full((m, k), -1, dtype=torch.long, device=q.device)
    for start in range(0, n, chunk):
        x = db[start:start + chunk].float()
        s = q @ x.T
        if metric == "l2":
            s = (q * q).sum(-1, keepdim=True) - 2 * s + (x * x).sum(-1)[None]
        ids = torch.arange(start, start + x.shape[0], device=q.device).expand(m, -1)
        s, ids = torch.cat((best_s, s), 1), torch.cat((best_i, ids), 1)
        top = s.topk(k, dim=1, largest=metric == "ip", sorted=True).indices
        best_s, best_i = s.gather(1, top), ids.gather(1, top)
    return best_s, best_i


class VectorIndex:
    """add(x (n, dim)); search(q (m, dim), k) -> (scores (m, k), ids (m, k)); len(); keep_last(n);
    reset(); state() / from_state() to save and load it (a tensor dict)."""

    def __init__(self, dim: int, spec: IndexSpec | None = None):
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"index dim must be a positive integer, got {dim!r}")
        self.dim, self.spec = dim, spec or IndexSpec()
        self.reset()

    def reset(self) -> None:
        self._vectors: Tensor | None = None      # exact storage: torch backend, or an IVF before training
        self._faiss = None
        self._count = 0
        self._stale = 0                          # forgotten vectors still at the front of the faiss index
        if self.spec.uses_faiss and self.spec.kind != "ivf":
            self._faiss = self._new_faiss()

    def __len__(self) -> int:
        return self._count

    @property
    def approximate(self) -> bool:
        return self._faiss is not None and self.spec.kind != "flat"

    def add(self, x: Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"vectors must be (n, {self.dim}), got shape {tuple(x.shape)}")
        x = x.detach().float()
        if self._faiss is not None:
            self._faiss.add(x.cpu().contiguous().numpy())
        else:
            self._vectors = x.clone() if self._vectors is None else torch.cat((self._vectors, x))
            if self.spec.kind == "ivf" and self._vectors.shape[0] >= self.spec.train_size:
                self._train_ivf()
        self._count += x.shape[0]

    def search(self, q: Tensor, k: int) -> tuple[Tensor, Tensor]:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        if q.dim() != 2 or q.shape[1] != self.dim:
            raise ValueError(f"queries must be (m, {self.dim}), got shape {tuple(q.shape)}")
        if self._faiss is None:
            db = self._vectors if self._vectors is not None else q.new_zeros(0, self.dim)
            return exact_search(db.to(q.device), q, k, self.spec.metric)
        scores, ids = self._faiss.search(q.detach().float().cpu().contiguous().numpy(), k, params=self._live())
        scores, ids = torch.from_numpy(scores).to(q.device), torch.from_numpy(ids).to(q.device)
        ids = torch.where(ids >= 0, ids - self._stale, ids)       # live ids from 0
        if self.spec.metric == "l2":
            scores = scores.masked_fill(ids < 0, math.inf)
        else:
            scores = scores.masked_fill(ids < 0, -math.inf)
        return scores, ids

    def vectors(self, start: int = 0, end: int | None = None) -> Tensor:
        """The held vectors [start, end) in insertion order, (n, dim) float32 (approximate indexes
        give back what they store)."""
        end = self._count if end is None else end
        if self._faiss is None:
            return self._vectors[start:end] if self._vectors is not None else torch.zeros(0, self.dim)
        return torch.from_numpy(self._faiss.reconstruct_n(self._stale + start, end - start)) if end > start \
            else torch.zeros(0, self.dim)

    def keep_last(self, n: int) -> None:
        """Forget all but the newest n vectors (ids renumbered from 0)."""
        if n >= self._count:
            return
        if self._faiss is None:
            self._vectors, self._count = self.vectors(self._count - n).clone(), n
            return
        self._stale, self._count = self._stale + self._count - n, n
        if self._stale > self._count:           # rebuild from the live vectors
            kept = self.vectors()
            self._faiss.reset()                  # an IVF keeps its trained cells
            self._stale = 0
            if n:
                self._faiss.add(kept.contiguous().numpy())

    # --- saving -------------------------------------------------------------------------------

    def state(self) -> dict[str, Tensor]:
        out = {"count": torch.tensor(self._count)}
        if self._faiss is not None:
            import faiss
            out["faiss"] = torch.from_numpy(faiss.serialize_index(self._faiss).copy())
            out["stale"] = torch.tensor(self._stale)
        elif self._vectors is not None:
            out["vectors"] = self._vectors.cpu()
        return out

    @classmethod
    def from_state(cls, dim: int, spec: IndexSpec, state: dict[str, Tensor]) -> VectorIndex:
        index = cls(dim, spec)
        if "faiss" in state:
            import faiss
            index._faiss = faiss.deserialize_index(state["faiss"].numpy())
            index._vectors = None
            if index._faiss.d != dim:
                raise ValueError(f"saved index has dimension {index._faiss.d}, expected {dim}")
            index._tune()
        elif "vectors" in state:
            index._vectors = state["vectors"].float()
        index._count = int(state["count"])
        index._stale = int(state.get("stale", 0))
        held = index._faiss.ntotal - index._stale if index._faiss is not None else (
            index._vectors.shape[0] if index._vectors is not None else 0)
        if held != index._count:
            raise ValueError(f"saved index is inconsistent: it holds {held} vectors, its count says {index._count}")
        return index

    # --- faiss --------------------------------------------------------------------------------

    def _new_faiss(self, nlist: int = 0):
        import faiss
        ip = self.spec.metric == "ip"
        flat = faiss.IndexFlatIP(self.dim) if ip else faiss.IndexFlatL2(self.dim)
        metric = faiss.METRIC_INNER_PRODUCT if ip else faiss.METRIC_L2
        if self.spec.kind == "flat":
            index = flat
        elif self.spec.kind == "ivf":
            index = faiss.IndexIVFFlat(flat, self.dim, nlist, metric)
            self._quantizer = flat               # the index refers to it: keep it alive
        else:
            index = faiss.IndexHNSWFlat(self.dim, self.spec.hnsw_m, metric)
        self._faiss = index
        self._tune()
        return index

    def _live(self):
        """faiss search parameters that skip the stale ids (None when there are none)."""
        if not self._stale:
            return None
        import faiss
        live = faiss.IDSelectorRange(self._stale, self._stale + self._count)
        if self.spec.kind == "ivf":
            return faiss.SearchParametersIVF(sel=live, nprobe=self.spec.nprobe)
        if self.spec.kind == "hnsw":
            widened = -(-self.spec.ef_search * (self._stale + self._count) // self._count)   # as many live candidates
            return faiss.SearchParametersHNSW(sel=live, efSearch=widened)
        return faiss.SearchParameters(sel=live)

    def _tune(self) -> None:
        if self.spec.kind == "ivf":
            self._faiss.nprobe = self.spec.nprobe
        elif self.spec.kind == "hnsw":
            self._faiss.hnsw.efSearch = self.spec.ef_search

    def _train_ivf(self) -> None:
        x = self._vectors
        n = x.shape[0]
        nlist = self.spec.nlist or max(1, min(int(4 * math.sqrt(n)), n // 39))
        index = self._new_faiss(nlist)
        data = x.cpu().contiguous().numpy()
        index.train(data)
        index.add(data)
        self._vectors = None
