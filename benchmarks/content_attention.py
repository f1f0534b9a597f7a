"""Content-based sparse attention (issue 18): one causal attention block of each family (LSH, Routing,
Sinkhorn: `benchmarks/content_competitors.FAMILIES`) against our dense attention and against
the layers of the packages users would pick, at equal settings.

    python -m benchmarks.content_attention [--quick] [--families lsh] [--lengths 1024,4096,16384]
                                           [--repeats 3] [--redo] [--out-dir docs/content_attention]

dim 512, 8 heads of 64, batch 1, float32, 2 threads. Per point (family, n): a training step (forward and
backward of a fixed output gradient) and an inference call (eval, no_grad) of every contender, timed in
alternating rounds in this one process (`benchmarks/linear_attention.block_point`: one warmup call each,
rounds disturbed by other processes re-run), medians; peak memory is the tensor bytes allocated during one
call over those live at its start. Ratios are polyformer / other (< 1: ours faster or smaller). A contender
that cannot run a length (memory, a length its package refuses) is reported with its error.

Every point is saved to `<out-dir>/content_attention.json` (and the markdown twin rebuilt) once measured; a
later run skips points already there unless --redo. --quick: n 1024, 1 round, output under /tmp.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from .common import default_mem_limit, environment, markdown_table, measure_points, started
from .content_competitors import CHUNK, FAMILIES, HASHES, dense
from .linear_attention import block_point

LENGTHS = (1024, 4096, 16384)
PACKAGES = ["torch", "reformer-pytorch", "transformers", "routing-transformer", "sinkhorn-transformer"]


def measure(family: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """The record's point (family, n)."""
    fam = next(f for f in FAMILIES if f.name == family)
    cs, missing = fam.contenders(n)
    return {"family": family, "n": n, **block_point([dense(), *cs], n, args), "skipped": missing,
            "repeats": args.repeats}


def median(c: dict[str, Any], part: str) -> float | None:
    s = c.get(f"{part}_seconds")
    return None if s is None else s["median"]


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}"


def markdown(record: dict[str, Any]) -> str:
    out = ["# Content-based attention: one causal attention block", "",
           f"dim 512, 8 heads of 64, batch 1, float32, {record['environment'].get('torch_threads')} threads; "
           f"LSH: chunks of {CHUNK}, {HASHES} hash rounds, n / {CHUNK} buckets, shared QK. Times are medians of "
           "alternating rounds in one process; ratios are polyformer / other (< 1: ours faster or smaller). "
           "Measured by `python -m benchmarks.content_attention`.", ""]
    for key, p in sorted(record["points"].items(), key=lambda kv: (kv[1]["family"], kv[1]["n"])):
        cs = p["contenders"]
        ours = [name for name, c in cs.items() if c["polyformer"] and "dense" not in name]
        others = [name for name in cs if name not in ours]
        out += [f"## {p['family']} at n = {p['n']} ({p['quiet_rounds']}/{p['rounds']} quiet rounds)", ""]
        rows = [[name, f"{median(c, 'train') * 1e3:.0f}" if median(c, "train") else "failed",
                 f"{median(c, 'infer') * 1e3:.0f}" if median(c, "infer") else "failed",
                 f"{c['train_peak_bytes'] / 2 ** 20:.0f}" if c.get("train_peak_bytes") else "-",
                 "; ".join(f"{k}: {v}" for k, v in c.get("errors", {}).items())] for name, c in cs.items()]
        out += [markdown_table(["contender", "fwd+bwd ms", "inference ms", "fwd+bwd peak MiB", "errors"], rows), ""]
        ratio_rows = []
        for mine in ours:
            for other in others:
                a, b = cs[mine], cs[other]
                ratio_rows.append([mine, other, ratio(median(a, "train"), median(b, "train")),
                                   ratio(median(a, "infer"), median(b, "infer")),
                                   ratio(a.get("train_peak_bytes"), b.get("train_peak_bytes"))])
        out += [markdown_table(["polyformer", "against", "fwd+bwd time", "inference time", "fwd+bwd peak memory"],
                               ratio_rows), ""]
        notes = [f"- {name}: {c['note']}" for name, c in cs.items() if c.get("note")]
        notes += [f"- skipped {k}: {v}" for k, v in p.get("skipped", {}).items()]
        out += notes + [""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.content_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n 1024, one round, output under /tmp")
    parser.add_argument("--families", help=f"comma-separated ({', '.join(f.name for f in FAMILIES)})")
    parser.add_argument("--lengths", help="default 1024,4096,16384")
    parser.add_argument("--repeats", type=int, help="undisturbed rounds per point (default 3; quick 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-wait", type=float, help="seconds to wait for quiet after a disturbed round (default 60)")
    parser.add_argument("--mem-limit", type=float, default=default_mem_limit(), help="GiB of address space (0: none)")
    parser.add_argument("--redo", action="store_true", help="re-measure points already in the record")
    parser.add_argument("--out-dir", help="default docs/content_attention (quick: /tmp/content_attention_quick)")
    args = started(parser, argv)
    families = args.families.split(",") if args.families else [f.name for f in FAMILIES]
    lengths = [int(v) for v in args.lengths.split(",")] if args.lengths else ([1024] if args.quick else list(LENGTHS))
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.max_rounds = args.repeats if args.quick else 3 * args.repeats
    args.warmup = 0 if args.quick else 1
    args.max_wait = args.max_wait if args.max_wait is not None else (0.0 if args.quick else 60.0)
    out_dir = Path(args.out_dir or ("/tmp/content_attention_quick" if args.quick else "docs/content_attention"))
    points = [(f"{family}@{n}", functools.partial(measure, family, n, args)) for family in families for n in lengths]
    return measure_points(out_dir / "content_attention.json", points, redo=args.redo, repeats=args.repeats,
                          env=environment(PACKAGES), markdown=markdown, mem_limit_gib=args.mem_limit)


if __name__ == "__main__":
    sys.exit(main())
