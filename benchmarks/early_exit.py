"""Early exit (issue 22, CALM): a speed / quality curve of generation against the exit threshold, on a small
model trained on a task where some tokens are easy and some are not.

    python -m benchmarks.early_exit [--quick] [--repeats 3] [--max-wait 30] [--threads 2] [--out-dir docs/early_exit]

A Decoder (dim 256, depth 8, 4 heads of 64, rotary, exit_layers=True, exit_confidence="softmax_margin")
trained with the exits' weighted loss on rows that count up by one (one layer suffices) or add their last
two tokens mod 10 (harder). Per threshold: greedy generation of 32 tokens after 4-token prompts, batch 1
(CALM's setting: a batch row that exits waits for the others), timed in alternating rounds
(`common.quiet_rounds`) against full-depth generation of the same model by `AutoregressiveWrapper.generate`
(the competitor: the plain cached decode loop); tokens/s, the ratio to full depth, the mean layers used, and
the consistency with the full model's greedy tokens over 64 held-out prompts (fraction of tokens equal).
Then the decode step alone (`ExitStep` against the plain default step `fast_step`), teacher-forced through the
tokens that threshold generated from a prompt cached once: process CPU time per token, alternating rounds; a
threshold just below 1 no token passes times the exit walk with every confidence computed and nothing skipped.
--quick: dim 128, depth 4 (the arena's long-text size), 150 training steps, 3 thresholds, 32 tokens, output
under /tmp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from polyformer import AutoregressiveWrapper, Decoder, TransformerWrapper
from polyformer.generate.early_exit import ExitStep, generate
from polyformer.generate.fast import fast_step

from .common import (Competitor, environment, finish_report, log, markdown_table, one_shot_parser, quiet_rounds,
                     spread, started)

V = 10
FULL = dict(dim=256, depth=8, steps=600, thresholds=(0.99, 0.9, 0.8, 0.6, 0.4, 0.2), tokens=32)
QUICK = dict(dim=128, depth=4, steps=150, thresholds=(0.9, 0.5, 0.1), tokens=32)
NEVER = 1 - 1e-6          # no softmax margin of these models passes it: the walk without an exit


def task(b: int, n: int, g: torch.Generator) -> torch.Tensor:
    """(b, n) rows over V tokens: half count up by one (one layer suffices), half add their last two mod V
    (also tests/test_early_exit.py's calibration task)."""
    x = torch.randint(0, V, (b, n), generator=g)
    hard = torch.rand(b, generator=g) < 0.5
    for t in range(2, n):
        x[:, t] = torch.where(hard, (x[:, t - 1] + x[:, t - 2]) % V, (x[:, t - 1] + 1) % V)
    return x


def trained(dim: int, depth: int, steps: int) -> TransformerWrapper:
    torch.manual_seed(0)
    net = TransformerWrapper(num_tokens=V, max_seq_len=64, attn_layers=Decoder(
        dim=dim, depth=depth, heads=4, attn_dim_head=dim // 4, rotary_pos_emb=True, exit_layers=True))
    wrapper, g = AutoregressiveWrapper(net), torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for step in range(steps):
        opt.zero_grad()
        loss = wrapper(task(16, 24, g))
        loss.backward()
        opt.step()
        if step % 50 == 0:
            log(f"train step {step}: loss {loss.item():.3f}")
    return net.eval()


def measure(cfg: dict[str, Any], repeats: int, warmup: int, max_wait: float) -> dict[str, Any]:
    net = trained(cfg["dim"], cfg["depth"], cfg["steps"])
    g = torch.Generator().manual_seed(2)
    prompt, held_out = task(1, 4, g), task(64, 4, g)
    n = cfg["tokens"]
    full_tokens = generate(net, held_out, n, threshold=1.0).tokens
    wrapper = AutoregressiveWrapper(net)
    competitors = [Competitor("full depth (generate)", lambda: wrapper.generate(prompt, n, temperature=0.0), n)]
    rows: dict[str, dict[str, Any]] = {"full depth (generate)": {"threshold": None, "mean_layers": cfg["depth"],
                                                                 "consistency": 1.0}}
    for t in (1.0, *cfg["thresholds"]):
        name = f"early exit {t:g}"
        held = generate(net, held_out, n, threshold=t)
        rows[name] = {"threshold": t, "mean_layers": generate(net, prompt, n, threshold=t).mean_layers,
                      "held_out_mean_layers": held.mean_layers,
                      "consistency": float((held.tokens == full_tokens).float().mean())}
        competitors.append(Competitor(name, lambda t=t: generate(net, prompt, n, threshold=t), n))
        log(f"{name}: {rows[name]}")
    quiet_rounds(competitors, repeats, warmup=warmup, max_wait=max_wait)
    for c in competitors:
        rows[c.name]["seconds_per_token"] = spread(c.per_unit)
        rows[c.name]["cpu_seconds_per_token"] = spread([s / c.units for s in c.cpu_seconds])
    return {"generation": rows, "step": steps(net, prompt, n, cfg, repeats, warmup, max_wait)}


def steps(net: TransformerWrapper, prompt: torch.Tensor, n: int, cfg: dict[str, Any], repeats: int, warmup: int,
          max_wait: float) -> dict[str, dict[str, Any]]:
    """The decode step alone per threshold, teacher-forced through that threshold's generated tokens."""
    exits = net.attn_layers.early_exit
    rows: dict[str, dict[str, Any]] = {}
    competitors = []
    for name, t in [("plain step (fast_step)", None), ("ExitStep 1", 1.0), (f"ExitStep {NEVER:g}", NEVER),
                    *((f"ExitStep {t:g}", t) for t in cfg["thresholds"])]:
        tokens = generate(net, prompt, n, threshold=1.0 if t is None else t).tokens[:, :-1]
        step = fast_step(net) if t is None else ExitStep(net, exits, t)
        state, used = net.new_state(1, prompt.shape[1] + n), []
        with torch.no_grad():
            net(prompt, state=state)

        def run(step=step, state=state, tokens=tokens, used=used, exiting=t is not None) -> None:
            with torch.no_grad():
                for i in range(tokens.shape[1]):
                    step(tokens[:, i: i + 1], state=state)
                    used.append(float(step.layers.float().mean()) if exiting else cfg["depth"])
                state.rollback(tokens.shape[1])
        run()
        rows[name] = {"threshold": t, "mean_layers": sum(used) / len(used)}
        competitors.append(Competitor(name, run, tokens.shape[1]))
    quiet_rounds(competitors, repeats, warmup=warmup, max_wait=max_wait)
    for c in competitors:
        rows[c.name]["cpu_seconds_per_token"] = spread([s / c.units for s in c.cpu_seconds])
        log(f"{c.name}: {rows[c.name]}")
    return rows


def markdown(record: dict[str, Any]) -> str:
    gen, step, cfg, env = record["rows"]["generation"], record["rows"]["step"], record["config"], record["environment"]
    full = gen["full depth (generate)"]["seconds_per_token"]["median"]
    table = markdown_table(
        ["decoding", "tokens/s", "time / full depth", "us / token (CPU)", "mean layers (timed prompt)",
         "mean layers (held out)", "consistency with full"],
        [[name, f"{1 / r['seconds_per_token']['median']:.0f}", f"{r['seconds_per_token']['median'] / full:.2f}",
          f"{1e6 * r['cpu_seconds_per_token']['median']:.0f}", f"{r['mean_layers']:.2f}",
          f"{r.get('held_out_mean_layers', cfg['depth']):.2f}", f"{r['consistency']:.3f}"] for name, r in gen.items()])
    plain = step["plain step (fast_step)"]["cpu_seconds_per_token"]["median"]
    step_table = markdown_table(
        ["decode step", "us / token (CPU)", "time / plain step", "mean layers"],
        [[name, f"{1e6 * r['cpu_seconds_per_token']['median']:.0f}",
          f"{r['cpu_seconds_per_token']['median'] / plain:.2f}",
          f"{r['mean_layers']:.2f}"] for name, r in step.items()])
    return "\n\n".join([
        "# Early exit: generation speed and consistency against the threshold",
        f"Decoder dim {cfg['dim']}, depth {cfg['depth']}, 4 heads, rotary, softmax-margin confidence, trained "
        f"{cfg['steps']} steps with the exits' weighted loss; greedy, batch 1, {cfg['tokens']} new tokens; "
        f"{env['torch_threads']} threads; {env['cpu']}; torch {env['packages'].get('torch')}; {env['date']}, "
        f"commit {env['polyformer_commit']}. Method: `benchmarks/early_exit.py` (docstring).",
        table,
        "Time / full depth < 1: early exit is faster than the plain decode loop. `early exit 1` never exits (it runs "
        "the plain step: no confidence is above 1).",
        "## The decode step alone",
        "One token per step after a cached 4-token prompt, teacher-forced through the tokens each threshold "
        f"generated; process CPU time. `ExitStep {NEVER:g}` runs the exit walk with every exit layer's confidence "
        "and no exit: the walk's own cost.",
        step_table,
    ])


def main(argv: list[str] | None = None) -> int:
    args = started(one_shot_parser("python -m benchmarks.early_exit", __doc__.split("\n\n")[0]), argv)
    cfg, repeats, warmup = (QUICK, 3, 1) if args.quick else (FULL, args.repeats, 1)
    out_dir = args.out_dir or (Path("/tmp/early_exit") if args.quick else Path("docs/early_exit"))
    rows = measure(cfg, repeats, warmup, args.max_wait)
    record = {"config": {k: v for k, v in cfg.items()}, "rows": rows, "environment": environment(["torch"])}
    return finish_report(out_dir / "early_exit.json", record, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
