"""Greedy cached decoding speed: polyformer against x-transformers and Hugging Face GPT-2 of the
same shape (issue 3), plus polyformer's KV-cache size and speed for attn_kv_heads 8 / 2 / 1.

    python -m benchmarks.generation [--repeats 5] [--new-tokens 256] [--out docs/benchmarks/generation.json]

Batch 1, a random 16-token prompt, decoder dim 512 / depth 6 / 8 heads / vocab 256, random weights
(nothing is downloaded), float32, one CPU thread. Every competitor is timed once per round, rounds
alternate the order, and the median over rounds is reported. ms/token is the wall time of one whole
`generate` call (prompt prefill included) divided by the new tokens.

The default generate takes the tuned decode step (`generate.fast.fast_step`: input-major copies of the
expanding weights, the common blocks as one call each; equal to the module path up to float rounding,
issue 26). Targets: >= 1.3x HF GPT-2 and >= 1.6x
x-transformers at batch 1, int8 weights >= 3x HF GPT-2; batch 8 and a 1k-token context are reported too
(`generation_extra.py`), with the default step's per-token overhead outside its matrix products.

Before timing, polyformer's cached greedy tokens are checked against an uncached recomputation
(cache_kv=False); a mismatch is printed loudly and makes the run exit with status 1.

The two "reference" rows are not competitors: one matrix-vector product per weight matrix of the
same model per token (no attention, norms or sampling), with the weights in nn.Linear's (out, in)
layout, and with the expanding ones as (in, out) copies - the weight-streaming cost any float32
implementation pays, which bounds what removing Python overhead can gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import (Competitor, alternating_rounds, environment, log, markdown_table, set_threads,
                     spread, write_report)
from .generation_extra import (INT8, INT8_TARGET, TARGET, extra_lines, floor_note, int8_lines, run_scenarios,
                               step_overhead)

DIM, DEPTH, HEADS, VOCAB, MAX_SEQ_LEN = 512, 6, 8, 256, 512
LAYOUT = "polyformer input-major weights"


# --- the competitors --------------------------------------------------------------------------

def polyformer_model(kv_heads: int | None = None, seed: int = 0, max_seq_len: int = MAX_SEQ_LEN) -> torch.nn.Module:
    from polyformer import AutoregressiveWrapper, Decoder, TransformerWrapper

    torch.manual_seed(seed)
    extra = {} if kv_heads in (None, HEADS) else {"attn_kv_heads": kv_heads}
    net = TransformerWrapper(num_tokens=VOCAB, max_seq_len=max_seq_len,
                             attn_layers=Decoder(dim=DIM, depth=DEPTH, heads=HEADS, **extra))
    return AutoregressiveWrapper(net).eval()


def transformed_model(transform: str, seed: int = 0) -> torch.nn.Module:
    """The float32 model with its weights stored for decoding by `polyformer.<transform>` applied
    to its net: "input_major" (the same values, another memory layout) or "quantize_int8" (int8
    per row)."""
    import polyformer

    model = polyformer_model(seed=seed)
    getattr(polyformer, transform)(model.net)
    return model


def int8_agreement(fp32: torch.nn.Module, int8: torch.nn.Module, prompt: Tensor, new: int) -> dict[str, Any]:
    """How far int8 weights move greedy decoding: the first token where the two greedy runs part,
    and, teacher-forced on the float32 run's sequence, the share of positions whose top-1 agrees and
    the relative error of the logits."""
    a = fp32.generate(prompt, new, temperature=0.0)
    b = int8.generate(prompt, new, temperature=0.0)
    differ = (a != b)[0].nonzero()
    seq = torch.cat((prompt, a), dim=1)[:, :-1]
    with torch.no_grad():
        la, lb = fp32.net(seq)[:, prompt.shape[1] - 1:], int8.net(seq)[:, prompt.shape[1] - 1:]
    return {"first_divergence": int(differ[0]) if len(differ) else None, "tokens": new,
            "teacher_forced_top1_agreement": float((la.argmax(-1) == lb.argmax(-1)).float().mean()),
            "logits_relative_error": float((la - lb).norm() / la.norm())}


def x_transformers_model(seed: int = 0, max_seq_len: int = MAX_SEQ_LEN) -> torch.nn.Module:
    import x_transformers as xt

    torch.manual_seed(seed)
    net = xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=max_seq_len,
                                attn_layers=xt.Decoder(dim=DIM, depth=DEPTH, heads=HEADS))
    return xt.AutoregressiveWrapper(net).eval()


def gpt2_model(seed: int = 0, max_seq_len: int = MAX_SEQ_LEN) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    # token 0 is pad; no eos, so generation never stops early (min_new_tokens makes sure of it too)
    cfg = GPT2Config(n_embd=DIM, n_layer=DEPTH, n_head=HEADS, vocab_size=VOCAB, n_positions=max_seq_len,
                     bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def polyformer_run(model: torch.nn.Module, prompt: Tensor, new: int) -> Callable[[], Tensor]:
    return lambda: model.generate(prompt, new, temperature=0.0)


def x_transformers_run(model: torch.nn.Module, prompt: Tensor, new: int) -> Callable[[], Tensor]:
    return lambda: model.generate(prompt, new, temperature=0.0, cache_kv=True)


def gpt2_run(model: torch.nn.Module, prompt: Tensor, new: int) -> Callable[[], Tensor]:
    keep = torch.ones_like(prompt)

    def run() -> Tensor:
        out = model.generate(prompt, attention_mask=keep, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, use_cache=True)
        return out[:, prompt.shape[1]:]
    return run


def floor_run(model: torch.nn.Module, new: int, expanding_transposed: bool = False) -> Callable[[], None]:
    """One matrix-vector product per weight matrix of `model` per token, nothing else.

    Plain: F.linear on the (out, in) weights nn.Linear holds. expanding_transposed: the matrices
    with out > in (q|k|v, feedforward in) as (in, out) copies through torch.addmm - on some CPUs
    (this AMD EPYC with MKL) that gemv streams the weights about 1.8x faster, while the shrinking
    ones (feedforward out) are faster as they are."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, lin.in_features) for lin in linears]
    plan = []
    for lin, x in zip(linears, inputs):
        w = lin.weight.detach()
        b = lin.bias.detach() if lin.bias is not None else torch.zeros(lin.out_features)
        if expanding_transposed and lin.out_features > lin.in_features:
            plan.append((torch.addmm, (b, x, w.t().contiguous())))
        else:
            plan.append((F.linear, (x, w, b)))

    @torch.no_grad()
    def run() -> None:
        for _ in range(new):
            for fn, args in plan:
                fn(*args)
    return run


def stream_run(model: torch.nn.Module, new: int) -> Callable[[], None]:
    """Read as many bytes as the model's matrix weights once per token (`torch.sum` over one buffer
    of that size): the memory-bandwidth floor of float32 batch-1 decoding on this machine, below any
    matrix-vector product."""
    numel = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    buf = torch.randn(numel)

    @torch.no_grad()
    def run() -> None:
        for _ in range(new):
            buf.sum()
    return run


# --- checks and cache size --------------------------------------------------------------------

def check_tokens(name: str, out: Tensor, new: int) -> None:
    if tuple(out.shape) != (1, new):
        raise RuntimeError(f"{name} generated shape {tuple(out.shape)}, expected (1, {new})")


def check_greedy(model: torch.nn.Module, prompt: Tensor, new: int) -> dict[str, Any]:
    """Cached greedy tokens against an uncached recomputation of the same greedy decode."""
    cached = model.generate(prompt, new, temperature=0.0, cache_kv=True)
    uncached = model.generate(prompt, new, temperature=0.0, cache_kv=False)
    differ = (cached != uncached)[0].nonzero()
    result: dict[str, Any] = {"equal": not len(differ), "tokens": new}
    if len(differ):
        t = int(differ[0])
        seq = torch.cat((prompt, cached[:, :t]), dim=1)
        with torch.no_grad():
            logits = model.net(seq)[0, -1]
        top2 = logits.topk(2).values
        result.update(first_mismatch=t, mismatches=len(differ),
                      cached_token=int(cached[0, t]), uncached_token=int(uncached[0, t]),
                      top2_logit_gap=float(top2[0] - top2[1]))
    return result


def cache_bytes(model: torch.nn.Module, prompt: Tensor, new: int) -> dict[str, int]:
    """Sizes of the DecodeState that `generate` itself allocates (captured, not rebuilt)."""
    net = model.net
    states = []
    make = net.new_state

    def capture(*args: Any, **kwargs: Any) -> Any:
        states.append(make(*args, **kwargs))
        return states[-1]

    net.new_state = capture            # instance attribute, removed below: the class is untouched
    try:
        model.generate(prompt, new, temperature=0.0)
    finally:
        del net.new_state
    if len(states) != 1:
        raise RuntimeError(f"expected generate to allocate one DecodeState, saw {len(states)}")
    s = states[0]
    kv = s.k.nbytes + s.v.nbytes
    return {"kv_bytes": kv, "total_bytes": kv + s.pos.nbytes + s.mask.nbytes,
            "shape_k": list(s.k.shape), "shape_v": list(s.v.shape), "dtype": str(s.k.dtype)}


# --- the run ----------------------------------------------------------------------------------

def mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


def variant_name(kv_heads: int) -> str:
    return "polyformer" if kv_heads == HEADS else f"polyformer kv_heads={kv_heads}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generation", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (the median is reported)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-heads", default="8,2,1", help="attn_kv_heads values for the second table")
    p.add_argument("--no-int8", action="store_true", help="leave out the int8-weights row")
    p.add_argument("--skip-check", action="store_true", help="skip the cached == uncached token check")
    p.add_argument("--no-settings", action="store_true", help="leave out batch 8, the 1k context and the overhead")
    p.add_argument("--out", default="docs/benchmarks/generation.json")
    return p.parse_args(argv)


def report(args: argparse.Namespace, competitors: list[Competitor], references: list[Competitor],
           kv_list: list[int], caches: dict[str, dict], checks: dict[str, Any], load_start: list[float] | None,
           agreement: dict[str, Any] | None = None, scenarios: dict | None = None,
           overhead: dict | None = None) -> tuple[str, dict[str, Any]]:
    """The markdown page and the JSON record."""
    everyone = competitors + references
    ms = {c.name: c.median_per_unit() * 1e3 for c in everyone}
    cpu = {c.name: statistics.median(c.cpu_seconds) / c.units * 1e3 for c in everyone}
    ours = ms["polyformer"]
    anchors = [c for c in competitors if not c.name.startswith("polyformer")]
    variants = [c for c in competitors if c.name in (LAYOUT, INT8)]
    rows = [[c.name, f"{ms[c.name]:.2f}", f"{1e3 / ms[c.name]:.1f}",
             f"{ms[c.name] / ours:.2f}x" if c in anchors or c.name == "polyformer" else "-",
             " / ".join(f"{ms[a.name] / ms[c.name]:.2f}x" for a in anchors) if c in variants else "-",
             f"{cpu[c.name]:.2f}"]
            for c in [competitors[0], *variants, *anchors, *references]]
    speed_table = markdown_table(["library", "ms/token", "tokens/s", "polyformer speedup",
                                  "variant speedup (" + " / ".join(a.name for a in anchors) + ")",
                                  "CPU ms/token"], rows)
    kv_rows = [[str(k), mib(caches[str(k)]["kv_bytes"]), mib(caches[str(k)]["total_bytes"]),
                f"{ms[variant_name(k)]:.2f}", f"{1e3 / ms[variant_name(k)]:.1f}"] for k in kv_list]
    kv_table = markdown_table(["attn_kv_heads", "KV cache (k + v)", "state total", "ms/token", "tokens/s"], kv_rows)

    vs = {c.name: ms[c.name] / ours for c in anchors}
    met = all(r >= TARGET.get(name, 1.0) for name, r in vs.items())
    layout_vs = {c.name: ms[c.name] / ms[LAYOUT] for c in anchors} if LAYOUT in ms else {}
    bad = {k: v for k, v in checks.items() if not v["equal"]}
    env = environment(["torch", "polyformer", "x-transformers", "transformers", "einops"])
    env["load_average_start"] = load_start
    new = args.new_tokens
    setup = (f"batch 1, prompt {args.prompt_len} tokens, {new} new tokens, greedy; dim {DIM}, depth {DEPTH}, "
             f"{HEADS} heads, vocab {VOCAB}, float32, random weights; {env['torch_threads']} thread(s); "
             f"median of {args.repeats} alternating rounds after 1 warmup each. ms/token = wall time of one "
             f"whole generate call (prefill included) / {new}.")
    busy = ""
    if load_start is not None and load_start[0] > max(1.0, (env["cpu_count"] or 1) - args.threads):
        busy = (f"\n\nNote: the machine was busy (1-min load average {load_start[0]:.1f} at the start on "
                f"{env['cpu_count']} cores); wall times are inflated and noisy, CPU ms/token less so.")
    correctness = ("skipped" if not checks else
                   "ok for attn_kv_heads " + ", ".join(checks) + f" ({new} tokens each)" if not bad else
                   "**MISMATCH** " + json.dumps(bad))
    lines = ["# Greedy generation benchmark", "", setup, "",
             f"CPU: {env['cpu']}; python {env['python']}; "
             + ", ".join(f"{k} {v}" for k, v in env["packages"].items())
             + f"; polyformer commit {env['polyformer_commit']}." + busy,
             "", "Command: `python -m benchmarks.generation" + (f" --repeats {args.repeats}" if args.repeats != 5 else "")
             + (f" --new-tokens {new}" if new != 256 else "")
             + (f" --out {args.out}" if args.out != "docs/benchmarks/generation.json" else "") + "`", "",
             speed_table, "",
             "Target (issue 26): default polyformer >= " + " and ".join(f"{v}x {k}" for k, v in TARGET.items())
             + ": " + ("met" if met else "**not met**") + " (" + ", ".join(f"{k} {v:.2f}x" for k, v in vs.items()) + ")."
             + (" With the expanding weights input-major (`input_major`, same float32 values): "
                + ", ".join(f"{k} {v:.2f}x" for k, v in layout_vs.items()) + "." if layout_vs else "")
             + floor_note(ms, anchors), "",
             "Reference rows are not competitors: one matrix-vector product per weight matrix of the same "
             "model per token and nothing else, i.e. the weight-streaming cost of float32 decoding at batch 1: "
             "with every weight in nn.Linear's (out, in) layout, and with the expanding matrices (q|k|v, "
             "feedforward in) as (in, out) copies through torch.addmm; and reading the same number of bytes "
             "once (`torch.sum` over a buffer of that size), the memory-bandwidth floor no float32 decoder "
             "can go below.", "",
             *int8_lines(ms, anchors, agreement),
             *extra_lines(scenarios, overhead),
             "## polyformer KV cache by attn_kv_heads", "",
             f"`DecodeState` allocated by `generate` for {args.prompt_len + new} positions, batch 1, float32; "
             "state total adds the positions and padding mask.", "", kv_table, "",
             "Correctness (polyformer cached greedy tokens == uncached greedy recomputation): " + correctness]
    record = {
        "benchmark": "generation", "setup": setup,
        "config": {"dim": DIM, "depth": DEPTH, "heads": HEADS, "vocab": VOCAB, "max_seq_len": MAX_SEQ_LEN,
                   "prompt_len": args.prompt_len, "new_tokens": new, "repeats": args.repeats,
                   "threads": args.threads, "dtype": "float32"},
        "environment": env,
        "results": {c.name: {"ms_per_token": spread([t * 1e3 for t in c.per_unit]),
                             "tokens_per_s": 1e3 / ms[c.name], "cpu_ms_per_token": cpu[c.name],
                             "seconds": c.seconds, "cpu_seconds": c.cpu_seconds}
                    for c in everyone},
        "speedup_vs": vs, "input_major_speedup_vs": layout_vs, "target": TARGET, "target_met": met,
        "int8_target_vs_hf": INT8_TARGET, "settings_ms_per_token": scenarios, "step_overhead": overhead,
        "kv_cache": {str(k): {**caches[str(k)], "ms_per_token": ms[variant_name(k)]} for k in kv_list},
        "correctness": checks, "int8_agreement": agreement,
    }
    return "\n".join(lines), record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    warnings.filterwarnings("ignore")
    new = args.new_tokens
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    torch.manual_seed(1234)
    prompt = torch.randint(1, VOCAB, (1, args.prompt_len))
    kv_list = [int(k) for k in args.kv_heads.split(",")]
    poly = {k: polyformer_model(k) for k in sorted(set(kv_list) | {HEADS}, reverse=True)}
    competitors = [Competitor("polyformer", polyformer_run(poly[HEADS], prompt, new), new),
                   Competitor("x-transformers", x_transformers_run(x_transformers_model(), prompt, new), new),
                   Competitor("HF GPT-2", gpt2_run(gpt2_model(), prompt, new), new)]
    competitors += [Competitor(variant_name(k), polyformer_run(poly[k], prompt, new), new)
                    for k in kv_list if k != HEADS]
    competitors.append(Competitor(LAYOUT, polyformer_run(transformed_model("input_major"), prompt, new), new))
    if not args.no_int8:
        quantized = transformed_model("quantize_int8")
        competitors.append(Competitor(INT8, polyformer_run(quantized, prompt, new), new))
    references = [Competitor("reference: matvecs only, (out, in) weights", floor_run(poly[HEADS], new), new),
                  Competitor("reference: matvecs only, expanding weights (in, out)",
                             floor_run(poly[HEADS], new, expanding_transposed=True), new),
                  Competitor("reference: streaming the weight bytes once", stream_run(poly[HEADS], new), new)]

    for c in competitors:
        check_tokens(c.name, c.run(), new)
    checks: dict[str, Any] = {}
    if not args.skip_check:
        for k in kv_list:
            log(f"checking cached == uncached greedy tokens, attn_kv_heads={k} ...")
            checks[str(k)] = check_greedy(poly[k], prompt, new)
    caches = {str(k): cache_bytes(poly[k], prompt, new) for k in kv_list}
    agreement = None if args.no_int8 else int8_agreement(poly[HEADS], quantized, prompt, new)

    everyone = competitors + references
    log(f"timing {len(everyone)} runs x {args.repeats} rounds, {new} new tokens each ...")
    alternating_rounds(everyone, args.repeats, warmup=1, log=log)

    scenarios = overhead = None
    if not args.no_settings:
        overhead = step_overhead(poly[HEADS], args.prompt_len + new // 2)
        scenarios = run_scenarios({"polyformer": (polyformer_model, polyformer_run),
                                   "x-transformers": (x_transformers_model, x_transformers_run),
                                   "HF GPT-2": (gpt2_model, gpt2_run)}, args.repeats)
    markdown, record = report(args, competitors, references, kv_list, caches, checks, load_start, agreement,
                              scenarios, overhead)
    json_path, md_path = write_report(args.out, record, markdown)
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")
    bad = {k: v for k, v in checks.items() if not v["equal"]}
    if bad:
        print("\n" + "!" * 72 + "\nCORRECTNESS FAILURE: polyformer's cached greedy tokens differ from the "
              f"uncached recomputation:\n{json.dumps(bad, indent=2)}\n" + "!" * 72, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
