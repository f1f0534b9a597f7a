"""Sparse Sinkhorn attention (Tay et al. 2020, arXiv:2002.11296), a kernel of form "direct": keys and
values in blocks of b positions, a learned soft permutation P of the blocks (sortnet.py), and each
query block attending to its own block and to its sorted block, the P-weighted mixture of the blocks:
O(n·b) attention, an (n_b, n_b) sort matrix and O(n·n_b·d) work to mix the blocks; no (n, n) tensor.

Sorted keys: slot t of query block c's sorted block is the P[c]-weighted mean of the kept keys at slot
t of the blocks (values alike), and its softmax weight is multiplied by the share of P[c]'s mass that
falls on kept keys there (its log added to the score; share 0: invisible). Without padding the share
is 1 and the slot is the paper's (P @ blocks)[c], P's row scaled to sum 1. A padded key reaches nothing.

Causal: query block c takes row c - 1 of the causal P (blocks < c only, see sortnet.py) and its own
block up to each query; block 0 has no sorted block. SortCut (bidirectional only): every query attends
to the first `sortcut` sorted blocks (P's first rows; more than the blocks there are: all of them) and
no local block, the paper's encoding variant, O(n·sortcut·b).

The attention itself is one `scaled_dot_product_attention` call over (batch x query block) rows, each
with its own 2·b keys (plus memory keys) and, where padding, causality or shares need one, an additive
mask. Blocks are by position, per batch row: block c holds positions base + c·b .. base + c·b + b - 1, base
the row's first kept position rounded down to a multiple of b (so a left-padded row is blocked like
its text alone). Memory key / values (kv.free) are seen by every query. A decode state keeps keys: a
step's queries see what the full forward shows them, the causal sort of block c reading complete
earlier blocks only.
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
from .sortnet import SortNet, block_means, gumbel, sinkhorn, supports



@dataclass(frozen=True)
class SinkhornOptions:
    bucket_size: int = 64               # b, positions per block
    iters: int = 5                      # Sinkhorn iterations
    temperature: float = 0.75           # τ of the Gumbel-Sinkhorn operator
    sortcut: int | None = None          # SortCut: attend to the first `sortcut` sorted blocks only


@dataclass
class Layout:
    """The keys placed by position: kb, vb (b, hk, L * size, d), filled (b, L * size) bool (`full`: every
    slot); the query blocks qa .. qa + U - 1 and each query's slot among them, q_slot (b, i), U * size for
    a padded query (`q_offset`: the queries fill slots q_offset .. q_offset + i - 1 of every row)."""

    kb: Tensor
    vb: Tensor
    filled: Tensor
    full: bool
    qa: int
    U: int
    q_slot: Tensor
    q_offset: int | None


def place(x: Tensor, slot: Tensor, length: int, offset: int | None = None) -> Tensor:
    """x (b, h, n, d) written at slot (b, n) of a zero (b, h, length, d); slot == length: dropped.
    `offset`: the slots are offset, offset + 1, ... in every row (x itself when they are 0 .. n - 1)."""
    b, h, n, d = x.shape
    if offset is not None:
        return x if offset == 0 and length == n else F.pad(x, (0, 0, offset, length - offset - n))
    out = x.new_zeros(b, h, length + 1, d)
    return out.scatter(2, slot[:, None, :, None].expand(-1, h, -1, d), x)[:, :, :length]


class Sinkhorn(nn.Module):
    """Sparse Sinkhorn attention of q (b, h, i, d) against kv.k (b, hk, j, d), kv.v (b, hk, j, dv):
    the output (b, h, i, dv). The queries are the last i of the keys with positions."""

    caps = Caps(exact=False, bias=False, causal=True, bidirectional=True, padding=True, decode="keys",
                form="direct")
    options: type = SinkhornOptions

    def __init__(self, spec: KernelSpec):
        super().__init__()
        o: SinkhornOptions = spec.options
        self.size, self.iters, self.temperature, self.sortcut = o.bucket_size, o.iters, o.temperature, o.sortcut
        self.scale, self.dropout, self.causal = spec.scale, spec.dropout, spec.causal
        self.sortnet = SortNet(spec.kv_heads, spec.dim_qk)

    @staticmethod
    def check(options: SinkhornOptions, cfg: LayersConfig) -> list[str]:
        found = checks.whole(options.bucket_size, "attn_sinkhorn_bucket_size")
        found += checks.whole(options.iters, "attn_sinkhorn_iters")
        t = options.temperature
        if not checks.number(t) or t <= 0:
            found.append(f"attn_sinkhorn_temperature must be a finite number > 0, got {t!r}")
        found += checks.whole(options.sortcut, "attn_sinkhorn_sortcut", optional=True)
        if options.sortcut is not None and cfg.causal:
            found.append("attn_sinkhorn_sortcut gives every query the same top sorted blocks, sorted over the whole "
                         "sequence: it cannot be causal (causal=True, a Decoder); use it on an Encoder")
        return found

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        if need_weights:
            raise ValueError("return_attn cannot show attn_sinkhorn's attention: its sorted keys are mixtures of "
                             "blocks, not keys of the sequence")
        dtype, (b, h, i, _) = q.dtype, q.shape
        q, k, v = upcast(q), upcast(kv.k), upcast(kv.v)
        lay = self.layout(k[:, :, kv.free:], v[:, :, kv.free:], kv, q_pos, i)
        if lay is None:                     # no kept key or query in the batch
            return AttnOut(q.new_zeros(b, h, i, v.shape[-1]).to(dtype))
        p = self.permutation(lay.kb, lay.filled)
        out = self.attend(q, lay, p, k[:, :, :kv.free], v[:, :, :kv.free])        # (b, h, U * size, dv)
        if lay.q_offset is not None:
            return AttnOut(out[:, :, lay.q_offset:lay.q_offset + i].to(dtype))
        out = F.pad(out, (0, 0, 0, 1))                                              # a zero slot for padded queries
        out = out.gather(2, lay.q_slot[:, None, :, None].expand(-1, h, -1, out.shape[-1]))
        return AttnOut(out.to(dtype))

    def layout(self, k: Tensor, v: Tensor, kv: KV, q_pos: Tensor, i: int) -> Layout | None:
        """The positioned keys k, v (b, hk, n, d) in blocks by position; None when nothing is kept."""
        b, n, size, device = k.shape[0], k.shape[2], self.size, k.device
        pos = (kv.pos if kv.pos is not None else torch.arange(n, device=device)[None]).expand(b, n)
        keep = kv.mask if kv.mask is not None else torch.ones(b, n, dtype=torch.bool, device=device)
        top = torch.iinfo(pos.dtype).max
        first = pos.masked_fill(~keep, top).amin(-1, keepdim=True)
        base = torch.where(first == top, 0, first).div(size, rounding_mode="floor") * size       # (b, 1)
        slot, q_slot, q_keep = pos - base, q_pos.expand(b, i) - base, keep[:, n - i:]
        in_order = (slot == torch.arange(n, device=device)).all() & keep.all()
        last, q_first, q_last, in_order = torch.stack((
            slot.masked_fill(~keep, -1).amax(), q_slot.masked_fill(~q_keep, top).amin(),
            q_slot.masked_fill(~q_keep, -1).amax(), in_order.long())).tolist()
        if last < 0 or q_last < 0:
            return None
        length = (last // size + 1) * size
        qa, qb = q_first // size, q_last // size
        q_offset = n - i - qa * size if in_order else None      # every key kept, at slots 0 .. n - 1
        slot = slot.masked_fill(~keep, length)
        filled = torch.zeros(b, length + 1, dtype=torch.bool, device=device).scatter(1, slot, keep)[:, :length]
        q_slot = (q_slot - qa * size).masked_fill(~q_keep, (qb - qa + 1) * size)
        offset = 0 if in_order else None
        return Layout(place(k, slot, length, offset), place(v, slot, length, offset), filled,
                      bool(in_order and length == n), qa, qb - qa + 1, q_slot, q_offset)

    def sort_scores(self, kb: Tensor, filled: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The Sinkhorn operator's input S⁰ = (R + ε) / τ (b, hk, L, L) for the blocks of kb
        (b, hk, L * size, d), filled (b, L * size), and the supports of its row and column sums."""
        b, size = kb.shape[0], self.size
        scores = self.sortnet(block_means(kb, filled, size))
        if self.training:
            scores = scores + gumbel(scores.shape, scores)
        rows, cols = supports(filled.view(b, -1, size).any(-1), self.causal)
        return scores / self.temperature, rows, cols

    def permutation(self, kb: Tensor, filled: Tensor) -> Tensor:
        """The soft permutation P (b, hk, L, L) of the blocks: row c sorts for query block c
        (bidirectional), c + 1 (causal)."""
        return sinkhorn(*self.sort_scores(kb, filled), self.iters)

    def sorted_blocks(self, p_rows: Tensor, lay: Layout) -> tuple[Tensor, Tensor, Tensor | None]:
        """For rows (b, hk, r, L) of P: the sorted keys (b, hk, r, size, d), values, and each slot's score
        bias (b, hk, r, size): the log-share of the row's mass on kept keys, HIDDEN where it has none. When
        every slot is kept (`lay.full`) the share is 1 wherever the row has mass: no bias (None)."""
        b, hk, r, L = p_rows.shape
        size, tiny = self.size, torch.finfo(p_rows.dtype).tiny
        total = p_rows.sum(-1, keepdim=True)                                        # (b, hk, r, 1)
        if lay.full:                    # the mass at a slot is the row's total
            w = p_rows / total.clamp(min=tiny)
            sk, sv = ((w @ x.reshape(b, hk, L, -1)).view(b, hk, r, size, -1) for x in (lay.kb, lay.vb))
            return sk, sv, None
        mass = p_rows @ lay.filled.view(b, 1, L, size).to(p_rows.dtype)             # (b, hk, r, size)
        weight = mass.clamp(min=tiny)[..., None]
        sk, sv = ((p_rows @ x.reshape(b, hk, L, -1)).view(b, hk, r, size, -1) / weight for x in (lay.kb, lay.vb))
        share = torch.where(mass > 0, mass / total.clamp(min=tiny), 1.0)
        return sk, sv, torch.where(mass > 0, share.log(), HIDDEN)

    def attend(self, q: Tensor, lay: Layout, p: Tensor, kf: Tensor, vf: Tensor) -> Tensor:
        """Attention of the query blocks qa .. qa + U - 1 to their sorted and own blocks (or the SortCut
        blocks) and to the free keys kf, vf (b, hk, f, d): (b, h, U * size, dv). One fused attention call
        over (batch x query block) rows, each with its own 2·size (+ f) keys."""
        b, h, _, d = q.shape
        hk, L, size, qa, U = p.shape[1], p.shape[-1], self.size, lay.qa, lay.U
        ql = place(q, lay.q_slot, U * size, lay.q_offset).reshape(b, h, U, size, d)
        # per key group: keys / values (b, hk, U, m, d) and a score bias (b|1, hk|1, U|1, size|1, m) or None (0)
        keys, values, biases = [], [], []
        if self.sortcut is not None:
            sk, sv, bias = self.sorted_blocks(p[:, :, :min(self.sortcut, L)], lay)
            keys.append(sk.flatten(2, 3)[:, :, None].expand(-1, -1, U, -1, -1))
            values.append(sv.flatten(2, 3)[:, :, None].expand(-1, -1, U, -1, -1))
            biases.append(None if bias is None else bias.flatten(2, 3)[:, :, None, None])
        else:
            rows = F.pad(p, (0, 0, 1, 0))[:, :, :L] if self.causal else p         # causal: block c takes row c - 1
            sk, sv, bias = self.sorted_blocks(rows[:, :, qa:qa + U], lay)
            if bias is None and self.causal and qa == 0:          # block 0 has no sorted block
                bias = torch.where(torch.arange(U, device=q.device) > 0, 0.0, HIDDEN)[None, None, :, None]
            keys.append(sk), values.append(sv), biases.append(None if bias is None else bias[:, :, :, None])
            own = slice(qa * size, (qa + U) * size)
            keys.append(lay.kb[:, :, own].reshape(b, hk, U, size, -1))
            values.append(lay.vb[:, :, own].reshape(b, hk, U, size, -1))
            keep = None if lay.full else lay.filled[:, own].view(b, 1, U, 1, size)
            if self.causal:
                tril = torch.ones(1, 1, 1, size, size, dtype=torch.bool, device=q.device).tril()
                keep = tril if keep is None else keep & tril
            biases.append(None if keep is None else torch.where(keep, 0.0, HIDDEN))
        if kf.shape[2]:
            keys.append(kf[:, :, None].expand(-1, -1, U, -1, -1))
            values.append(vf[:, :, None].expand(-1, -1, U, -1, -1))
            biases.append(None)
        k, v = (torch.cat(x, 3).transpose(1, 2).flatten(0, 1) for x in (keys, values))    # (b * U, hk, S, d)
        bias = None
        if any(x is not None for x in biases):      # each (b|1, hk|1, U|1, size|1, m); None: 0
            heads, rows = (max(x.shape[axis] for x in biases if x is not None) for axis in (1, 3))
            zero = q.new_zeros(1, 1, 1, 1, 1)
            bias = torch.cat([(zero if x is None else x).expand(b, heads, U, rows, m.shape[3])
                              for x, m in zip(biases, keys)], -1)
            bias = bias.to(q.dtype).transpose(1, 2).flatten(0, 1)                  # (b * U, hk | 1, size | 1, S)
            if heads not in (1, h):
                bias = bias.repeat_interleave(h // hk, 1)
        out = F.scaled_dot_product_attention(ql.transpose(1, 2).flatten(0, 1), k, v, attn_mask=bias,
                                             dropout_p=self.dropout if self.training else 0.0, scale=self.scale,
                                             enable_gqa=hk != h)
        return out.view(b, U, h, size, -1).transpose(1, 2).reshape(b, h, U * size, -1)
