"""FLASH's mixed chunk attention (Hua et al. 2022, arXiv:2202.10447, section 3.2). Chunk g of a row
holds its positions [g c, (g + 1) c), so chunks follow each row's positions, not the tensor's layout
(a left-padded row is cut as it would be alone). A query meets the keys of its own chunk through relu²
attention and the keys of other chunks through plain linear attention:

    out_i = Σ_{j in chunk(i)} relu²(qq_i·kq_j / c) v_j + ql_i · Σ_{j in the linear chunks} kl_j v_jᵀ / N_i

as the paper's pseudo-code: the quadratic scores divided by the chunk size c inside relu², the linear
sum by the length. Causal: the linear chunks are the earlier ones, and j ≤ i inside the chunk;
bidirectional: every chunk, its own included (the paper's global term), and every key of the chunk.
Only kept keys count, and N_i is how many query i sees: the paper's n, per position, so that a decoder
knows it.

A decoder keeps a fixed-size `Summary`: Σ kl vᵀ over the chunks before the latest one and how many keys
they hold, and the latest chunk's keys and values (at most c of them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import checks
from ..attention.kernels.dense import causal_keep

# "kv" (b, s, e), "count" (b,): Σ kl vᵀ and the number of kept keys of the chunks before the latest one;
# "chunk" (b,): the latest chunk's index (-1: none yet); its keys "kq", "kl" (b, c, s), values "v" (b, c, e)
# and "keep" (b, c) bool, slot t holding position chunk·c + t
Summary = dict[str, Tensor]


def empty(b: int, c: int, s: int, e: int, like: Tensor) -> Summary:
    """Nothing seen yet: chunk -1 marks a row without a kept key."""
    long = dict(dtype=torch.long, device=like.device)
    return {"kv": like.new_zeros(b, s, e), "count": torch.zeros(b, **long), "chunk": torch.full((b,), -1, **long),
            "kq": like.new_zeros(b, c, s), "kl": like.new_zeros(b, c, s), "v": like.new_zeros(b, c, e),
            "keep": torch.zeros(b, c, dtype=torch.bool, device=like.device)}


def _slots(pos: Tensor, keep: Tensor, chunk: Tensor, c: int, held: Tensor) -> tuple[Tensor, Tensor, int]:
    """Each token's slot in a row-aligned layout whose slot t holds position base·c + t: base is the
    chunk the row's summary holds, else that of its first kept token. Padded tokens go to slot T, which
    is dropped. Returns slots (b, n), base (b,) and T, a multiple of c."""
    g = torch.div(pos, c, rounding_mode="floor")
    big = torch.iinfo(torch.long).max
    first = torch.where(keep, g, big).amin(-1)
    base = torch.where(chunk >= 0, chunk, torch.where(first == big, 0, first))
    slot = pos - base[:, None] * c
    last = int(torch.where(keep, slot, 0).amax())
    T = c * (last // c + 1)
    slot = torch.where(keep, slot, T)
    if not checks.values_hidden():
        taken = F.pad(held.long(), (0, T + 1 - c)).scatter_add(1, slot, keep.long())[:, :T]
        if bool((torch.where(keep, slot, 0) < 0).any()) or bool((taken > 1).any()):
            raise ValueError("gau_chunk places each token by its position: the kept positions of a row must be "
                             "distinct (and, while decoding, come after the cached ones)")
    return slot, base, T


def _place(new: Tensor, slot: Tensor, T: int, held: Tensor | None = None) -> Tensor:
    """new (b, n, d) at its slots of a (b, T, d) layout, over `held` (b, c, d) in the first c slots."""
    b, _, d = new.shape
    room = new.new_zeros(b, T + 1 - (0 if held is None else held.shape[1]), d)
    room = room if held is None else torch.cat((held.to(new.dtype), room), 1)
    return room.scatter(1, slot[..., None].expand(-1, -1, d), new)[:, :T]


def _exclusive(x: Tensor) -> Tensor:
    """Sums over the chunks before each one, along dim 1 (the running sum less each chunk's own: one buffer)."""
    return x.cumsum(1).sub_(x)


def mixed_chunk(qq: Tensor, ql: Tensor, kq: Tensor, kl: Tensor, v: Tensor, pos: Tensor, keep: Tensor | None,
                chunk: int, causal: bool, start: Summary | None = None) -> tuple[Tensor, Summary | None]:
    """qq, ql, kq, kl (b, n, s) the quadratic and linear queries and keys, v (b, n, e), pos (b|1, n),
    keep (b, n) bool (None: all) -> out (b, n, e), zero at padded positions, and (causal) the summary
    after the last position, continuing `start` (None: nothing before)."""
    b, n, s = qq.shape
    e, c = v.shape[-1], chunk
    if start is None and keep is None and _from_zero(pos):
        return _aligned(qq, ql, kq, kl, v, c, causal)
    pos = pos.expand(b, n)
    keep = torch.ones(b, n, dtype=torch.bool, device=qq.device) if keep is None else keep
    start = start if start is not None else empty(b, c, s, e, qq)
    slot, base, T = _slots(pos, keep, start["chunk"], c, start["keep"])
    G = T // c
    Qq, Ql = (_place(t, slot, T).reshape(b, G, c, s) for t in (qq, ql))
    Kq, Kl = (_place(t, slot, T, start[name]).reshape(b, G, c, s) for t, name in ((kq, "kq"), (kl, "kl")))
    V = _place(v, slot, T, start["v"]).reshape(b, G, c, e)
    mask = _place(keep[..., None].to(v.dtype), slot, T, start["keep"][..., None]).reshape(b, G, c) > 0
    out, P, before = _chunks(Qq, Ql, Kq, Kl, V, mask, causal, start)
    out = out.gather(1, slot.clamp(max=T - 1)[..., None].expand(-1, -1, e)).masked_fill(~keep[..., None], 0.0)
    if not causal:
        return out, None
    flat = mask.reshape(b, T)
    last = torch.where(flat, torch.arange(T, device=qq.device), -1).amax(-1)   # the row's last kept slot
    L, rows = last.clamp(min=0) // c, torch.arange(b, device=qq.device)
    return out, {"kv": P[rows, L], "count": before[rows, L], "chunk": torch.where(last >= 0, base + L, -1),
                 "kq": Kq[rows, L], "kl": Kl[rows, L], "v": V[rows, L], "keep": mask[rows, L]}


def _from_zero(pos: Tensor) -> bool:
    """Whether every row's positions are 0, 1, ..., n - 1 (a training forward): chunks are then views."""
    steps = torch.arange(pos.shape[-1], device=pos.device)
    return bool((pos == steps).all())


def _aligned(qq: Tensor, ql: Tensor, kq: Tensor, kl: Tensor, v: Tensor, c: int, causal: bool
             ) -> tuple[Tensor, Summary | None]:
    """mixed_chunk for unpadded rows at positions 0 .. n - 1 from nothing before: slot t holds position t,
    so the layout is the input itself (padded at the end to whole chunks), with no placing or gathering."""
    b, n, s = qq.shape
    T = -(-n // c) * c
    G, tail = T // c, T - n
    def chunks(t: Tensor) -> Tensor:          # a view when n is a whole number of chunks
        return (F.pad(t, (0, 0, 0, tail)) if tail else t).reshape(b, G, c, t.shape[-1])

    Qq, Ql, Kq, Kl, V = (chunks(t) for t in (qq, ql, kq, kl, v))
    mask = (torch.arange(T, device=qq.device) < n).reshape(1, G, c).expand(b, G, c)
    out, P, before = _chunks(Qq, Ql, Kq, Kl, V, mask, causal, whole=tail == 0)
    out = out[:, :n]
    if not causal:
        return out, None
    L = (n - 1) // c          # the last chunk: copies, so that a decode state does not hold the whole layout
    return out, {"kv": P[:, L].clone(), "count": before[:, L].clone(),
                 "chunk": torch.full((b,), L, dtype=torch.long, device=qq.device), "kq": Kq[:, L].clone(),
                 "kl": Kl[:, L].clone(), "v": V[:, L].clone(), "keep": mask[:, L].clone()}


def _chunks(Qq: Tensor, Ql: Tensor, Kq: Tensor, Kl: Tensor, V: Tensor, mask: Tensor, causal: bool,
            start: Summary | None = None, whole: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The mixed chunk form over chunked (b, G, c, .) queries, keys, values and their keep-mask (b, G, c):
    out (b, G c, e), and (causal) P, the Σ kl vᵀ before each chunk (b, G, s, e), and `before`, their key
    counts (b, G), continuing `start`. whole: every slot kept (no masking of keys needed)."""
    b, G, c, s = Qq.shape
    e = V.shape[-1]
    H = (Kl if whole else Kl * mask[..., None]).transpose(-1, -2) @ V          # (b, G, s, e) per chunk
    P = before = None
    seen = None if whole else mask[:, :, None, :]                             # (b, G, i, j) inside a chunk
    if causal:
        order = causal_keep(c, c, Qq.device)
        seen = order if seen is None else seen & order
        P, before = _exclusive(H), _exclusive(mask.long().sum(-1))          # keys of the earlier chunks; (b, G)
        if start is not None:
            P, before = start["kv"][:, None] + P, start["count"][:, None] + before
        N = before[..., None] + mask.long().cumsum(-1)                        # (b, G, c)
        lin = Ql @ P
    else:
        lin = Ql @ H.sum(1)[:, None]
        N = mask.long().sum((1, 2))[:, None, None]
    scores = F.relu(Qq @ Kq.transpose(-1, -2) / c).square()
    quad = (scores if seen is None else torch.where(seen, scores, 0.0)) @ V
    out = quad.add_(lin.div_(N.clamp(min=1)[..., None]))      # in place: both are products' fresh outputs
    return out.reshape(b, G * c, e), P, before


def decode(qq: Tensor, ql: Tensor, kq: Tensor, kl: Tensor, v: Tensor, pos: Tensor, keep: Tensor | None,
           chunk: int, memory: object) -> Tensor:
    """A causal decode step over a `Recurrent` (memory/recurrent.py): the step's output (b, n, e) from
    its summary; writes the summary after the step and after each of its last `memory.wanted` positions."""
    n, r = qq.shape[1], memory.wanted
    state, outs, trail = memory.summary, [], []
    for lo, hi in [(0, n - r)] * (n > r) + [(t, t + 1) for t in range(n - r, n)]:
        out, state = mixed_chunk(qq[:, lo:hi], ql[:, lo:hi], kq[:, lo:hi], kl[:, lo:hi], v[:, lo:hi], pos[:, lo:hi],
                                 None if keep is None else keep[:, lo:hi], chunk, True, state)
        outs.append(out)
        if hi > n - r:
            trail.append(state)
    memory.write(state, {name: torch.stack([t[name] for t in trail], 1) for name in state} if trail else None)
    return torch.cat(outs, 1)
