"""Linear-time attention (issue 19): how polyformer's linear-time mixers scale with length against our dense
attention, how they compare with the PyPI packages users would pick instead, and what decoding with a
recurrent state costs per token.

    python -m benchmarks.linear_attention [--quick] [--only scaling,versus,decode] [--lengths 1024,...]
                                          [--contexts 1024,4096,16384] [--repeats 5] [--redo]
                                          [--mem-limit 16] [--out-dir docs/linear_attention]

dim 512, 8 heads of 64, batch 1, float32, 2 threads.

1. scaling: each mixer as one attention block (`custom_layers=("a",)`; in a Decoder where the mixer can
   be causal, else in an Encoder), training step and inference time and peak memory at n = 1k .. 32k, with
   our dense attention of the same direction measured in the same rounds. Reported: growth per doubling
   of n (target <= 2.2x) and the crossover, the smallest n where the mixer is faster than dense.
2. versus: the same block against performer-pytorch, linformer, nystrom-attention,
   linear-attention-transformer and FLASH-pytorch at equal settings (`benchmarks/linear_competitors.py`);
   ratios polyformer / package (< 1: ours faster or smaller). A package that cannot run a length is
   reported with its error.
3. decode: a 4-layer LM (dim 512, vocab 256) with attn_performer / attn_linear / attn_rfa against the same
   LM with dense attention and a KV cache: the state is filled with a prompt of the context's length, then
   single-token cached steps are timed (each followed by `state.rollback(1)`, so every step sees the same
   context); the decode state's bytes (`DecodeState.nbytes()`, and its recurrent summaries alone). Targets:
   time at 16k within 1.2x of 1k, recurrent memory constant.

Method (that of `benchmarks/sparse_patterns.py`): every contender of a point (section, n) is built once in
this process; the point times them in alternating rounds (one warmup call each, then each round runs every
contender's calls once, starting one further along each round) and takes medians; rounds in which other
processes used >= 0.25 CPUs are discarded and re-run after waiting up to --max-wait s, up to 3 x --repeats
rounds in all. Training step: forward and backward of a fixed output gradient, parameter gradients set to
None first. Inference: eval mode, `torch.no_grad()`. Memory: peak tensor bytes allocated during one call over
those live at its start (`features.peak_step_bytes`). The process's address space is capped at --mem-limit
GiB, so a contender that needs more fails with the allocator's error (reported) instead of the kernel's OOM
killer ending the run.

Every point is saved to `<out-dir>/linear_attention.json` (and the markdown twin rebuilt) as soon as it is
measured; a later run skips points already there unless --redo (a scaling point is measured again when a
mixer has landed since). --quick: n 512 and 1024, versus at 1024, contexts 256 and 1024, 1 round
without warmup, no waiting for quiet, output under /tmp unless --out-dir.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from .common import (Competitor, default_mem_limit, environment, log, measure_points, quiet_rounds, spread,
                     started)
from .features import peak_step_bytes
from .linear_competitors import FEATURES, RFA_FEATURES, VERSUS, available, dense, versus
from .linear_report import markdown
from .sparse_competitors import Contender, kernel_path
from .sparse_patterns import steps

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (512, 1024)
CONTEXTS = (1024, 4096, 16384)
QUICK_CONTEXTS = (256, 1024)
SECTIONS = ("scaling", "versus", "decode")
PACKAGES = ["torch", "performer-pytorch", "linformer", "nystrom-attention", "linear-attention-transformer",
            "FLASH-pytorch"]
VOCAB, DEPTH, STEP_TOKENS = 256, 4, 8
DECODERS: dict[str, dict[str, Any]] = {
    "dense (KV cache)": {},
    "performer": {"attn_performer": True, "attn_performer_features": FEATURES},
    "linear": {"attn_linear": "elu"},
    "rfa": {"attn_rfa": True, "attn_rfa_features": RFA_FEATURES},
}


# --- timing ---------------------------------------------------------------------------------------

def failure(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]


def timed_point(calls: dict[str, dict[str, Callable[[], Any]]], info: dict[str, dict[str, Any]], units: int,
                args: argparse.Namespace) -> dict[str, Any]:
    """Time every (contender, part) call of `calls` in alternating rounds; medians into `info`, in
    seconds per unit (a call does `units` of work: 1 block call, or that many decoded tokens)."""
    comps = [Competitor(f"{name} | {part}", fn, units) for name, parts in calls.items() for part, fn in parts.items()]
    log_ = quiet_rounds(comps, args.repeats, args.warmup, args.max_rounds, args.max_wait) if comps else []
    for comp in comps:
        name, part = comp.name.rsplit(" | ", 1)
        info[name][f"{part}_seconds"] = spread(comp.per_unit)
        info[name][f"{part}_cpu_seconds"] = statistics.median(comp.cpu_seconds) / units
        info[name][f"{part}_all_seconds"] = comp.per_unit
    return {"contenders": info, "rounds": len(log_), "quiet_rounds": sum(x["quiet"] for x in log_),
            "others_cpus": [round(max(x["others_cpus"].values()), 2) for x in log_]}


def block_point(cs: list[Contender], n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One point of sections 1 and 2: each contender's training step and inference call at length n. A
    call that fails (out of memory, a length the package refuses) is reported, not timed."""
    calls: dict[str, dict[str, Callable[[], Any]]] = {}
    info: dict[str, dict[str, Any]] = {}
    for c in cs:
        train, infer = steps(c, n)
        entry: dict[str, Any] = {"polyformer": c.polyformer, "params": c.params(), "note": c.note, "errors": {}}
        calls[c.name] = {}
        for part, fn in (("infer", infer), ("train", train)):
            try:
                out = fn()                           # first call (lazy init, index tables) outside the peak
                if part == "infer" and not torch.isfinite(out).all():
                    raise FloatingPointError("non-finite outputs")
                entry[f"{part}_peak_bytes"] = peak_step_bytes(fn)
                calls[c.name][part] = fn
            except Exception as err:                # reported per part: which call could not run, and why
                entry["errors"][part] = failure(err)
                log(f"  {c.name} {part}: {entry['errors'][part]}")
            gc.collect()
        if "infer" in calls[c.name]:
            entry["kernel"] = kernel_path(c, infer)
        info[c.name] = entry
        log(f"  {c.name}: " + ", ".join(f"{part} peak {entry[f'{part}_peak_bytes'] / 2 ** 20:.0f} MiB"
                                        for part in calls[c.name]))
    return timed_point(calls, info, 1, args)


# --- the sections ---------------------------------------------------------------------------------

def scaling_point(causal: bool, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Dense of one direction and every landed mixer that runs in it; notes for those not landed."""
    ready, missing = available()
    ours = [m for m in ready if m.causal() == causal]
    cs = [dense(causal)]
    for m in ours:
        try:
            cs.append(m.contender(n))
        except (ValueError, TypeError) as err:      # a mixer whose keywords changed while landing
            missing[m.name] = failure(err)
    return {**block_point(cs, n, args), "skipped": missing}


def decode_models(max_len: int) -> dict[str, torch.nn.Module]:
    """The LMs of section 3, built once: dense with a KV cache and each kernel with a recurrent state."""
    from polyformer import Decoder, TransformerWrapper

    out = {}
    for name, kw in DECODERS.items():
        torch.manual_seed(0)
        out[name] = TransformerWrapper(num_tokens=VOCAB, max_seq_len=max_len,
                                       attn_layers=Decoder(dim=512, depth=DEPTH, heads=8, **kw)).eval()
    return out


def decode_point(models: dict[str, torch.nn.Module], ctx: int, args: argparse.Namespace) -> dict[str, Any]:
    """Per-token time of single-token cached steps after a prompt of ctx tokens, and the state's bytes."""
    g = torch.Generator().manual_seed(ctx)
    prompt = torch.randint(0, VOCAB, (1, ctx), generator=g)
    token = torch.randint(0, VOCAB, (1, 1), generator=g)
    calls: dict[str, dict[str, Callable[[], Any]]] = {}
    info: dict[str, dict[str, Any]] = {}
    for name, net in models.items():
        entry: dict[str, Any] = {"polyformer": True, "keywords": DECODERS[name], "errors": {}}
        info[name] = entry
        try:
            state = net.new_state(1, ctx + 1)
            with torch.no_grad():
                net(prompt, state=state)

            def step(net: torch.nn.Module = net, state: Any = state) -> torch.Tensor:
                with torch.no_grad():
                    for _ in range(STEP_TOKENS):
                        logits = net(token, state=state)
                        state.rollback(1)
                return logits

            if not torch.isfinite(step()).all():
                raise FloatingPointError("non-finite logits")
            recurrent = sum(m.nbytes() for m in state.recurrent_layers.values())
            entry.update(state_bytes=state.nbytes(), recurrent_bytes=recurrent,
                         keys_bytes=state.k.numel() * state.k.element_size() + state.v.numel() * state.v.element_size(),
                         kinds=list(state.kinds), step_peak_bytes=peak_step_bytes(step))
            calls[name] = {"step": step}
        except Exception as err:
            entry["errors"]["step"] = failure(err)
            log(f"  {name}: {entry['errors']['step']}")
        gc.collect()
    return {**timed_point(calls, info, STEP_TOKENS, args), "step_tokens": STEP_TOKENS}


# --- command line ---------------------------------------------------------------------------------

def plan(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], Callable[[], dict[str, Any]]]]:
    """(key, fields, measure) of every point the run covers, in order."""
    out: list[tuple[str, dict[str, Any], Callable[[], dict[str, Any]]]] = []
    if "scaling" in args.sections:
        for n in args.lengths:
            for causal in (True, False):
                direction = "causal" if causal else "bidirectional"
                out.append((f"scaling-{direction}@{n}", {"section": "scaling", "group": direction, "n": n},
                            lambda causal=causal, n=n: scaling_point(causal, n, args)))
    if "versus" in args.sections:
        for which in VERSUS:
            for n in args.versus_lengths:
                out.append((f"versus-{which}@{n}", {"section": "versus", "group": which, "n": n},
                            lambda which=which, n=n: versus_point(which, n, args)))
    if "decode" in args.sections:
        models: dict[str, torch.nn.Module] = {}
        for ctx in args.contexts:
            def measure(ctx: int = ctx) -> dict[str, Any]:
                if not models:
                    models.update(decode_models(max(*args.contexts, *CONTEXTS) + 1))   # same weights every run
                return decode_point(models, ctx, args)
            out.append((f"decode@{ctx}", {"section": "decode", "group": "decode", "n": ctx}, measure))
    return out


def versus_point(which: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    cs, why = versus(which, n)
    if not cs:
        log(f"  skipped: {why}")
        return {"contenders": {}, "rounds": 0, "quiet_rounds": 0, "others_cpus": [], "skipped": {which: why}}
    return block_point(cs, n, args)


def up_to_date(point: dict[str, Any]) -> bool:
    """A recorded point stays unless a mixer has landed since (scaling) or it was skipped (versus)."""
    if point["section"] == "scaling":
        ready, _ = available()
        wanted = {f"polyformer {m.name}" for m in ready if m.causal() == (point["group"] == "causal")}
        return wanted <= set(point["contenders"])
    return not point.get("skipped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.linear_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run to check the script, output under /tmp")
    parser.add_argument("--only", help=f"comma-separated sections ({', '.join(SECTIONS)})")
    parser.add_argument("--lengths", help="scaling lengths (default 1024,...,32768)")
    parser.add_argument("--versus-lengths", help="lengths of the package comparisons (default: --lengths)")
    parser.add_argument("--contexts", help="decode contexts (default 1024,4096,16384)")
    parser.add_argument("--repeats", type=int, help="undisturbed rounds per point (default 5; quick 1)")
    parser.add_argument("--warmup", type=int, help="warmup calls per contender before the rounds (default 1; "
                                                   "quick 0: the peak-memory calls have warmed it up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-wait", type=float, help="seconds to wait for quiet after a disturbed round "
                                                        "(default 120; quick 0)")
    parser.add_argument("--mem-limit", type=float, default=default_mem_limit(),
                        help="GiB of address space for the process (default 3/4 of available, <= 32; 0: none)")
    parser.add_argument("--redo", action="store_true", help="re-measure points already in the record")
    parser.add_argument("--out-dir", help="default docs/linear_attention (quick: /tmp/linear_attention_quick)")
    args = started(parser, argv)

    def ints(text: str | None, default: tuple[int, ...]) -> list[int]:
        return [int(v) for v in text.split(",")] if text else list(default)

    args.sections = [s.strip() for s in args.only.split(",")] if args.only else list(SECTIONS)
    if set(args.sections) - set(SECTIONS):
        raise SystemExit(f"--only: pick from {', '.join(SECTIONS)}")
    args.lengths = ints(args.lengths, QUICK_LENGTHS if args.quick else LENGTHS)
    args.versus_lengths = ints(args.versus_lengths, (1024,) if args.quick else tuple(args.lengths))
    args.contexts = ints(args.contexts, QUICK_CONTEXTS if args.quick else CONTEXTS)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.max_rounds = args.repeats if args.quick else 3 * args.repeats
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    args.max_wait = args.max_wait if args.max_wait is not None else (0.0 if args.quick else 120.0)
    out_dir = Path(args.out_dir or ("/tmp/linear_attention_quick" if args.quick else "docs/linear_attention"))
    points = [(key, lambda fields=fields, measure=measure: {**fields, **measure(), "repeats": args.repeats})
              for key, fields, measure in plan(args)]
    return measure_points(out_dir / "linear_attention.json", points, redo=args.redo, repeats=args.repeats,
                          env=environment(PACKAGES), markdown=markdown, kept=up_to_date,
                          mem_limit_gib=args.mem_limit)


if __name__ == "__main__":
    sys.exit(main())
