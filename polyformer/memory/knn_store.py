"""The Memorizing Transformer's external memory (arXiv:2203.08913): per batch row and key head, the
last `size` (normalised key, value) pairs written, first in first out, and their top-k search.

Storage is right-aligned: row r holds its `fill[r]` entries in the last slots of (b, hk, size, d),
oldest first, so a write, an eviction and a search stay batched over rows of different fill. The
flat index searches it exactly in torch (batched over rows and heads); faiss keeps one index per
row and head (`vector_index.VectorIndex`: flat, IVF or HNSW), whose ids are the slots' order."""

from __future__ import annotations

import io

import torch
from torch import Tensor

from .vector_index import IndexSpec, VectorIndex

SEARCH_ELEMENTS = 1 << 24      # scores held at once by the exact search (float32), per chunk of queries


def normalise_keys(k: Tensor) -> Tensor:
    """Keys (..., d) scaled to length sqrt(d): old and new keys keep one magnitude while the weights move."""
    return torch.nn.functional.normalize(k.float(), dim=-1).mul(k.shape[-1] ** 0.5).to(k.dtype)


class KnnStore:
    """write(k (b, hk, n, d), v (b, hk, n, dv), keep (b, n)); search(q (b, h, i, d), k) -> slots and
    validity (b, h, i, k) (search_scored: their scores too); entries(slots) -> keys (b, h, i, k, d), values
    (b, h, i, k, dv); clear(rows); state() / load(). Keys are stored as given (the caller normalises them);
    nothing here takes gradients."""

    def __init__(self, size: int, spec: IndexSpec):
        self.size, self.spec = size, spec
        self.reset()

    def reset(self) -> None:
        self.keys: Tensor | None = None           # (b, hk, size, d)
        self.values: Tensor | None = None         # (b, hk, size, dv)
        self.fill: Tensor | None = None           # (b,) entries held per row
        self.indexes: list[list[VectorIndex]] | None = None   # faiss: [row][head]

    @property
    def rows(self) -> int:
        return 0 if self.fill is None else self.fill.shape[0]

    @property
    def empty(self) -> bool:
        return self.fill is None or not bool(self.fill.any())

    @property
    def uses_faiss(self) -> bool:
        return self.spec.uses_faiss

    def _allocate(self, k: Tensor, v: Tensor) -> None:
        b, hk, _, d = k.shape
        self.keys = k.new_zeros(b, hk, self.size, d)
        self.values = v.new_zeros(b, hk, self.size, v.shape[-1])
        self.fill = torch.zeros(b, dtype=torch.long, device=k.device)
        if self.uses_faiss:
            self.indexes = [[VectorIndex(d, self.spec) for _ in range(hk)] for _ in range(b)]

    def _follow(self, device: torch.device) -> None:
        if self.keys is not None and self.keys.device != device:
            self.keys, self.values, self.fill = self.keys.to(device), self.values.to(device), self.fill.to(device)

    def clear(self, rows: Tensor) -> None:
        """Forget everything row r held where rows[r] (b,) is True."""
        if self.fill is None or not bool(rows.any()):
            return
        rows = rows.to(self.fill.device)
        self.fill = self.fill.masked_fill(rows, 0)
        self.keys = self.keys.masked_fill(rows[:, None, None, None], 0)
        self.values = self.values.masked_fill(rows[:, None, None, None], 0)
        if self.indexes is not None:
            for r in rows.nonzero().flatten().tolist():
                for index in self.indexes[r]:
                    index.reset()

    @torch.no_grad()
    def write(self, k: Tensor, v: Tensor, keep: Tensor | None) -> None:
        """Append each row's kept positions, in order; a full row forgets its oldest entries."""
        b, hk, n, d = k.shape
        if self.keys is None or self.rows != b:
            self._allocate(k, v)
        self._follow(k.device)
        keep = keep if keep is not None else torch.ones(b, n, dtype=torch.bool, device=k.device)
        held = torch.arange(self.size, device=k.device)[None] >= self.size - self.fill[:, None]   # (b, size)
        valid = torch.cat((held, keep), dim=1)
        take = valid.to(torch.int8).argsort(dim=1, stable=True)[:, -self.size:]   # the newest valid, in order

        def keep_newest(old: Tensor, new: Tensor) -> Tensor:
            both = torch.cat((old, new.to(old.dtype)), dim=2)
            return both.gather(2, take[:, None, :, None].expand(b, hk, self.size, both.shape[-1]))

        self.keys, self.values = keep_newest(self.keys, k), keep_newest(self.values, v)
        self.fill = (self.fill + keep.sum(1)).clamp(max=self.size)
        if self.indexes is not None:
            for r in range(b):
                new = k[r][:, keep[r]]                                   # (hk, kept, d)
                for h, index in enumerate(self.indexes[r]):
                    index.add(new[h])
                    index.keep_last(self.size)

    def search(self, q: Tensor, topk: int) -> tuple[Tensor, Tensor]:
        """The slots (b, h, i, topk) of each query's largest inner products among its row and key
        head's entries, largest first, and whether each is a held entry (b, h, i, topk) bool."""
        return self.search_scored(q, topk)[1:]

    @torch.no_grad()
    def search_scored(self, q: Tensor, topk: int) -> tuple[Tensor, Tensor, Tensor]:
        """`search`, with the inner products found (b, h, i, topk) (float32, float64 for a float64 q;
        -inf where nothing is held) first."""
        b, h, i, d = q.shape
        if self.fill is None:
            shape = (b, h, i, topk)
            return (q.new_full(shape, float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32)),
                    torch.zeros(shape, dtype=torch.long, device=q.device),
                    torch.zeros(shape, dtype=torch.bool, device=q.device))
        self._follow(q.device)
        hk = self.keys.shape[1]
        qg = q.reshape(b, hk, (h // hk) * i, d)                         # a key head's query heads together
        found = self._search_faiss(qg, topk) if self.indexes is not None else self._search_exact(qg, topk)
        return tuple(t.view(b, h, i, topk) for t in found)

    def _search_exact(self, qg: Tensor, topk: int) -> tuple[Tensor, Tensor, Tensor]:
        b, hk, m, _ = qg.shape
        fill = self.fill.tolist()
        start = self.size - max(max(fill), topk)                         # the columns any row holds
        dtype = torch.promote_types(qg.dtype, torch.float32)
        keys = self.keys[:, :, start:].to(dtype).transpose(-1, -2)     # (b, hk, d, size - start)
        empty = None
        if min(fill) < self.size - start:
            empty = torch.arange(start, self.size, device=qg.device)[None] < self.size - self.fill[:, None]
        step = max(1, SEARCH_ELEMENTS // max(1, b * hk * keys.shape[-1]))
        found = []
        for first in range(0, m, step):
            scores = qg[:, :, first:first + step].to(dtype) @ keys     # (b, hk, chunk, size - start)
            if empty is not None:
                scores.masked_fill_(empty[:, None, None], float("-inf"))
            found.append(scores.topk(topk, dim=-1))
        values, slots = torch.cat([t.values for t in found], dim=2), torch.cat([t.indices for t in found], dim=2)
        return values, slots + start, values > float("-inf")

    def _search_faiss(self, qg: Tensor, topk: int) -> tuple[Tensor, Tensor, Tensor]:
        b, hk, m, _ = qg.shape
        scores = qg.new_full((b, hk, m, topk), float("-inf"), dtype=torch.float32)
        ids = torch.full((b, hk, m, topk), -1, dtype=torch.long, device=qg.device)
        for r in range(b):
            for h, index in enumerate(self.indexes[r]):
                if len(index):
                    scores[r, h], ids[r, h] = (t.to(qg.device) for t in index.search(qg[r, h], topk))
        valid = ids >= 0
        slots = (self.size - self.fill[:, None, None, None] + ids).masked_fill(~valid, 0)
        return scores, slots, valid

    def entries(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """The keys (b, h, i, k, d) and values (b, h, i, k, dv) at slots (b, h, i, k)."""
        return self.gathered(self.keys, slots), self.gathered(self.values, slots)

    @staticmethod
    def gathered(stored: Tensor, slots: Tensor) -> Tensor:
        """stored (b, hk, size, e) at slots (b, h, i, k) -> (b, h, i, k, e); query head h reads key head
        h // (h / hk)."""
        b, h = slots.shape[:2]
        hk, size = stored.shape[1:3]
        heads = torch.arange(h, device=slots.device) // (h // hk)
        base = (torch.arange(b, device=slots.device)[:, None] * hk + heads) * size      # (b, h)
        at = (slots + base[:, :, None, None]).flatten()         # one flat gather: faster than 3-d indexing
        return stored.reshape(-1, stored.shape[-1]).index_select(0, at).view(*slots.shape, -1)

    # --- saving -------------------------------------------------------------------------------

    def state(self) -> dict[str, object]:
        if self.fill is None:
            return {}
        out: dict[str, object] = {"size": self.size, "kind": self.spec.kind, "keys": self.keys.cpu(),
                                  "values": self.values.cpu(), "fill": self.fill.cpu()}
        if self.indexes is not None:
            out["indexes"] = [[index.state() for index in row] for row in self.indexes]
        return out

    def load(self, state: dict[str, object]) -> None:
        self.reset()
        if not state:
            return
        if state["size"] != self.size or state["kind"] != self.spec.kind:
            raise ValueError(f"the saved kNN memory has knn_memory_size={state['size']} and knn_index="
                             f"{state['kind']!r}; this model has {self.size} and {self.spec.kind!r}")
        self.keys, self.values, self.fill = state["keys"], state["values"], state["fill"]
        if self.uses_faiss:
            d = self.keys.shape[-1]
            saved = state.get("indexes")
            if saved is not None:
                self.indexes = [[VectorIndex.from_state(d, self.spec, s) for s in row] for row in saved]
            else:       # saved by the torch search: index what the rows hold
                self.indexes = [[VectorIndex(d, self.spec) for _ in range(self.keys.shape[1])]
                                for _ in range(self.rows)]
                for r, row in enumerate(self.indexes):
                    for h, index in enumerate(row):
                        index.add(self.keys[r, h, self.size - int(self.fill[r]):])


def to_bytes(state: dict[str, object]) -> Tensor:
    """A state dict of tensors and plain values as one uint8 tensor (a checkpoint's weights file holds tensors)."""
    if not state:
        return torch.zeros(0, dtype=torch.uint8)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def from_bytes(data: Tensor) -> dict[str, object]:
    if data.numel() == 0:
        return {}
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
