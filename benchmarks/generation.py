"""Greedy cached decoding speed: polyformer against x-transformers and Hugging Face GPT-2 of the
same shape (issue 3), plus polyformer's KV-cache size and speed for attn_kv_heads 8 / 2 / 1.

    python -m benchmarks.generation [--repeats 5] [--new-tokens 256] [--out docs/benchmarks/generation.json]

Batch 1, a random 16-token prompt, decoder dim 512 / depth 6 / 8 heads / vocab 256, random weights
(nothing is downloaded), float32, one CPU thread. Every competitor is timed once per round, rounds
alternate the order, and the median over rounds is reported. ms/token is the wall time of one whole
`generate` call (prompt prefill included) divided by the new tokens.

Before timing, polyformer's cached greedy tokens are checked against an uncached recomputation
(cache_kv=False); a mismatch is printed loudly and makes the run exit with status 1.

The "floor" row is not a competitor: it is one F.linear per weight matrix of the same model per
token (no attention, norms or sampling) - the weight-streaming cost any float32 implementation
with this weight layout pays, which bounds what removing Python overhead can gain.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import (Competitor, alternating_rounds, environment, markdown_table, set_threads,
                     spread, write_report)

DIM, DEPTH, HEADS, VOCAB, MAX_SEQ_LEN = 512, 6, 8, 256, 512
TARGET = 3.0


# --- the competitors --------------------------------------------------------------------------

def polyformer_model(kv_heads: int | None = None, seed: int = 0) -> torch.nn.Module:
    from polyformer import AutoregressiveWrapper, Decoder, TransformerWrapper

    torch.manual_seed(seed)
    extra = {} if kv_heads in (None, HEADS) else {"attn_kv_heads": kv_heads}
    net = TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_SEQ_LEN,
                             attn_layers=Decoder(dim=DIM, depth=DEPTH, heads=HEADS, **extra))
    return AutoregressiveWrapper(net).eval()


def x_transformers_model(seed: int = 0) -> torch.nn.Module:
    import x_transformers as xt

    torch.manual_seed(seed)
    net = xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_SEQ_LEN,
                                attn_layers=xt.Decoder(dim=DIM, depth=DEPTH, heads=HEADS))
    return xt.AutoregressiveWrapper(net).eval()


def gpt2_model(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    # token 0 is pad; no eos, so generation never stops early (min_new_tokens makes sure of it too)
    cfg = GPT2Config(n_embd=DIM, n_layer=DEPTH, n_head=HEADS, vocab_size=VOCAB, n_positions=MAX_SEQ_LEN,
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


def floor_run(model: torch.nn.Module, new: int) -> Callable[[], None]:
    """One F.linear per weight matrix of `model` per token, chained through a (1, 512) vector."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, lin.in_features) for lin in linears]

    @torch.no_grad()
    def run() -> None:
        for _ in range(new):
            for lin, x in zip(linears, inputs):
                F.linear(x, lin.weight, lin.bias)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generation", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-heads", default="8,2,1", help="attn_kv_heads values for the second table")
    p.add_argument("--skip-check", action="store_true", help="skip the cached == uncached token check")
    p.add_argument("--out", default="docs/benchmarks/generation.json")
    args = p.parse_args(argv)
    set_threads(args.threads)
    warnings.filterwarnings("ignore")
    new, log = args.new_tokens, lambda msg: print(msg, file=sys.stderr, flush=True)

    torch.manual_seed(1234)
    prompt = torch.randint(1, VOCAB, (1, args.prompt_len))
    kv_list = [int(k) for k in args.kv_heads.split(",")]
    poly = {k: polyformer_model(k) for k in kv_list}
    main_kv = HEADS if HEADS in poly else None
    poly_main = poly[HEADS] if main_kv else polyformer_model()
    xt_model, hf_model = x_transformers_model(), gpt2_model()

    competitors = [Competitor("polyformer", polyformer_run(poly_main, prompt, new), new),
                   Competitor("x-transformers", x_transformers_run(xt_model, prompt, new), new),
                   Competitor("HF GPT-2", gpt2_run(hf_model, prompt, new), new)]
    variants = [Competitor(f"polyformer kv_heads={k}", polyformer_run(poly[k], prompt, new), new)
                for k in kv_list if k != HEADS]
    floor = Competitor("floor (F.linear only)", floor_run(poly_main, new), new)
    everyone = competitors + variants + [floor]

    for c in competitors + variants:
        check_tokens(c.name, c.run(), new)
    checks: dict[str, Any] = {}
    if not args.skip_check:
        for k, model in poly.items():
            log(f"checking cached == uncached greedy tokens, kv_heads={k} ...")
            checks[str(k)] = check_greedy(model, prompt, new)
    caches = {str(k): cache_bytes(model, prompt, new) for k, model in poly.items()}

    log(f"timing {len(everyone)} runs x {args.repeats} rounds, {new} new tokens each ...")
    alternating_rounds(everyone, args.repeats, warmup=1, log=log)

    ms = {c.name: c.median_per_unit() * 1e3 for c in everyone}
    ours = ms["polyformer"]
    rows = []
    for c in competitors + [floor]:
        ratio = ms[c.name] / ours
        rows.append([c.name, f"{ms[c.name]:.2f}", f"{1e3 / ms[c.name]:.1f}",
                     "-" if c is floor else f"{ratio:.2f}x"])
    speed_table = markdown_table(["library", "ms/token", "tokens/s", "polyformer speedup"], rows)

    kv_rows = []
    for k in kv_list:
        name = "polyformer" if k == HEADS else f"polyformer kv_heads={k}"
        cb = caches[str(k)]
        kv_rows.append([str(k), mib(cb["kv_bytes"]), mib(cb["total_bytes"]), f"{ms[name]:.2f}",
                        f"{1e3 / ms[name]:.1f}"])
    kv_table = markdown_table(["attn_kv_heads", "KV cache (k + v)", "state total", "ms/token", "tokens/s"],
                              kv_rows)

    vs = {c.name: ms[c.name] / ours for c in competitors[1:]}
    met = all(r >= TARGET for r in vs.values())
    bad = {k: v for k, v in checks.items() if not v["equal"]}
    env = environment(["torch", "polyformer", "x-transformers", "transformers", "einops"])
    setup = (f"batch 1, prompt {args.prompt_len} tokens, {new} new tokens, greedy; dim {DIM}, depth {DEPTH}, "
             f"{HEADS} heads, vocab {VOCAB}, float32, random weights; {env['torch_threads']} thread(s); "
             f"median of {args.repeats} alternating rounds after 1 warmup each")
    lines = ["# Greedy generation benchmark", "", setup, "",
             f"CPU: {env['cpu']}; python {env['python']}; " + ", ".join(
                 f"{k} {v}" for k, v in env["packages"].items()) + f"; polyformer commit {env['polyformer_commit']}",
             "", speed_table, "",
             f"Target: polyformer >= {TARGET:.0f}x both anchors -> "
             + ("met" if met else "NOT met") + " (" + ", ".join(f"{k} {v:.2f}x" for k, v in vs.items()) + ")",
             "", "## polyformer KV cache by attn_kv_heads", "",
             f"Cache for {args.prompt_len + new} positions, batch 1 (`DecodeState` allocated by `generate`).",
             "", kv_table, "",
             "Correctness (cached greedy == uncached greedy): " + (
                 "skipped" if not checks else "ok for kv_heads " + ", ".join(checks) if not bad
                 else "MISMATCH " + repr(bad))]
    markdown = "\n".join(lines)
    record = {
        "benchmark": "generation", "setup": setup,
        "config": {"dim": DIM, "depth": DEPTH, "heads": HEADS, "vocab": VOCAB, "max_seq_len": MAX_SEQ_LEN,
                   "prompt_len": args.prompt_len, "new_tokens": new, "repeats": args.repeats,
                   "threads": args.threads, "dtype": "float32"},
        "environment": env,
        "results": {c.name: {"ms_per_token": spread([s * 1e3 for s in c.per_unit]),
                             "tokens_per_s": 1e3 / ms[c.name], "seconds": c.seconds}
                    for c in everyone},
        "speedup_vs": vs, "target": TARGET, "target_met": met,
        "kv_cache": {k: {**caches[k], "ms_per_token": ms["polyformer" if int(k) == HEADS
                                                          else f"polyformer kv_heads={k}"]} for k in caches},
        "correctness": checks,
    }
    json_path, md_path = write_report(args.out, record, markdown)
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")
    if bad:
        print("\n" + "!" * 72 + "\nCORRECTNESS FAILURE: polyformer cached greedy tokens differ from the "
              f"uncached recomputation: {bad}\n" + "!" * 72, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
