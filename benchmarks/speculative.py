"""Speculative decoding speed-up with a small draft trained on the same data as the target.

    # a target of the generation benchmark's shape (dim 512, depth 6, 8 heads, bytes) and a small draft
    python -m polyformer train --config benchmarks/configs/speculative_target.yaml --out runs/spec-target
    python -m polyformer train --config benchmarks/configs/speculative_draft.yaml --out runs/spec-draft
    python -m benchmarks.speculative --target runs/spec-target --draft runs/spec-draft [--gammas 2,4,6]

Any two runs on one corpus will do (for example `--preset small` and `--preset tiny`). Greedy
decoding, batch 1, one thread, prompts taken from the validation split. The target alone, the draft
alone, speculative generation per gamma and the target's verify call on gamma + 1 tokens alternate;
the speculative tokens must equal the target's own greedy ones (the run exits 1 if not). The table
sets the measured speed beside the cost model of Leviathan et al. (section 3.4), fed with the
measured draft step, verify call and tokens per target call."""

from __future__ import annotations

import argparse
import sys

import torch

from polyformer.layout import linear_layers

from .common import Competitor, alternating_rounds, environment, markdown_table, set_threads, write_report


def verify_call(target: torch.nn.Module, prompt: torch.Tensor, n: int, calls: int = 20) -> Competitor:
    """`calls` cached target forwards on n tokens after `prompt`, each rolled back: the verify call of
    a speculative round, timed alone."""
    state = target.new_state(1, prompt.shape[1] + n)
    with torch.no_grad():
        target(prompt, state=state)
    tokens = prompt[:, -n:]

    @torch.no_grad()
    def run() -> None:
        for _ in range(calls):
            target(tokens, state=state)
            state.rollback(n)
    return Competitor(f"target call on {n} tokens", run, calls)


def products_call(target: torch.nn.Module, n: int, calls: int = 20) -> Competitor:
    """`calls` rounds of the target's linear layers alone on n rows each (its own weights, no
    attention, norms or Python around them): what the verify call's matrix products cost."""
    layers = [m for _, m in linear_layers(target)]
    inputs = [torch.randn(1, n, m.in_features) for m in layers]

    @torch.no_grad()
    def run() -> None:
        for _ in range(calls):
            for layer, x in zip(layers, inputs):
                layer(x)
    return Competitor(f"linear layers on {n} rows", run, calls)


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
    from polyformer.train.commands import load_run

    _, target, data = load_run(args.target)
    _, draft, _ = load_run(args.draft)
    step = (data.val.numel() - args.prompt_len) // args.prompts
    prompts = [data.val[i * step: i * step + args.prompt_len][None] for i in range(args.prompts)]
    plain = AutoregressiveWrapper(target)
    gammas = [int(g) for g in args.gammas.split(",")]
    if max(gammas) + 1 > args.prompt_len:          # the verify call is timed on the prompt's last tokens
        parser.error(f"--prompt-len ({args.prompt_len}) must be at least the largest gamma + 1 ({max(gammas) + 1})")
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
    plain_draft = AutoregressiveWrapper(draft)
    competitors = [Competitor("target alone (cached greedy)",
                              lambda: [plain.generate(p, args.new_tokens, temperature=0.0) for p in prompts], units),
                   Competitor("draft alone (cached greedy)",
                              lambda: [plain_draft.generate(p, args.new_tokens, temperature=0.0) for p in prompts],
                              units)]
    competitors += [Competitor(f"speculative, gamma={g}",
                               lambda g=g: [speculative_generate(target, draft, p, args.new_tokens, gamma=g,
                                                                 temperature=0.0) for p in prompts], units)
                    for g in gammas]
    checks = [verify_call(target, prompts[0], g + 1) for g in gammas]
    products = [products_call(target, n) for n in [1] + [g + 1 for g in gammas]]
    alternating_rounds(competitors + checks + products, args.repeats)
    t_target, t_draft = (c.median_per_unit() for c in competitors[:2])
    rows = [[competitors[0].name, f"{t_target * 1e3:.2f}", "1.00x", "-", "1.00", "-",
             f"{products[0].median_per_unit() * 1e3:.2f}", "-"],
            [competitors[1].name, f"{t_draft * 1e3:.2f}", "-", "-", "-", "-", "-", "-"]]
    model = {}
    for c, check, product, g in zip(competitors[2:], checks, products[1:], gammas):
        acceptance, per_call = stats[g]
        # Leviathan et al. (arXiv:2211.17192, section 3.4): a round costs gamma draft steps and one
        # target call on gamma + 1 tokens, and yields `per_call` tokens on average
        predicted = (g * t_draft + check.median_per_unit()) / per_call
        model[g] = {"verify_call_ms": check.median_per_unit() * 1e3, "predicted_ms_per_token": predicted * 1e3}
        rows.append([c.name, f"{c.median_per_unit() * 1e3:.2f}", f"{t_target / c.median_per_unit():.2f}x",
                     f"{acceptance:.2f}", f"{per_call:.2f}", f"{check.median_per_unit() * 1e3:.2f}",
                     f"{product.median_per_unit() * 1e3:.2f}", f"{predicted * 1e3:.2f} ({t_target / predicted:.2f}x)"])
    table = markdown_table(["decoding", "ms/token", "speed-up", "acceptance", "tokens per target call",
                            "target call on gamma + 1 tokens, ms",
                            "its linear layers alone, ms", "cost model: ms/token (speed-up)"], rows)
    params = (sum(p.numel() for p in target.parameters()), sum(p.numel() for p in draft.parameters()))
    text = (f"Target {params[0]:,} parameters ({args.target}), draft {params[1]:,} ({args.draft}); "
            f"{args.prompts} {args.prompt_len}-token validation prompts, {args.new_tokens} new tokens each, greedy, "
            f"{args.threads} thread(s), median of {args.repeats} alternating rounds. Outputs identical to the "
            f"target's greedy decoding: yes.\n\n{table}\n\n"
            "Cost model (Leviathan et al. 2023, section 3.4): a round runs gamma one-token draft steps and one "
            "cached target call on gamma + 1 tokens and yields `tokens per target call` tokens, so it predicts "
            "ms/token = (gamma x draft ms/token + target call ms) / tokens per target call. Speculation pays "
            "when the target's call on gamma + 1 tokens costs about what one token costs (its weights are read "
            "once either way) and the draft step is a small fraction of it: draft / target step here = "
            f"{t_draft / t_target:.2f}. `its linear layers alone` times the target's nn.Linear layers on 1 "
            "(the target-alone row) or gamma + 1 rows with nothing around them: how far matrix products on a "
            "few rows are from the one-row cost on this machine.\n")
    print(text)
    write_report(args.out, {"environment": environment(["torch"]), "rows": rows, "cost_model": model,
                            "args": vars(args)},
                 "# Speculative decoding\n\nCommand: `python -m benchmarks.speculative "
                 + " ".join(argv or sys.argv[1:]) + "`\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
