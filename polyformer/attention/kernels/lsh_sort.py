"""The Reformer's global sort (Kitaev et al. 2020, arXiv:2001.04451), as Hugging Face's
LSHSelfAttention computes it: per hash round, the sequence sorted by (bucket, position), the rounds
laid end to end and cut into chunks of `chunk` positions; chunk g attends to itself and to chunk
g - 1, cyclically over the whole run (the first chunk of a round sees the last of the round before,
the very first the very last), with the shared-QK self rule. Keys of other buckets that share a chunk
are seen too.

Where a chunk boundary falls depends on how many tokens, later ones included, hash to lower buckets:
in a causal stack a token's output depends on future tokens through the sort (the positions mask
keeps only the scores causal). Padding (masked tokens, and the positions added to reach a multiple
of `chunk`) sorts after every bucket, so it moves no boundary among the kept tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...precision import upcast
from .bucketed import NO_BUCKET, MaskedSoftmax, rows_of, sort_key


def _look_back(t: Tensor) -> Tensor:
    """(rows, C, c, ...) -> (rows, C, 2c, ...): each chunk preceded by the one before it, cyclically."""
    return torch.cat((t.roll(1, dims=1), t), dim=2)


def sorted_rounds(q: Tensor, k: Tensor, v: Tensor, buckets: Tensor, *, chunk: int, causal: bool, pos: Tensor,
                  mask: Tensor | None, scale: float, need_weights: bool = False) -> tuple[Tensor, ...]:
    """Self-attention of the n tokens of q (b, h, n, d) with shared keys k (b, h, n, d), values v
    (b, h, n, dv), buckets (b, h, rounds, n) in [0, 2**30), positions pos (b|1, n), mask (b, n) or
    None. Returns per round (out (b, h, rounds, n, dv) in q's dtype, lse (b, h, rounds, n) float32 of
    the scores other than the token's own, -inf when it sees no other key: then its own value is its
    output), and the weights (b, h, rounds, n, n) as a third element when need_weights."""
    b, h, n, d = q.shape
    dv, rounds, c, dtype, device = v.shape[-1], buckets.shape[2], chunk, q.dtype, q.device
    rows, size = b * h, -(-n // c) * c
    pad = size - n
    bucket = buckets.reshape(rows, rounds, n).long()
    p = torch.cat((rows_of(pos.long(), b, h, n), q.new_zeros(rows, pad, dtype=torch.long)), 1)
    keep = torch.ones(rows, n, dtype=torch.bool, device=device) if mask is None else rows_of(mask, b, h, n)
    keep = torch.cat((keep, keep.new_zeros(rows, pad)), 1)                    # (rows, size)
    bucket = torch.cat((bucket, bucket.new_full((rows, rounds, pad), NO_BUCKET)), 2)
    bucket = bucket.masked_fill(~keep[:, None], NO_BUCKET)
    order = sort_key(bucket, p[:, None]).sort(dim=2, stable=True)[1]   # (rows, rounds, size)

    # sorted slots in chunks of c, each reading its own chunk and the one before: which token sits where
    token = order.view(rows, rounds * size // c, c)
    near = _look_back(token)                                                  # (rows, C, 2c)
    row = torch.arange(rows, device=device)[:, None, None]
    visible = keep.gather(1, near.view(rows, -1)).view(near.shape)[:, :, None] & (near[:, :, None] != token[..., None])
    if causal:
        p_near = p.gather(1, near.view(rows, -1)).view(near.shape)
        visible = visible & (p_near[:, :, None] <= p.gather(1, token.view(rows, -1)).view(token.shape)[..., None])
    qf = (upcast(q) * scale).reshape(-1, d)
    kf, vf = upcast(k).reshape(-1, d), upcast(v).reshape(-1, dv)
    q_rows, k_rows = (row * n + token.clamp(max=n - 1)).view(-1), (row * n + near.clamp(max=n - 1)).view(-1)
    scores = torch.bmm(qf.index_select(0, q_rows).view(-1, c, d),
                       kf.index_select(0, k_rows).view(-1, 2 * c, d).transpose(1, 2))
    weights, lse = MaskedSoftmax.apply(scores, visible.view(-1, c, 2 * c))
    out = torch.bmm(weights, vf.index_select(0, k_rows).view(-1, 2 * c, dv))

    # back to each round's token order: token t of round r sits at slot r * size + back[r, t]
    back = torch.empty_like(order).scatter_(2, order, torch.arange(size, device=device).expand_as(order))
    back = (back[..., :n] + size * torch.arange(rounds, device=device)[:, None]).reshape(rows, rounds * n)
    seen = visible.any(-1).view(rows, -1).gather(1, back)
    alone = ~seen & keep[:, None, :n].expand(rows, rounds, n).reshape(rows, -1)       # its own key, when kept
    own = vf.view(rows, n, dv).repeat(1, rounds, 1) * alone[..., None]
    out = torch.where(seen[..., None], out.view(rows, -1, dv).gather(1, back[..., None].expand(-1, -1, dv)), own)
    lse = torch.where(seen, lse.view(rows, -1).gather(1, back), float("-inf")).view(b, h, rounds, n)
    out = out.view(b, h, rounds, n, dv).to(dtype)
    if not need_weights:
        return out, lse
    dense = weights.new_zeros(rows, rounds * size, size)
    dense.scatter_add_(2, near[:, :, None].expand(-1, -1, c, -1).reshape(rows, rounds * size, 2 * c),
                       weights.view(rows, rounds * size, 2 * c))
    dense = dense.gather(1, back[..., None].expand(-1, -1, size))[..., :n] * seen[..., None]
    self_weight = torch.eye(n, dtype=dense.dtype, device=device).repeat(rounds, 1)[None] * alone[..., None]
    return out, lse, (dense + self_weight).view(b, h, rounds, n, n).to(dtype)
