"""Infini-attention's algebra (Munkhdalai et al. 2024, arXiv:2404.07143, equations 3-10). Segment s of a
row holds its positions [s N, (s + 1) N), so segments follow each row's positions, not the tensor's layout
(a left-padded row is cut as it would be alone). With σ = ELU + 1, per key head a memory M (d x dv) and a
normaliser z (d) of the segments before s:

    A_mem = σ(Q) M / σ(Q) z                                   (0 while nothing is stored)
    M <- M + σ(K)ᵀ V   or, delta rule,   M <- M + σ(K)ᵀ (V - σ(K) M / σ(K) z);   z <- z + Σ_t σ(K_t)
    A = sigmoid(β) A_mem + (1 - sigmoid(β)) A_dot

A_dot causal softmax attention inside the segment (plus keys before the sequence every query sees: memory
key / values, XL memories). Padded keys enter neither. Linear rule: the memory before each segment is a
cumulative sum over segments; delta rule: a scan over segments. A decoder keeps a fixed-size `Summary`:
M and z of the segments before the latest one, and the latest segment's keys and values (at most N)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import checks
from ...precision import upcast
from .dense import causal_keep

EPS = 1e-10     # σ(Q) z is 0 only while the memory is empty (σ > 0): then A_mem = 0 / EPS = 0

# "M" (b, hk, d, dv), "z" (b, hk, d) float32: the memory of the segments before the latest one;
# "k" (b, hk, N, d), "v" (b, hk, N, dv), "keep" (b, N) bool: the latest segment's keys, slot t holding
# position segment·N + t; "segment" (b,) long: the latest segment's index (-1: nothing seen yet)
Summary = dict[str, Tensor]


def sigma(x: Tensor) -> Tensor:
    return F.elu(x) + 1.0


def retrieve(sq: Tensor, memory: Tensor, norm: Tensor) -> Tensor:
    """σ(Q) M / σ(Q) z: sq (..., n, d), memory (..., d, dv), norm (..., d) -> (..., n, dv)."""
    return (sq @ memory) / (sq @ norm[..., None]).clamp(min=EPS)


@dataclass
class Layout:
    """Where each token of a step goes in a (b, T) layout of T // N whole segments."""

    T: int
    base: Tensor                # (b|1,) the segment index of the layout's first segment
    slot: Tensor | None         # (b, n) each token's slot, T for padded ones; None: `offset + t` in every row
    offset: int = 0


def layout(pos: Tensor, keep: Tensor | None, held: Summary | None, N: int) -> Layout:
    """The layout of tokens at positions pos (b|1, n), keep (b, n) bool, after the `held` segment: slot
    t holds position base·N + t; base is the held segment, else the row's first kept token's segment."""
    n = pos.shape[-1]
    if held is None and keep is None and pos.shape[0] == 1 and not checks.values_hidden():
        first, gaps = torch.stack((pos[0, 0], (pos[0].diff() != 1).sum())).tolist()
        if gaps == 0 and first >= 0:        # one run of positions shared by the rows: padding, no scatter
            offset = first % N
            return Layout(N * -(-(offset + n) // N), pos.new_tensor([first // N]), None, offset)
    b = max(pos.shape[0], 1 if keep is None else keep.shape[0], 1 if held is None else held["segment"].shape[0])
    pos = pos.expand(b, n)
    keep = torch.ones(b, n, dtype=torch.bool, device=pos.device) if keep is None else keep
    g = torch.div(pos, N, rounding_mode="floor")
    big = torch.iinfo(torch.long).max
    first = torch.where(keep, g, big).amin(-1)
    base = torch.where(first == big, 0, first)
    if held is not None:
        base = torch.where(held["segment"] >= 0, held["segment"], base)
    slot = pos - base[:, None] * N
    T = N * (int(torch.where(keep, slot, 0).amax()) // N + 1)
    slot = torch.where(keep, slot, T)
    if not checks.values_hidden():
        taken = torch.zeros(b, T + 1, dtype=torch.long, device=pos.device)
        if held is not None:
            taken[:, :N] = held["keep"].long()
        taken = taken.scatter_add(1, slot, keep.long())[:, :T]
        if bool((torch.where(keep, slot, 0) < 0).any()) or bool((taken > 1).any()):
            raise ValueError("attn_infini places each token by its position: the kept positions of a row must be "
                             "distinct (and, while decoding, come after the cached ones)")
    return Layout(T, base, slot)


def place(x: Tensor, lay: Layout, held: Tensor | None = None) -> Tensor:
    """x (b, h, n, d) at its slots of a (b, h, T, d) layout, over `held` (b, h, N, d) in the first N slots."""
    b, h, n, d = x.shape
    if lay.slot is None:
        return F.pad(x, (0, 0, lay.offset, lay.T - lay.offset - n))
    room = x.new_zeros(lay.slot.shape[0], h, lay.T + 1, d)
    if held is not None:
        room[:, :, : held.shape[2]] = held.to(x.dtype)
    index = lay.slot[:, None, :, None].expand(-1, h, -1, d)
    return room.scatter(2, index, x.expand(lay.slot.shape[0], -1, -1, -1))[:, :, : lay.T]


def kept(keep: Tensor | None, lay: Layout, n: int, held: Summary | None) -> Tensor:
    """(b|1, T) bool: the slots holding a kept key."""
    if lay.slot is None:
        mask = torch.zeros(1, lay.T, dtype=torch.bool, device=lay.base.device)
        mask[:, lay.offset: lay.offset + n] = True
        return mask
    b = lay.slot.shape[0]
    keep = torch.ones(b, n, dtype=torch.bool, device=lay.slot.device) if keep is None else keep.expand(b, n)
    start = None if held is None else held["keep"][:, None, :, None].float()
    return place(keep[:, None, :, None].float(), lay, start)[:, 0, :, 0] > 0


def memories(sk: Tensor, v: Tensor, start: tuple[Tensor, Tensor], delta: bool) -> tuple[Tensor, Tensor]:
    """The memory before each segment: sk (b, hk, G, N, d) σ(K) (0 at unkept slots), v (b, hk, G, N, dv),
    start (M, z) -> M (b, hk, G, d, dv), z (b, hk, G, d)."""
    M, z = start
    if not delta:
        add, norm = sk.transpose(-1, -2) @ v, sk.sum(-2)
        before = torch.cat((torch.zeros_like(add[:, :, :1]), add[:, :, :-1].cumsum(2)), 2)
        norms = torch.cat((torch.zeros_like(norm[:, :, :1]), norm[:, :, :-1].cumsum(2)), 2)
        return M[:, :, None] + before, z[:, :, None] + norms
    Ms, zs = [], []
    for s in range(sk.shape[2]):
        Ms.append(M)
        zs.append(z)
        M, z = absorbed(M, z, sk[:, :, s], v[:, :, s], delta)
    return torch.stack(Ms, 2), torch.stack(zs, 2)


def absorbed(M: Tensor, z: Tensor, sk: Tensor, v: Tensor, delta: bool) -> tuple[Tensor, Tensor]:
    """M, z after one segment: sk (..., N, d) σ(K) (0 at unkept slots), v (..., N, dv)."""
    value = v - retrieve(sk, M, z) if delta else v
    return M + sk.transpose(-1, -2) @ value, z + sk.sum(-2)


def infini(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, keep: Tensor | None, *, gate: Tensor, segment: int,
           scale: float, delta: bool, dropout: float = 0.0, prefix: tuple[Tensor, Tensor, Tensor | None] | None = None,
           start: Summary | None = None, want_state: bool = False) -> tuple[Tensor, Summary | None]:
    """q (b, h, n, d), k (b, hk, n, d), v (b, hk, n, dv) of tokens at pos (b|1, n), keep (b, n) bool or None;
    gate β (h,); prefix: keys (b, hk, P, d), values and keep (b, P) every query sees. Returns out (b, h, n, dv),
    zero at padded positions, and (want_state) the summary after the last position, continuing `start` (a
    summary, or M and z alone: a memory carried from an earlier forward, its first segment the row's own)."""
    b, h, n, d = q.shape
    hk, dv, N = k.shape[1], v.shape[-1], segment
    held = start if start is not None and "k" in start else None          # else M and z alone: a carried memory
    lay = layout(pos, keep, held, N)
    T, G = lay.T, lay.T // N
    mask = kept(keep, lay, n, held)                                         # (b|1, T)
    Q = place(q, lay)
    K = place(k, lay, None if held is None else held["k"])
    V = place(v, lay, None if held is None else held["v"])
    B = max(K.shape[0], mask.shape[0])
    sk = sigma(upcast(K)) * mask[:, None, :, None]
    if start is None:
        M0, z0 = K.new_zeros(B, hk, d, dv, dtype=sk.dtype), K.new_zeros(B, hk, d, dtype=sk.dtype)
    else:
        M0, z0 = start["M"].to(sk.dtype), start["z"].to(sk.dtype)
    Ms, zs = memories(sk.reshape(B, hk, G, N, d), upcast(V).reshape(B, hk, G, N, dv), (M0, z0), delta)
    sq = sigma(upcast(Q)).reshape(b, hk, h // hk, G, N, d)
    mem = retrieve(sq, Ms[:, :, None], zs[:, :, None]).reshape(b, h, T, dv)
    local = _local(Q, K, V, mask, lay, N, prefix, scale, dropout)
    g = torch.sigmoid(upcast(gate)).view(1, h, 1, 1)
    out = (g * mem + (1 - g) * upcast(local)).to(q.dtype)
    if lay.slot is None:
        out = out[:, :, lay.offset: lay.offset + n]
    else:
        index = lay.slot.clamp(max=T - 1)[:, None, :, None].expand(-1, h, -1, dv)
        out = out.gather(2, index).masked_fill(~(lay.slot < T)[:, None, :, None], 0.0)
    if not want_state:
        return out, None
    flat = mask.expand(B, T)
    last = torch.where(flat, torch.arange(T, device=q.device), -1).amax(-1)     # the row's last kept slot
    L, rows = last.clamp(min=0) // N, torch.arange(B, device=q.device)
    state = {"M": Ms[rows, :, L], "z": zs[rows, :, L], "k": K.reshape(B, hk, G, N, d)[rows, :, L],
             "v": V.reshape(B, hk, G, N, dv)[rows, :, L], "keep": flat.reshape(B, G, N)[rows, L],
             "segment": torch.where(last >= 0, lay.base.expand(B) + L, -1)}
    return out, state


def closed(summary: Summary, delta: bool) -> Summary:
    """The memory after the summary's latest segment too, {"M", "z"}: what a forward hands to the next (its end
    closes its last segment; memory/infini_carry.py)."""
    M, z = summary["M"], summary["z"]
    sk = sigma(upcast(summary["k"])).to(M.dtype) * summary["keep"][:, None, :, None]
    M, z = absorbed(M, z, sk, upcast(summary["v"]).to(M.dtype), delta)
    return {"M": M, "z": z}


def _local(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor, lay: Layout, N: int, prefix: tuple | None, scale: float,
           dropout: float) -> Tensor:
    """Causal softmax attention inside each segment of the layout, and to the prefix keys: (b, h, T, dv)."""
    b, h, T, d = Q.shape
    hk, dv, G = K.shape[1], V.shape[-1], T // N
    if lay.slot is None and lay.offset == 0 and prefix is None and hk == h:    # segments as heads: a view
        out = F.scaled_dot_product_attention(Q.reshape(b, h * G, N, d), K.reshape(b, h * G, N, d),
                                             V.reshape(b, h * G, N, dv), dropout_p=dropout, is_causal=True,
                                             scale=scale)
        return out.reshape(b, h, T, dv)

    def split(x: Tensor) -> Tensor:                   # (b, h, T, e) -> (b, G, h, N, e)
        return x.unflatten(2, (G, N)).transpose(1, 2)

    q, k, v = split(Q), split(K), split(V)
    seen = None
    if lay.slot is not None or lay.offset or prefix is not None:
        inside = causal_keep(N, N, Q.device) & mask.reshape(-1, G, 1, N)
        seen = inside | torch.eye(N, dtype=torch.bool, device=Q.device)     # an empty slot's query sees itself
    if prefix is not None:
        pk, pv, pkeep = prefix
        P = pk.shape[2]
        k = torch.cat((pk[:, None].expand(-1, G, -1, -1, -1), k), -2)
        v = torch.cat((pv[:, None].expand(-1, G, -1, -1, -1), v), -2)
        pkeep = (torch.ones(1, P, dtype=torch.bool, device=Q.device) if pkeep is None else pkeep)
        pkeep = pkeep[:, None, None, :].expand(-1, G, N, -1)
        rows = max(seen.shape[0], pkeep.shape[0])
        seen = torch.cat((pkeep.expand(rows, -1, -1, -1), seen.expand(rows, -1, -1, -1)), -1)
    mask4 = None if seen is None else seen.expand(b, -1, -1, -1).reshape(b * G, 1, N, -1)
    out = F.scaled_dot_product_attention(q.reshape(b * G, h, N, d), k.reshape(b * G, hk, -1, d),
                                         v.reshape(b * G, hk, -1, dv), attn_mask=mask4, dropout_p=dropout,
                                         is_causal=seen is None, scale=scale, enable_gqa=hk != h)
    return out.reshape(b, G, h, N, dv).transpose(1, 2).reshape(b, h, T, dv)
