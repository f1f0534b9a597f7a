"""One efficiency measurement in a fresh process: a variant's layer stack alone (`build_layers`),
forward + backward of a random (1, length, dim) float32 input, `warmup + repeats` times; prints one
`RESULT {json}` line.

    python -m benchmarks.arena.tasks.efficiency_worker --variant dense --depth 1 --length 4096
        [--repeats 1] [--warmup 1] [--threads 2] [--limit-gib 12] [--dim 512] [--heads 8] [--causal]
        [--seed 0]

The address space is capped first (`RLIMIT_AS`), so a run that would need more memory fails an
allocation and reports "oom" instead of swapping or meeting the OOM killer. The variant's
environment switches hold from before the build to the end (polyformer reads them at call time).
Memory is read from /proc/self/status: `VmRSS` after building the stack and the input is the
baseline (interpreter, libraries, weights, input); `VmHWM` is reset there and read after the last
step, so `peak_mib` is the resident high-water mark that the forwards and backwards added
(activations, attention buffers, gradients), warmup steps included.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import traceback
import warnings
from typing import Any

from ...inference_worker import is_out_of_memory, reset_peak, status_kib

PRIMER = 16            # tokens of the untimed first step before the baseline (see measure), or the variant's min_len


def mib(field: str) -> float:
    """A /proc/self/status memory field (VmRSS, VmHWM) in MiB; NaN where there is none."""
    try:
        return status_kib(field) / 1024
    except (OSError, KeyError):
        return float("nan")


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def measure(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Build, step and fill `result` in place (so that a failure part-way keeps the baseline)."""
    import torch

    from ...common import OthersMeter, time_once
    from ..harness import build_layers, parameters, variant_env
    from ..variants import variant

    v = variant(args.variant)
    with variant_env(v):
        try:
            model = build_layers(v, dim=args.dim, depth=args.depth, heads=args.heads, causal=args.causal,
                                 seed=args.seed)
        except ValueError as err:          # a variant the stack cannot hold (causal-only in an Encoder)
            result.update(status=f"cannot run: {err}")
            return
        model.train()
        result["parameters"] = parameters(model)
        # the same input for every variant: drawn from its own generator, not the weights' seed stream
        gen = torch.Generator().manual_seed(args.seed + 1)
        x = torch.randn(1, args.length, args.dim, generator=gen).requires_grad_(True)

        def step(x: torch.Tensor = x) -> None:
            out = model(x)
            out.sum().backward()
            # dropped (not zeroed) so every step allocates its gradients alike, the first included
            model.zero_grad(set_to_none=True)
            x.grad = None

        # one untimed step on PRIMER tokens first: one-time costs of the first call (loading a compiled
        # kernel and its OpenMP runtime, autograd's engine; 88 MiB for dense, 14 MiB on SDPA, at any
        # length) join the baseline, so the peak is what the length costs, not what the process does once
        primer = min(max(PRIMER, v.min_len), args.length)       # a variant's shortest input (BigBird's blocks)
        step(torch.randn(1, primer, args.dim, generator=gen).requires_grad_(True))
        result["baseline_rss_mib"] = mib("VmRSS")
        result["peak_reset"] = reset_peak()
        warm = [time_once(step)[0] for _ in range(args.warmup)]
        meter = OthersMeter().start()
        timed = [time_once(step) for _ in range(args.repeats)]
        # other processes' CPU use while timing: on a shared machine, how far to trust the seconds
        result["others_cpus"] = meter.cpus()
        result["peak_mib"] = mib("VmHWM") - result["baseline_rss_mib"] if result["peak_reset"] else None
        result.update(status="ok", warmup_seconds=warm, all_seconds=[w for w, _ in timed],
                      cpu_seconds=[c for _, c in timed], seconds=statistics.median(w for w, _ in timed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.arena.tasks.efficiency_worker")
    p.add_argument("--variant", required=True)
    p.add_argument("--depth", type=int, required=True)
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--repeats", type=int, default=1, help="timed steps (at least 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (their memory counts)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit-gib", type=float, default=12.0)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--causal", action="store_true", help="a Decoder stack (default: Encoder)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")

    # before torch is imported: its own start-up allocations are then under the cap too
    limit = int(args.limit_gib * 2 ** 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    warnings.filterwarnings("ignore")

    from ...common import set_threads

    set_threads(args.threads)
    result: dict[str, Any] = {"variant": args.variant, "depth": args.depth, "length": args.length,
                              "dim": args.dim, "heads": args.heads, "causal": args.causal,
                              "threads": args.threads, "limit_gib": args.limit_gib,
                              "warmup": args.warmup, "repeats": args.repeats}
    try:
        measure(args, result)
    except (RuntimeError, MemoryError) as err:
        if not is_out_of_memory(err):
            traceback.print_exc()
            result.update(status=f"error: {first_line(err)}")
        else:
            result.update(status="oom", error=first_line(err))
    except Exception as err:               # noqa: BLE001 - reported in the row, with the trace on stderr
        traceback.print_exc()
        result.update(status=f"error: {first_line(err)}")
    result["peak_rss_mib"] = mib("VmHWM")
    if result["status"] != "ok" and result.get("peak_reset") and "baseline_rss_mib" in result:
        result["peak_mib"] = result["peak_rss_mib"] - result["baseline_rss_mib"]   # how far it got
    result["load_average"] = list(os.getloadavg())
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
