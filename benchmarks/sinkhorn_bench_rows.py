"""Sinkhorn attention's rows for the content-based attention benchmark (issue 18): polyformer's
`attn_sinkhorn` block, our dense block, and sinkhorn-transformer's `SinkhornSelfAttention` at equal
settings, each a `sparse_competitors.Contender` mapping (batch, n, 512) float32 to the same shape.
(`benchmarks/content_attention.py` did not exist when these were written; `contenders(n, causal)` is
what it would import.)

- polyformer: `Encoder` / `Decoder(dim=512, heads=8, custom_layers=("a",), attn_sinkhorn=True,
  attn_sinkhorn_bucket_size=64, attn_sinkhorn_iters=5, attn_sinkhorn_temperature=0.75)`.
- sinkhorn-transformer 0.11.4: `SinkhornSelfAttention(512, bucket_size=64, heads=8, dim_head=64,
  sinkhorn_iter=5, temperature=0.75)` inside `PackageLayer` (pre-LayerNorm, residual, final LayerNorm,
  as polyformer's block). Bidirectional: `non_permutative=False`, so it sorts by Gumbel-Sinkhorn as the
  paper and ours do (its default, True, takes a differentiable top-1 instead). Causal: its
  `SinkhornCausalAttention`, which has no Sinkhorn balancing at all (a masked differentiable top-k of
  cumulative-mean scores) and attends to `n_top_buckets` (1 here, the paper's) sorted blocks.

What the two compute differs beyond speed (checked on 0.11.4): sinkhorn-transformer's bidirectional
path draws Gumbel noise in eval too (two eval calls differ) and takes the sorted *values* from the sorted
keys (`b_v_r = b_k_r.reshape(...)`); every path needs n divisible by the bucket size; there is no
decode cache.

    python -m benchmarks.sinkhorn_bench_rows [--lengths 1024,4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from .common import set_threads
from .features import peak_step_bytes
from .linear_competitors import PackageLayer
from .sparse_competitors import DIM, DIM_HEAD, HEADS, Contender, polyformer
from .sparse_patterns import steps

BUCKET, ITERS, TEMPERATURE = 64, 5, 0.75


def ours(causal: bool) -> Contender:
    return polyformer(f"polyformer attn_sinkhorn {'causal' if causal else 'bidirectional'}", causal,
                      attn_sinkhorn=True, attn_sinkhorn_bucket_size=BUCKET, attn_sinkhorn_iters=ITERS,
                      attn_sinkhorn_temperature=TEMPERATURE,
                      note=f"bucket {BUCKET}, {ITERS} Sinkhorn iterations, temperature {TEMPERATURE}")


def dense(causal: bool) -> Contender:
    return polyformer(f"polyformer dense {'causal' if causal else 'bidirectional'}", causal,
                      note="fused dense attention")


def theirs(causal: bool, n: int) -> Contender:
    from sinkhorn_transformer import SinkhornSelfAttention

    torch.manual_seed(0)
    attn = SinkhornSelfAttention(DIM, BUCKET, n, heads=HEADS, dim_head=DIM_HEAD, causal=causal,
                                 non_permutative=False, sinkhorn_iter=ITERS, temperature=TEMPERATURE,
                                 n_top_buckets=1)
    layer = PackageLayer(attn)
    return Contender(f"sinkhorn-transformer {'causal' if causal else 'bidirectional'}", layer, layer, False,
                     "SinkhornSelfAttention, Gumbel-Sinkhorn sort" if not causal else "SinkhornCausalAttention")


def contenders(n: int, causal: bool) -> list[Contender]:
    """Ours first (the numerator of every ratio), then our dense block and sinkhorn-transformer's."""
    return [ours(causal), dense(causal), theirs(causal, n)]


def measure(c: Contender, n: int, repeats: int) -> dict[str, Any]:
    """Median fwd+bwd seconds over `repeats` calls after one warmup, and the peak bytes of one call."""
    train, _ = steps(c, n)
    train()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        train()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_mib": peak_step_bytes(train) / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    print("| n | direction | contender | fwd+bwd s | peak MiB | time ratio ours / it | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        for causal in (False, True):
            rows = [(c, measure(c, n, args.repeats)) for c in contenders(n, causal)]
            mine = rows[0][1]
            for c, r in rows:
                print(f"| {n} | {'causal' if causal else 'bidir'} | {c.name} | {r['seconds']:.3f} | "
                      f"{r['peak_mib']:.0f} | {mine['seconds'] / r['seconds']:.2f} | "
                      f"{mine['peak_mib'] / max(r['peak_mib'], 1e-9):.2f} |", flush=True)


if __name__ == "__main__":
    main()
