"""Speculative decoding speed-up with a small draft trained on the same data as the target.

    python -m polyformer train --preset small --out runs/small          # the target
    python -m polyformer train --preset tiny --steps 400 --out runs/draft   # the draft, same corpus
    python -m benchmarks.speculative --target runs/small --draft runs/draft [--gammas 2,4,6]

Greedy decoding, batch 1, one thread, prompts taken from the validation split. Plain cached greedy
generation of the target and speculative generation alternate; the tokens must be identical (the
greedy form returns exactly the target's output) and the run exits 1 if they are not.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .common import Competitor, alternating_rounds, environment, markdown_table, set_threads, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--gammas", default="2,4,6")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=6, help="prompts spread evenly over the validation split")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="docs/benchmarks/speculative.json")
    args = parser.parse_args(argv)
    set_threads(args.threads)

    from polyformer import AutoregressiveWrapper, speculative_generate
    from polyformer.train.trainer import load_run

    _, target, data = load_run(args.target)
    _, draft, _ = load_run(args.draft)
    step = (data.val.numel() - args.prompt_len) // args.prompts
    prompts = [data.val[i * step: i * step + args.prompt_len][None] for i in range(args.prompts)]
    plain = AutoregressiveWrapper(target)
    gammas = [int(g) for g in args.gammas.split(",")]
    stats = {}
    for gamma in gammas:
        accepted = proposed = calls = 0
        for prompt in prompts:
            reference = plain.generate(prompt, args.new_tokens, temperature=0.0)
            result = speculative_generate(target, draft, prompt, args.new_tokens, gamma=gamma, temperature=0.0)
            if not torch.equal(result.tokens, reference):
                print(f"MISMATCH: speculative gamma={gamma} differs from the target's greedy output", file=sys.stderr)
                return 1
            accepted, proposed, calls = accepted + result.accepted, proposed + result.proposed, calls + result.target_calls
        stats[gamma] = (accepted / max(1, proposed), len(prompts) * args.new_tokens / calls)
    units = len(prompts) * args.new_tokens
    competitors = [Competitor("target alone (cached greedy)",
                              lambda: [plain.generate(p, args.new_tokens, temperature=0.0) for p in prompts], units)]
    competitors += [Competitor(f"speculative, gamma={g}",
                               lambda g=g: [speculative_generate(target, draft, p, args.new_tokens, gamma=g,
                                                                 temperature=0.0) for p in prompts], units)
                    for g in gammas]
    alternating_rounds(competitors, args.repeats)
    base = competitors[0].median_per_unit()
    rows = [[c.name, f"{c.median_per_unit() * 1000:.2f}", f"{base / c.median_per_unit():.2f}x",
             f"{stats[g][0]:.2f}" if g else "-", f"{stats[g][1]:.2f}" if g else "1.00"]
            for c, g in zip(competitors, [None] + gammas)]
    table = markdown_table(["decoding", "ms/token", "speed-up", "acceptance", "tokens per target call"], rows)
    params = (sum(p.numel() for p in target.parameters()), sum(p.numel() for p in draft.parameters()))
    text = (f"Target {params[0]:,} parameters ({args.target}), draft {params[1]:,} ({args.draft}); "
            f"{args.prompts} {args.prompt_len}-token validation prompts, {args.new_tokens} new tokens each, greedy, "
            f"{args.threads} thread(s). Outputs identical to the target's greedy decoding: yes.\n\n{table}\n")
    print(text)
    write_report(args.out, {"environment": environment(["torch"]), "rows": rows, "args": vars(args)},
                 "# Speculative decoding\n\nCommand: `python -m benchmarks.speculative "
                 + " ".join(argv or sys.argv[1:]) + "`\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
