"""Mixture-of-experts feedforward (issue 23): training step time and peak memory of an 8-expert top-2 layer
against a dense feedforward of equal active parameters and against st-moe-pytorch at equal settings, and the
share of the layer's time spent outside the experts' matrix products (dispatch overhead).

    python -m benchmarks.moe [--quick] [--repeats 3] [--max-wait 30] [--threads 2] [--out-dir docs/moe]

writes docs/moe/benchmark.json and benchmark.md (docs/moe/moe.md explains the layer and the numbers).

One layer on x (1, n, 256) float32 that requires grad; a training step is forward and backward of a fixed
output gradient. Competitors: polyformer's MoE (`ff_moe=True`, E 8, top-2, experts of inner 512 = ff_mult 2,
GELU, capacity factor 1.25, balance loss reported), a dense FeedForward of inner 1024 (ff_mult 4: the two
active experts' parameters), st-moe-pytorch's `MoE` (E 8, gating_top_n 2, expert_hidden_mult 2,
capacity_factor_train 1.25; its own auxiliary losses added to the output's sum as ours are), and
"experts only": our experts' grouped matrix products alone on the already sorted tokens with the counts the
router and the capacity gave (forward and backward). Dispatch overhead = 1 - experts only / MoE layer. Time: alternating
rounds (`common.quiet_rounds`), medians; memory: `features.peak_step_bytes`. Targets (issue 23): MoE <= 1.5x
the dense step, at least as fast as st-moe-pytorch, dispatch overhead < 20% at 4k tokens.
--quick: n 1024, one round without warmup, output under /tmp unless --out-dir.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from polyformer.config import FeedForwardConfig
from polyformer.feedforward import FeedForward
from polyformer.interfaces import Context
from polyformer.keywords import parse_layers
from polyformer.moe.experts import dispatch
from polyformer.moe.layer import MoeFeedForward

from .common import (Competitor, environment, finish_report, log, markdown_table, one_shot_parser, quiet_rounds,
                     spread, started)
from .features import peak_step_bytes

DIM, EXPERTS, TOP_K, MULT, CAPACITY, SEQS = 256, 8, 2, 2, 1.25, (1024, 4096)


def ours() -> MoeFeedForward:
    torch.manual_seed(0)
    cfg = parse_layers(dict(dim=DIM, depth=1, ff_moe=True, ff_num_experts=EXPERTS, ff_moe_top_k=TOP_K, ff_mult=MULT,
                            ff_moe_capacity_factor=CAPACITY))
    return MoeFeedForward(DIM, cfg).train()


def st_moe() -> torch.nn.Module | None:
    try:
        from st_moe_pytorch import MoE
    except ImportError:
        return None
    torch.manual_seed(0)
    return MoE(dim=DIM, num_experts=EXPERTS, gating_top_n=TOP_K, expert_hidden_mult=MULT,
               capacity_factor_train=CAPACITY, capacity_factor_eval=CAPACITY).train()


def steps(x: torch.Tensor, grad: torch.Tensor) -> dict[str, Callable[[], None]]:
    """name -> one training step (forward, backward, gradients set to None first)."""
    moe = ours()
    dense = FeedForward(DIM, FeedForwardConfig(mult=MULT * TOP_K)).train()

    def run_moe() -> None:
        moe.zero_grad(set_to_none=True)
        ctx = Context(pos=torch.arange(x.shape[1])[None])
        out = moe(x, ctx)
        ((out * grad).sum() + ctx.losses.total()).backward()

    def run_dense() -> None:
        dense.zero_grad(set_to_none=True)
        dense(x).backward(grad)

    with torch.no_grad():       # the sorted tokens and counts of this input's kept choices, for the experts alone
        routing = moe.router(x.reshape(-1, DIM))
        keep = moe.limited(routing.experts.view(1, x.shape[1], TOP_K), x.new_ones(x.shape[:2], dtype=torch.bool), None)
        slots, tokens, counts = dispatch(routing.experts, keep.view(-1, TOP_K), EXPERTS)
        sorted_x = x.reshape(-1, DIM).index_select(0, tokens).detach().requires_grad_()
    sorted_grad = torch.randn(sorted_x.shape, generator=torch.Generator().manual_seed(2))

    def run_experts() -> None:
        moe.zero_grad(set_to_none=True)
        moe.experts.grouped(sorted_x, counts).backward(sorted_grad)

    out = {"polyformer MoE": run_moe, "dense (equal active)": run_dense, "experts only": run_experts}
    theirs = st_moe()
    if theirs is not None:
        def run_theirs() -> None:
            theirs.zero_grad(set_to_none=True)
            y, total_aux, _, _ = theirs(x)
            ((y * grad).sum() + total_aux).backward()

        out["st-moe-pytorch"] = run_theirs
    return out


def measure(seq: int, repeats: int, warmup: int, max_wait: float) -> dict[str, Any]:
    x = torch.randn(1, seq, DIM, generator=torch.Generator().manual_seed(0)).requires_grad_()
    grad = torch.randn(1, seq, DIM, generator=torch.Generator().manual_seed(1))
    runs = steps(x, grad)
    rows: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        run()
        rows[name] = {"peak_bytes": peak_step_bytes(run)}
        log(f"n {seq}, {name}: {rows[name]['peak_bytes'] / 2**20:.1f} MiB")
    competitors = [Competitor(name, run, seq) for name, run in runs.items()]
    quiet_rounds(competitors, repeats, warmup=warmup, max_wait=max_wait)
    for c in competitors:
        rows[c.name]["seconds"] = spread(c.seconds)
    t = {name: row["seconds"]["median"] for name, row in rows.items()}
    ratios = {"MoE / dense": t["polyformer MoE"] / t["dense (equal active)"],
              "dispatch overhead share": 1 - t["experts only"] / t["polyformer MoE"]}
    if "st-moe-pytorch" in t:
        ratios["MoE / st-moe-pytorch"] = t["polyformer MoE"] / t["st-moe-pytorch"]
    return {"rows": rows, "ratios": ratios}


def markdown(record: dict[str, Any]) -> str:
    parts = []
    for seq, point in record["points"].items():
        parts.append(f"### n = {seq} tokens")
        parts.append(markdown_table(["layer", "step (ms, median)", "tokens / s", "peak (MiB)"], [
            [name, f"{r['seconds']['median'] * 1e3:.1f}", f"{int(seq) / r['seconds']['median']:,.0f}",
             f"{r['peak_bytes'] / 2**20:.1f}"] for name, r in point["rows"].items()]))
        parts.append(", ".join(f"{k}: {v:.2f}" + ("" if "share" in k else "x") for k, v in point["ratios"].items()))
    env = record["environment"]
    return "\n\n".join([
        "# Mixture of experts: training step of one layer",
        f"dim {DIM}, E {EXPERTS}, top-{TOP_K}, expert inner {DIM * MULT}, capacity factor {CAPACITY}, float32, "
        f"{env['torch_threads']} threads; {env['cpu']}; torch {env['packages'].get('torch')}, st-moe-pytorch "
        f"{env['packages'].get('st-moe-pytorch')}; {env['date']}, commit {env['polyformer_commit']}. "
        "Method: `benchmarks/moe.py` (docstring).", *parts,
        "Targets (issue 23): MoE / dense <= 1.5x, MoE / st-moe-pytorch <= 1x, dispatch overhead share < 0.20 at "
        "4k tokens."])


def main(argv: list[str] | None = None) -> int:
    args = started(one_shot_parser("python -m benchmarks.moe", __doc__.split("\n\n")[0]), argv)
    seqs, repeats, warmup = ((1024,), 1, 0) if args.quick else (SEQS, args.repeats, 1)
    out_dir = args.out_dir or (Path("/tmp/moe") if args.quick else Path("docs/moe"))
    points = {str(seq): measure(seq, repeats, warmup, args.max_wait) for seq in seqs}
    record = {"points": points, "environment": environment(["torch", "st-moe-pytorch"])}
    return finish_report(out_dir / "benchmark.json", record, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
