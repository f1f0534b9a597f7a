"""Landmark attention (Mohtashami & Jaggi 2023, "Landmark Attention: Random-Access Infinite Context Length
for Transformers", arXiv:2305.16300), a kernel of form "direct", causal only.

The sequence is in blocks of L tokens, each followed by its landmark token (the wrapper inserts them,
`polyformer/landmark.py`), so with B = L + 1 the key at position P belongs to block P // B and is its
landmark when P % B = L. For a query t in block c = p_t and s_tj = q_t · k_j / sqrt(d), the paper's grouped
softmax puts key j in group g_tj = c when j is a landmark or a token of block c, and g_tj = p_j for a token
of an earlier block; σ_tj = exp(s_tj) / Σ_{r: g_tr = g_tj} exp(s_tr) over the keys t may see, and

    a_tj = 0                      j a landmark (it only gates its block),
    a_tj = σ_tj                   p_j = c (the current block, attended directly),
    a_tj = σ_tj · σ_t,L(p_j)      p_j < c: within-block weight times its landmark's weight,

with L(k) block k's landmark; the landmark of block c itself is not seen (not even by itself). The weights
sum to 1, and a_tj = softmax over the tokens of s_tj + [p_j < c] (s_t,L(p_j) - lse_{r in block p_j} s_tr):
one softmax with a per-(query, block) gate added to the earlier blocks' scores, which is how it is computed.

At inference (the module not training) with `topk` = k, each query (and head) keeps only the k earlier
blocks of highest landmark score s_t,L(k): the sums above run over those blocks' landmarks and tokens alone,
so with k covering every block it is the full grouped softmax. A decode step reads the landmark keys, then
only the chosen blocks' keys and its own block's (`retrieve`); a forward of many queries over keys at
positions 0 .. j-1 weighs each earlier block's fused softmax attention by the softmax of the landmark gates and
the own block's scores (`blockwise`, no (i, j) scores); keys with padding or other positions, and return_attn,
compute the weights from the full score matrix (`grouped`, the reference).

Positions: keys are rotated at their true positions before they are cached, as everywhere in polyformer,
so a retrieved block keeps its distance to the query (the paper instead re-places retrieved blocks just
before the current one to stay inside a trained context; here rotary scaling serves that, and k covering
every block stays exactly the full forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import checks
from ...config import LayersConfig
from ...interfaces import KV, AttnOut, Caps, KernelSpec
from ...precision import HIDDEN, upcast
from .dense import match_heads


@dataclass(frozen=True)
class LandmarkOptions:
    block: int                      # L: tokens per block, each block followed by its landmark token
    topk: int | None = None         # k: earlier blocks each query retrieves at inference (None: every block)


def scatter_blocks(x: Tensor, index: Tensor, blocks: int, reduce: str) -> Tensor:
    """x (b, h, i, j) reduced per block: index (b, h, i, j) block ids -> (b, h, i, blocks)."""
    out = x.new_full((*x.shape[:-1], blocks), HIDDEN if reduce == "amax" else 0.0)
    if reduce == "amax":
        return out.scatter_reduce(-1, index, x, "amax")
    return out.scatter_add(-1, index, x)


class Landmark(nn.Module):
    """Landmark heads on q (b, h, i, d), kv.k (b, hk, j, d), kv.v (b, hk, j, dv): out (b, h, i, dv)."""

    caps = Caps(exact=False, bias=False, causal=True, bidirectional=False, padding=True, decode="keys",
                form="direct", memories=False)
    options: type = LandmarkOptions
    CHUNK = 1024

    def __init__(self, spec: KernelSpec):
        super().__init__()
        o: LandmarkOptions = spec.options
        self.block, self.topk, self.scale = o.block, o.topk, spec.scale
        self.dropout = nn.Dropout(spec.dropout)

    @staticmethod
    def check(options: LandmarkOptions, cfg: LayersConfig) -> list[str]:
        found = checks.whole(options.block, "landmark_block")
        found += checks.whole(options.topk, "landmark_topk", optional=True)
        if cfg.attention.num_mem_kv:
            found.append("landmark_block cannot combine with attn_num_mem_kv: memory key / values belong to no "
                         "block and no landmark gates them")
        return found

    @property
    def retrieving(self) -> bool:
        """Whether queries keep only their top-k earlier blocks (inference with landmark_topk)."""
        return self.topk is not None and not self.training

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        if kv.free or kv.pos is None:
            raise ValueError("landmark_block needs every key at a position (no memory key / values)")
        dtype = q.dtype
        few = q.shape[2] <= self.block + 1                    # a decode step: the scores are (few, j) anyway
        if not need_weights and (self.retrieving or not few) and self._laid_out(kv, q_pos):
            run = self.retrieve if few else self.blockwise
            return AttnOut(run(upcast(q), kv, q_pos).to(dtype))
        if need_weights:
            out, weights = self.grouped(upcast(q), kv, q_pos)
            return AttnOut(out.to(dtype), weights=weights.to(dtype))
        i, step = q.shape[2], self.CHUNK        # queries in chunks: a few (chunk, j) score tensors at a time
        q_pos = q_pos.expand(q.shape[0], i)
        parts = [self.grouped(upcast(q[:, :, a:a + step]), kv, q_pos[:, a:a + step])[0] for a in range(0, i, step)]
        return AttnOut(torch.cat(parts, 2).to(dtype))

    def _laid_out(self, kv: KV, q_pos: Tensor) -> bool:
        """Whether blocks may be read by slot: no padding, keys at positions 0 .. j - 1, queries the last i."""
        j, i = kv.k.shape[2], q_pos.shape[-1]
        if kv.mask is not None or checks.values_hidden():
            return False
        slots = torch.arange(j, device=kv.pos.device)
        return bool((kv.pos == slots).all() & (q_pos == slots[j - i:]).all())

    def gates(self, scores: Tensor, kv: KV, q_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The grouped softmax's logits (b, h, i, j) from scores s (b, h, i, j): s on the current block, s plus
        the gate s_landmark - lse_block on the chosen earlier blocks, HIDDEN elsewhere; and where they count."""
        b, h, i, j = scores.shape
        stride = self.block + 1
        k_pos, k_block = kv.pos[:, None, :], (kv.pos // stride)[:, None, :]           # (b|1, 1, j)
        q_block = (q_pos // stride)[:, :, None]                                        # (b|1, i, 1)
        is_landmark = k_pos % stride == self.block
        seen = k_pos <= q_pos[:, :, None]
        if kv.mask is not None:
            seen = seen & kv.mask[:, None, :]
        current = seen & ~is_landmark & (k_block == q_block)                          # (b|1, i, j)
        earlier = k_block < q_block
        tokens, landmarks = (seen & ~is_landmark & earlier)[:, None], (seen & is_landmark & earlier)[:, None]
        blocks = int(kv.pos.max()) // stride + 1
        index = k_block[:, None].expand(b, h, i, j)
        gate = scatter_blocks(scores.masked_fill(~landmarks, HIDDEN), index, blocks, "amax")   # (b, h, i, blocks)
        hidden = scores.masked_fill(~tokens, HIDDEN)           # exp(hidden - top) is 0 or 1, never inf
        top = scatter_blocks(hidden, index, blocks, "amax")
        mass = scatter_blocks(torch.exp(hidden - top.gather(-1, index)) * tokens, index, blocks, "sum")
        valid = (gate > HIDDEN / 2) & (mass > 0)
        lse = top + torch.where(valid, mass, 1.0).log()
        if self.retrieving and blocks > self.topk:
            chosen = gate.masked_fill(~valid, float("-inf")).topk(self.topk, dim=-1).indices
            valid = valid & torch.zeros_like(valid).scatter(-1, chosen, True)
        kept = tokens & valid.gather(-1, index)
        logits = torch.where(kept, scores + (gate - lse).gather(-1, index), HIDDEN)
        return torch.where(current[:, None], scores, logits), current[:, None] | kept

    def grouped(self, q: Tensor, kv: KV, q_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The grouped softmax over every key: out (b, h, i, dv) and the weights (b, h, i, j)."""
        h = q.shape[1]
        k, v = upcast(match_heads(kv.k, h)), match_heads(kv.v, h)
        with torch.autocast(q.device.type, enabled=False):
            scores = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
            logits, counted = self.gates(scores, kv, q_pos)
            weights = torch.softmax(logits, dim=-1) * counted     # a query that sees nothing gets 0, not NaN
        out = torch.einsum("bhij,bhjd->bhid", self.dropout(weights).to(v.dtype), v)
        return out, weights

    def blockwise(self, q: Tensor, kv: KV, q_pos: Tensor) -> Tensor:
        """The grouped softmax of the last i keys' queries over keys at slots 0 .. j - 1, without (i, j) scores:
        a_tj = σ_tj σ_t,L(p_j) is each earlier block's softmax attention (fused) weighed by the softmax of the
        landmark gates together with the query's own block's scores. out (b, h, i, dv)."""
        b, h, i, d = q.shape
        j, size, stride = kv.k.shape[2], self.block, self.block + 1
        k, v = upcast(match_heads(kv.k, h)), upcast(match_heads(kv.v, h))
        first, earlier = (j - i) // stride, (j - 1) // stride     # the first query's block; complete blocks before
        offset, own_blocks = j - i - first * stride, earlier + 1 - first
        slot = torch.arange(stride, device=q.device)
        own = (slot[None, :] <= slot[:, None]) & (slot != size)   # (B, B): causal in the block, no own landmark

        def blocked(x: Tensor, lead: int) -> Tensor:           # (b, h, n, e) -> (b, h, own_blocks, B, e)
            return F.pad(x, (0, 0, lead, own_blocks * stride - lead - x.shape[2])).unflatten(2, (own_blocks, stride))

        with torch.autocast(q.device.type, enabled=False):
            scores = torch.einsum("bhgtd,bhgud->bhgtu", blocked(q, offset), blocked(k[:, :, first * stride:], 0))
            logits = (scores * self.scale).masked_fill(~own, HIDDEN).flatten(2, 3)[:, :, offset:offset + i]
            if earlier:                                        # (b, h, G, B, d) views of the complete blocks
                k_blocks = k[:, :, :earlier * stride].unflatten(2, (earlier, stride))
                v_blocks = v[:, :, :earlier * stride].unflatten(2, (earlier, stride))
                gate = torch.einsum("bhid,bhgd->bhig", q, k_blocks[:, :, :, size]) * self.scale   # (b, h, i, G)
                before = torch.arange(earlier, device=q.device) < (torch.arange(j - i, j, device=q.device)
                                                                   // stride)[:, None]
                if self.retrieving and earlier > self.topk:
                    chosen = gate.masked_fill(~before, float("-inf")).topk(self.topk, dim=-1).indices
                    before = before & torch.zeros_like(gate, dtype=torch.bool).scatter(-1, chosen, True)
                logits = torch.cat((logits, gate.masked_fill(~before, HIDDEN)), -1)
            weights = torch.softmax(logits, dim=-1)
            out = blocked(self.dropout(weights[..., :stride]), offset) @ blocked(v[:, :, first * stride:], 0)
            out = out.flatten(2, 3)[:, :, offset:offset + i]
            if earlier:
                # each earlier block's own softmax attention, for every query (those after it are weighed 0)
                p = self.dropout.p if self.training else 0.0
                blocks = F.scaled_dot_product_attention(        # 4-d: the fused kernel
                    q[:, :, None].expand(-1, -1, earlier, -1, -1).flatten(0, 1), k_blocks[..., :size, :].flatten(0, 1),
                    v_blocks[..., :size, :].flatten(0, 1), dropout_p=p, scale=self.scale).unflatten(0, (b, h))
                out = out + (weights[..., stride:].transpose(-1, -2)[..., None] * blocks).sum(2)
        return out

    def retrieve(self, q: Tensor, kv: KV, q_pos: Tensor) -> Tensor:
        """A decode step over keys at slots 0 .. j - 1: the landmark keys, then only the top-k blocks' keys per
        query and head, and the queries' own blocks. out (b, h, i, dv)."""
        b, h, i, _ = q.shape
        hk, j = kv.k.shape[1], kv.k.shape[2]
        size, stride = self.block, self.block + 1
        q_pos = q_pos.expand(b, i)
        q_block = q_pos // stride                                                      # (b, i)
        first = int(q_block.min()) * stride
        own_k, own_v = match_heads(kv.k[:, :, first:], h), match_heads(kv.v[:, :, first:], h)
        p = torch.arange(first, j, device=q.device)
        own = ((p // stride == q_block[..., None]) & (p <= q_pos[..., None]) & (p % stride != size))[:, None]
        logits = [(torch.einsum("bhid,bhjd->bhij", q, upcast(own_k)) * self.scale).masked_fill(~own, HIDDEN)]
        count = min(j // stride, int(q_block.max()))          # complete blocks before the last query's own
        if count:
            marks = match_heads(kv.k[:, :, size::stride][:, :, :count], h)             # (b, h, count, d)
            gate = torch.einsum("bhid,bhnd->bhin", q, upcast(marks)) * self.scale
            earlier = (torch.arange(count, device=q.device) < q_block[..., None])[:, None]   # (b, 1, i, count)
            chosen = gate.masked_fill(~earlier, float("-inf")).topk(min(self.topk, count), dim=-1).indices
            rows = torch.arange(b, device=q.device).view(b, 1, 1, 1)
            heads = (torch.arange(h, device=q.device) // (h // hk)).view(1, h, 1, 1)
            k_blocks = kv.k[:, :, :count * stride].unflatten(2, (count, stride))[:, :, :, :size]
            v_blocks = kv.v[:, :, :count * stride].unflatten(2, (count, stride))[:, :, :, :size]
            k_read, v_read = k_blocks[rows, heads, chosen], v_blocks[rows, heads, chosen]   # (b, h, i, k, L, d)
            scores = torch.einsum("bhid,bhiktd->bhikt", q, upcast(k_read)) * self.scale
            lse = scores.logsumexp(-1)
            read = scores + (gate.gather(-1, chosen) - lse)[..., None]
            logits.append(read.masked_fill(~earlier.expand(b, h, i, -1).gather(-1, chosen)[..., None],
                                           HIDDEN).flatten(-2))
        with torch.autocast(q.device.type, enabled=False):
            weights = self.dropout(torch.softmax(torch.cat(logits, -1), dim=-1))
        out = torch.einsum("bhij,bhjd->bhid", weights[..., :own_v.shape[2]].to(own_v.dtype), own_v)
        if count:
            w = weights[..., own_v.shape[2]:].unflatten(-1, (-1, size)).to(v_read.dtype)
            out = out + torch.einsum("bhikt,bhiktd->bhid", w, v_read)
        return out
