"""LSH attention (the Reformer, Kitaev et al. 2020, arXiv:2001.04451), a kernel of form "direct".

Angular LSH: per head and hash round a random rotation R (d, n_buckets / 2) puts x in bucket
argmax([xR; -xR]), so vectors at a small angle share a bucket. A query attends to the keys of its
bucket near it in a sort by (bucket, position); `n_hashes` rounds with independent rotations are
combined as Σ_r exp(lse_r - logsumexp_r lse_r) out_r, lse_r the log-normaliser of round r.

Which keys are near (attn_lsh_global_sort):
- False (default): each bucket's keys in order of position, cut into chunks of `bucket_size`; a query
  sees its bucket's keys in its chunk and the one before (`bucketed.py`). Causal, what a query sees
  depends on earlier tokens only, and a decode step applies the same rule to the cached keys, so
  cached == uncached exactly.
- True: the paper's global sort, as Hugging Face computes it (`lsh_sort.py`): the whole sequence
  sorted, cut into chunks of `bucket_size` positions. In a Decoder it leaks the future through the
  sort (the chunk boundaries depend on later tokens' buckets); it cannot decode with a state.

Shared QK (attn_shared_qk, the paper's setting): the keys are the queries' projection normalised
(attention/projection.py, `shared_keys`), and a query sees its own key only when no other key is
visible to it. Without it, queries and keys are hashed apart (bucketed form only).

Rotations: with attn_lsh_seed, drawn from a torch.Generator seeded with it (the same for every layer,
as Hugging Face's hash_seed); otherwise drawn afresh on every forward in training, and in eval from a
generator seeded with the layer's index, so eval is deterministic. attn_lsh_n_buckets None: about
2 n / bucket_size buckets (even) for n keys, which a Decoder cannot use (the buckets of cached keys
would change as the sequence grows): it must name a number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ... import checks
from ...config import LayersConfig
from ...interfaces import KV, AttnOut, Caps, KernelSpec
from ...precision import upcast
from .bucketed import bucketed
from .dense import match_heads
from .lsh_sort import sorted_rounds


@dataclass(frozen=True)
class LshOptions:
    bucket_size: int = 64               # keys per chunk
    n_hashes: int = 4                   # hash rounds
    seed: int | None = None             # fixed rotations (every layer alike); None: redrawn in training
    n_buckets: int | None = None        # even; None: about 2 n / bucket_size (an Encoder only)
    global_sort: bool = False           # the paper's / Hugging Face's global sort (leaks in a Decoder)
    shared_qk: bool = False             # keys are the normalised queries (the projection reads this)


def lsh_buckets(x: Tensor, rotations: Tensor) -> Tensor:
    """Angular LSH of x (b, h, n, d) under rotations (h, d, rounds, n_buckets / 2): bucket ids
    (b, h, rounds, n) in [0, n_buckets), argmax([xR; -xR])."""
    rotated = torch.einsum("bhnd,hdrk->bhrnk", upcast(x), rotations.to(upcast(x).dtype))
    return torch.cat((rotated, -rotated), -1).argmax(-1)


def combine_rounds(out: Tensor, lse: Tensor) -> Tensor:
    """out (b, h, r, i, e), lse (b, h, r, i) -> (b, h, i, e): each round weighted by its share of the
    normaliser, exp(lse_r - logsumexp_r lse_r). Rounds that saw no key (lse -inf) weigh nothing; a
    query that saw none in any round takes their plain mean (its own value under the shared-QK rule)."""
    none = torch.isinf(lse).all(2, keepdim=True)
    share = torch.softmax(torch.where(none, torch.zeros_like(lse), lse), dim=2)
    return (share[..., None] * upcast(out)).sum(2).to(out.dtype)


class Lsh(nn.Module):
    """LSH attention of q (b, h, i, d) over kv.k (b, hk, j, d), kv.v (b, hk, j, dv); the queries are
    the last i keys (self-attention). A decode state keeps every key (decode="keys")."""

    caps = Caps(exact=False, bias=False, causal=True, bidirectional=True, padding=True, decode="keys",
                form="direct", tolerance=1e-5)   # equals dense attention (with the self rule) when one bucket
                                                 # and one chunk hold every key
    options: type = LshOptions
    eval_seed = 0       # eval rotations without attn_lsh_seed: generator seed eval_seed + layer

    def __init__(self, spec: KernelSpec):
        super().__init__()
        o: LshOptions = spec.options
        self.heads, self.dim, self.scale, self.layer = spec.heads, spec.dim_qk, spec.scale, spec.layer
        self.bucket_size, self.n_hashes, self.seed = o.bucket_size, o.n_hashes, o.seed
        self.n_buckets, self.global_sort, self.shared_qk = o.n_buckets, o.global_sort, o.shared_qk
        self._fixed: dict[tuple[int, str], Tensor] = {}

    @staticmethod
    def check(options: LshOptions, cfg: LayersConfig) -> list[str]:
        o, a = options, cfg.attention
        found = checks.whole(o.bucket_size, "attn_lsh_bucket_size") + checks.whole(o.n_hashes, "attn_lsh_n_hashes")
        found += checks.whole(o.n_buckets, "attn_lsh_n_buckets", 2, optional=True)
        if isinstance(o.n_buckets, int) and o.n_buckets % 2:
            found.append(f"attn_lsh_n_buckets must be even (a rotation gives n_buckets / 2 directions and their "
                         f"opposites), got {o.n_buckets}")
        if o.seed is not None and (not isinstance(o.seed, int) or isinstance(o.seed, bool)):
            found.append(f"attn_lsh_seed must be an integer or None, got {o.seed!r}")
        for name, value in (("attn_lsh_global_sort", o.global_sort), ("attn_shared_qk", o.shared_qk)):
            found += checks.flag(value, name)
        if cfg.causal and o.n_buckets is None:
            found.append("attn_lsh in a Decoder (causal=True) needs attn_lsh_n_buckets: buckets that follow the length "
                         "would change as decoding goes on (about 2 * the longest length / attn_lsh_bucket_size, even)")
        if o.global_sort is True and o.shared_qk is not True:
            found.append("attn_lsh_global_sort=True sorts one shared query-key vector per position: it needs "
                         "attn_shared_qk=True")
        if o.shared_qk is True and a.collab_heads:
            found.append("attn_shared_qk=True makes each head's keys its own queries; attn_collab_heads shares one key "
                         "projection across heads")
        if o.shared_qk is True and a.kv_heads is not None:
            found.append("attn_shared_qk=True makes each head's keys its own queries (one key head per query head); "
                         "it cannot combine with attn_kv_heads / attn_one_kv_head")
        if a.num_mem_kv:
            found.append("attn_num_mem_kv adds keys without a position or a hash bucket; attn_lsh cannot place them")
        if a.dropout:
            found.append("attn_dropout cannot combine with attn_lsh (not implemented for its chunked weights)")
        return found

    def rotations(self, n_buckets: int, device: torch.device) -> Tensor:
        """(h, d, n_hashes, n_buckets / 2), float32: the random rotations of this call."""
        shape = (self.heads, self.dim, self.n_hashes, n_buckets // 2)
        if self.seed is None and self.training:
            return torch.randn(shape, device=device)
        key = (n_buckets, str(device))
        if key not in self._fixed:
            seed = self.seed if self.seed is not None else self.eval_seed + self.layer
            self._fixed[key] = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)
        return self._fixed[key]

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        b, h, i, _ = q.shape
        k, v = match_heads(kv.k, h), match_heads(kv.v, h)
        j = k.shape[2]
        n_buckets = self.n_buckets or max(2, 2 * -(-j // self.bucket_size))
        rotations = self.rotations(n_buckets, q.device)
        k_bucket = lsh_buckets(k, rotations)                                  # (b, h, rounds, j)
        if self.global_sort:
            if j != i:
                raise ValueError("attn_lsh_global_sort=True sorts the queries' own sequence: it cannot read cached "
                                 "keys (decode with cache_kv=False) or XL memories")
            found = sorted_rounds(q, k, v, k_bucket, chunk=self.bucket_size, causal=causal, pos=q_pos,
                                  mask=kv.mask, scale=self.scale, need_weights=need_weights)
        else:
            q_bucket = k_bucket[..., -i:] if self.shared_qk else lsh_buckets(q, rotations)
            r = self.n_hashes
            found = bucketed(q, k, v, q_bucket.reshape(b, h * r, i), k_bucket.reshape(b, h * r, j),
                             chunk=self.bucket_size, causal=causal, q_pos=q_pos, k_pos=kv.pos, k_mask=kv.mask,
                             scale=self.scale, exclude_self=self.shared_qk, need_weights=need_weights)
            found = tuple(t.view(b, h, r, *t.shape[2:]) for t in found)
        out = combine_rounds(found[0], found[1])
        if not need_weights:
            return AttnOut(out)
        return AttnOut(out, weights=combine_rounds(found[2], found[1]))
