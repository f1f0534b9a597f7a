"""What torch.compile (inductor) buys on this machine: greedy cached generation with
`generate(compile=True)` against eager, and a batched forward through `torch.compile(model)`.

    python -m benchmarks.compile [--repeats 5] [--new-tokens 128] [--out docs/benchmarks/compile.json]

Decoder dim 512 / depth 6 / 8 heads / vocab 256 (the generation benchmark's shape), random
weights, float32, one CPU thread. Generation: batch 1, 16-token prompt, ms/token = wall time of one
whole generate call / new tokens. Forward: batch 4 x 128 tokens, no grad. Compile time is the wall
time of the first call (tracing + inductor, caches off), reported apart; timed calls come after it. The
compiled greedy tokens are checked against eager ones first.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from .common import (Competitor, alternating_rounds, environment, log, markdown_table, set_threads, time_once,
                     write_report)
from .generation import DIM, DEPTH, HEADS, VOCAB, polyformer_model


def first_call(fn) -> float:
    return time_once(fn)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="docs/benchmarks/compile.json")
    args = p.parse_args(argv)
    set_threads(args.threads)
    import torch._inductor.config

    torch._inductor.config.force_disable_caches = True     # a cold compile, whatever ran before
    load_start = list(os.getloadavg())
    ar = polyformer_model()
    prompt = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    batch = torch.randint(0, VOCAB, (4, 128), generator=torch.Generator().manual_seed(1))
    new = args.new_tokens

    def generate(compile: bool):
        return lambda: ar.generate(prompt, new, temperature=0.0, compile=compile)

    compiled_net = torch.compile(ar.net)
    forward_eager = lambda: torch.no_grad()(ar.net)(batch)              # noqa: E731
    forward_compiled = lambda: torch.no_grad()(compiled_net)(batch)     # noqa: E731
    compile_s = {"generate": first_call(generate(True)), "forward": first_call(forward_compiled)}
    equal = torch.equal(generate(True)(), generate(False)())
    with torch.no_grad():
        forward_err = (compiled_net(batch) - ar.net(batch)).abs().max().item()
    log(f"compile: {compile_s}; greedy tokens equal: {equal}; forward max |diff| {forward_err:.2e}")

    gen = [Competitor("generate, eager", generate(False), new), Competitor("generate, compile=True", generate(True), new)]
    fwd = [Competitor("forward, eager", forward_eager, batch.numel()),
           Competitor("forward, torch.compile", forward_compiled, batch.numel())]
    for group in (gen, fwd):
        alternating_rounds(group, args.repeats, log=log)

    def ms(c: Competitor, per: int = 1, cpu: bool = False) -> float:
        return statistics.median(c.cpu_seconds if cpu else c.seconds) / c.units * per * 1e3

    def row(c: Competitor, base: Competitor, unit: str, per: int, compile_time: float | None) -> list[str]:
        return [c.name, f"{ms(c, per):.2f} {unit}", f"{ms(base) / ms(c):.2f}x", f"{ms(c, per, cpu=True):.2f}",
                f"{ms(base, cpu=True) / ms(c, cpu=True):.2f}x", "-" if compile_time is None else f"{compile_time:.1f} s"]

    n = batch.numel()
    rows = [row(gen[0], gen[0], "ms/token", 1, None), row(gen[1], gen[0], "ms/token", 1, compile_s["generate"]),
            row(fwd[0], fwd[0], "ms/call", n, None), row(fwd[1], fwd[0], "ms/call", n, compile_s["forward"])]
    env = environment(["torch", "polyformer"])
    setup = (f"dim {DIM}, depth {DEPTH}, {HEADS} heads, vocab {VOCAB}, float32, {args.threads} thread(s); generation: "
             f"batch 1, 16-token prompt, {new} new tokens, greedy; forward: batch 4 x 128, no grad; median of "
             f"{args.repeats} alternating rounds after 1 warmup each (and after the compiling first call).")
    markdown = "\n".join([
        "# torch.compile benchmark", "", setup, "",
        f"CPU: {env['cpu']}; python {env['python']}; torch {env['packages']['torch']}; polyformer commit "
        f"{env['polyformer_commit']}; 1-min load average at start {load_start[0]:.1f}.", "",
        "Command: `python -m benchmarks.compile`", "",
        markdown_table(["what", "wall time", "speedup", "CPU time", "CPU speedup", "compile time (first call)"], rows), "",
        "CPU time is this process's CPU time per unit, less disturbed than wall time on a shared machine.", "",
        f"Correctness: compiled greedy tokens == eager: {equal}; compiled forward max |diff| {forward_err:.1e}."])
    record = {"benchmark": "compile", "setup": setup, "environment": env, "load_average_start": load_start,
              "compile_seconds": compile_s, "greedy_equal": equal, "forward_max_abs_diff": forward_err,
              "results": {c.name: {"seconds": c.seconds, "cpu_seconds": c.cpu_seconds, "units": c.units}
                          for c in gen + fwd}}
    json_path, md_path = write_report(args.out, record, markdown)
    print(markdown)
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
