"""Routing attention's rows for the content-based attention benchmark (to join
`benchmarks/content_attention.py`'s list of competitors once it exists): one causal attention block,
dim 512, 8 heads, at length n, each a `sparse_competitors.Contender` mapping (batch, n, 512) to the same.

- polyformer routing: `Decoder(custom_layers=("a",), attn_routing=True, attn_routing_clusters=n // WINDOW,
  attn_routing_window=WINDOW)`: every head routes; a query sees its cluster's keys in its chunk of WINDOW
  and the chunk before (up to 2 WINDOW keys, earlier positions only).
- polyformer dense: the same block with dense causal attention.
- routing-transformer 1.6.1 (PyPI): its `SelfAttention(dim, depth=1, max_seq_len=n, heads=8,
  local_attn_heads=0, window_size=WINDOW, causal=True)` (n // WINDOW clusters, as ours), each cluster
  taking its WINDOW nearest tokens of the whole sequence (which leaks the future), inside the pre-norm,
  residual and final norm polyformer's block has. Its k-means initialises itself on the first training
  call (its #4: an untrained layer cannot run in eval), so the first call is a training one.

    python -m benchmarks.routing_bench_rows --lengths 1024 4096     # a brief run, printed as a table
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from torch import Tensor, nn

from .common import Competitor, log, quiet_rounds, set_threads, version
from .features import peak_step_bytes
from .sparse_competitors import DIM, DIM_HEAD, HEADS, Contender, polyformer

WINDOW = 64


class RoutingTransformerLayer(nn.Module):
    """routing-transformer's attention layer with polyformer's block around it: x + attn(norm(x)), final norm."""

    def __init__(self, n: int, window: int) -> None:
        super().__init__()
        from routing_transformer.routing_transformer import SelfAttention

        self.norm, self.final_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = SelfAttention(DIM, 1, n, HEADS, 0, window, dim_head=DIM_HEAD, causal=True)
        self.aux = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        out, self.aux = self.attn(self.norm(x))
        return self.final_norm(x + out)


def contenders(n: int, window: int = WINDOW) -> list[Contender]:
    """polyformer routing and dense, and routing-transformer's layer, at length n (a multiple of window)."""
    clusters = max(1, n // window)
    out = [polyformer("polyformer routing", True, attn_routing=True, attn_routing_clusters=clusters,
                      attn_routing_window=window,
                      note=f"Decoder(custom_layers=('a',), attn_routing_clusters={clusters}, "
                           f"attn_routing_window={window})"),
           polyformer("polyformer dense", True, note="Decoder(custom_layers=('a',))")]
    if version("routing-transformer") is not None:
        torch.manual_seed(0)
        layer = RoutingTransformerLayer(n, window).train()
        out.append(Contender("routing-transformer SelfAttention", layer, layer, False,
                             f"routing-transformer {version('routing-transformer')}, {clusters} clusters, "
                             f"window_size={window}"))
    return out


def steps(c: Contender, n: int, batch: int = 1) -> tuple[Any, Any]:
    """(training step: forward + backward of the block and its auxiliary loss, inference: eval forward)."""
    x = torch.randn(batch, n, DIM, generator=torch.Generator().manual_seed(0))

    def train() -> Tensor:
        c.module.train()
        out = c.call(x)
        loss = out.square().mean() + getattr(c.module, "aux", 0.0)
        loss.backward()
        c.module.zero_grad(set_to_none=True)
        return out.detach()

    def infer() -> Tensor:
        c.module.eval()
        with torch.no_grad():
            return c.call(x)

    return train, infer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    set_threads(args.threads)
    rows = []
    for n in args.lengths:
        comps, peaks = [], {}
        for c in contenders(n):
            train, infer = steps(c, n)
            train()                                     # lazy init (routing-transformer's k-means) outside the peak
            peaks[c.name] = peak_step_bytes(train)
            comps.append(Competitor(c.name, train, 1))
        quiet_rounds(comps, args.repeats, warmup=0, max_wait=30)
        ours = {c.name: c for c in comps}["polyformer routing"]
        for c in comps:
            t = statistics.median(c.seconds)
            rows.append((n, c.name, t, peaks[c.name] / 2 ** 20, statistics.median(ours.seconds) / t,
                         peaks["polyformer routing"] / max(peaks[c.name], 1)))
            log(f"n={n} {c.name}: {t:.3f} s, peak {peaks[c.name] / 2 ** 20:.0f} MiB")
    print("| n | contender | fwd+bwd s | peak MiB | ours / it (time) | ours / it (memory) |")
    print("|---|---|---|---|---|---|")
    for n, name, t, mib, rt, rm in rows:
        print(f"| {n} | {name} | {t:.3f} | {mib:.0f} | {rt:.2f} | {rm:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
