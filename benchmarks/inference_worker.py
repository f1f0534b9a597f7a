"""One inference measurement in a fresh process: build one library's model, run a batch-1 forward
of `--length` tokens `warmup + repeats` times under `torch.inference_mode`, print one JSON line.

    python -m benchmarks.inference_worker --library polyformer --length 4096 [--repeats 2]
        [--warmup 1] [--threads 2] [--limit-gib 12]

The address space is capped first (`RLIMIT_AS`), so a model that would need more memory fails an
allocation and reports "out of memory" instead of pushing the machine into swap or the OOM killer.
Memory is read from /proc/self/status: `VmRSS` just before the first forward is the baseline
(interpreter, libraries, weights, input); `VmHWM` is reset there (writing 5 to
/proc/self/clear_refs) and read after the last forward, so `forward_peak` is the high-water mark
of resident memory the forwards added.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import warnings


def status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def is_out_of_memory(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, MemoryError) or "can't allocate memory" in text or "out of memory" in text \
        or "std::bad_alloc" in text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.inference_worker")
    p.add_argument("--library", required=True)
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--max-seq-len", type=int, default=None, help="model's max_seq_len (default: --length)")
    p.add_argument("--repeats", type=int, default=2, help="timed forwards (at least 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards first (their memory counts)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit-gib", type=float, default=12.0)
    args = p.parse_args(argv)

    limit = int(args.limit_gib * 2 ** 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    warnings.filterwarnings("ignore")

    import torch

    from .common import set_threads
    from .training import build

    set_threads(args.threads)
    result: dict = {"library": args.library, "length": args.length, "threads": args.threads,
                    "limit_gib": args.limit_gib, "repeats": args.repeats}
    try:
        model = build(args.library, args.max_seq_len or args.length).eval()
        x = torch.randint(0, 256, (1, args.length), generator=torch.Generator().manual_seed(0))
        result["baseline_rss_mib"] = status_kib("VmRSS") / 1024
        result["peak_reset"] = reset_peak()
        seconds = []
        with torch.inference_mode():
            for _ in range(args.warmup + args.repeats):
                start = time.perf_counter()
                out = model(x)
                logits = out.logits if hasattr(out, "logits") else out
                float(logits[0, -1, 0])
                seconds.append(time.perf_counter() - start)
                del out, logits
        timed = seconds[args.warmup:]
        result.update(status="ok", warmup_seconds=seconds[:args.warmup], seconds=timed,
                      median_seconds=statistics.median(timed))
    except (RuntimeError, MemoryError) as err:
        if not is_out_of_memory(err):
            raise
        result.update(status="oom", error=str(err).splitlines()[0][:300])
    result["peak_rss_mib"] = status_kib("VmHWM") / 1024
    if "baseline_rss_mib" in result:
        result["forward_peak_mib"] = result["peak_rss_mib"] - result["baseline_rss_mib"]
    result["load_average"] = list(os.getloadavg())
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
