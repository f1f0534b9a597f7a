"""DeepNet against post-LN at depth (issue 22): the paper's claim (arXiv:2203.00555, figures 1 and 3)
is that a deep post-LN Transformer diverges or lags because its early updates move the model too far,
while DeepNorm (LN(alpha * x + f(x)) with the beta-scaled init) bounds them and trains.

    python -m benchmarks.deepnet [--depth 64] [--dim 32] [--steps 300] [--variants post_ln deepnet pre_ln]

A byte-level language model (`TransformerWrapper` over a `Decoder` of `depth` layers, `dim` wide,
4 heads) per variant, trained on the built-in corpus (the standard library's sources, split by file:
`benchmarks/arena/data/text.py`) with Adam, the same seed, data order and learning-rate schedule
(linear warmup, then constant). Recorded per step: the training loss, the gradient norm and the model
update ||F(x; theta_t+1) - F(x; theta_t)|| (mean over positions of a fixed batch, F the stack's
output, as the paper's figure 3); every `--eval-every` steps the validation loss. A variant whose
loss turns non-finite is marked diverged and stops. Writes docs/deepnet/deepnet.{json,md,png}.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from polyformer import Decoder, TransformerWrapper

from .arena.data.text import VOCAB, spaced_windows, split_tokens, windows
from .common import environment, log, markdown_table, pyplot, save_figure, set_threads, write_report

OUT = Path(__file__).resolve().parents[1] / "docs" / "deepnet"
VARIANTS: dict[str, dict[str, Any]] = {
    "post_ln": dict(pre_norm=False),
    "deepnet": dict(deepnorm=True),
    "pre_ln": dict(),
}


def build(variant: str, depth: int, dim: int, seq: int, seed: int) -> TransformerWrapper:
    torch.manual_seed(seed)
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=seq, attn_layers=Decoder(
        dim=dim, depth=depth, heads=4, attn_dim_head=dim // 4, **VARIANTS[variant]))


def lm_loss(model: TransformerWrapper, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:])


def train(variant: str, args: argparse.Namespace, train_data: torch.Tensor, val: torch.Tensor) -> dict[str, Any]:
    model = build(variant, args.depth, args.dim, args.seq, args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    probe = windows(train_data, 8, args.seq + 1, seed=999_999_937)[:, :-1]
    with torch.no_grad():
        before = model(probe, return_embeddings=True)
    run: dict[str, Any] = {"loss": [], "grad_norm": [], "update": [], "val": [], "diverged_at": None}
    start = time.perf_counter()
    for step in range(args.steps):
        model.train()
        loss = lm_loss(model, windows(train_data, args.batch, args.seq + 1, seed=args.seed * 100_003 + step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        if not (math.isfinite(loss.item()) and math.isfinite(grad.item())):
            run["diverged_at"] = step
            log(f"{variant}: non-finite loss / gradient at step {step}; stopped")
            break
        opt.step()
        schedule.step()
        model.eval()
        with torch.no_grad():
            after = model(probe, return_embeddings=True)
            val_loss = lm_loss(model, val).item() if (step + 1) % args.eval_every == 0 else None
        run["loss"].append(loss.item())
        run["grad_norm"].append(grad.item())
        run["update"].append((after - before).norm(dim=-1).mean().item())
        before = after
        if val_loss is not None:
            run["val"].append([step + 1, val_loss])
            log(f"{variant}: step {step + 1} train {loss.item():.3f} val {val_loss:.3f} "
                f"({time.perf_counter() - start:.0f} s)")
    run["seconds"] = time.perf_counter() - start
    return run


def markdown(record: dict[str, Any]) -> str:
    cfg = record["config"]
    rows = []
    for name, run in record["runs"].items():
        last_val = run["val"][-1][1] if run["val"] else float("nan")
        first = run["update"][: min(10, len(run["update"]))]
        rows.append([name, "yes, step %d" % run["diverged_at"] if run["diverged_at"] is not None else "no",
                     f"{sum(run['loss'][-20:]) / max(1, len(run['loss'][-20:])):.3f}", f"{last_val:.3f}",
                     f"{max(first) if first else float('nan'):.2f}", f"{run['seconds']:.0f}"])
    table = markdown_table(["variant", "diverged", "train loss (last 20 steps)", "val loss (last)",
                            "max update, first 10 steps", "seconds"], rows)
    return (f"# DeepNet against post-LN at depth {cfg['depth']}\n\n"
            f"`python -m benchmarks.deepnet` ({cfg['steps']} steps, dim {cfg['dim']}, seq {cfg['seq']}, batch "
            f"{cfg['batch']}, Adam lr {cfg['lr']} after {cfg['warmup']} warmup steps, seed {cfg['seed']}); "
            f"bytes of the built-in corpus. The update is the mean per-position change of the stack's "
            f"output on a fixed batch after each step (each position has norm about sqrt(dim) = "
            f"{math.sqrt(cfg['dim']):.1f}).\n\n{table}\n\n![loss curves](deepnet.png)\n\n"
            f"Measured {record['environment']['date']} on {record['environment']['cpu']}.\n")


def plot(record: dict[str, Any]) -> list[str]:
    plt = pyplot()
    OUT.mkdir(parents=True, exist_ok=True)
    fig, (ax_loss, ax_update) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in record["runs"].items():
        line, = ax_loss.plot(range(1, len(run["loss"]) + 1), run["loss"], alpha=0.5, label=f"{name} train")
        if run["val"]:
            steps, values = zip(*run["val"])
            ax_loss.plot(steps, values, "o-", color=line.get_color(), label=f"{name} validation")
        ax_update.semilogy(range(1, len(run["update"]) + 1), run["update"], color=line.get_color(), label=name)
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats / byte)", title=f"depth {record['config']['depth']}")
    ax_update.set(xlabel="step", ylabel="||F(x; θ_t+1) - F(x; θ_t)||", title="model update per step")
    ax_loss.legend()
    ax_update.legend()
    return save_figure(fig, OUT, "deepnet.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.deepnet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=64)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=["post_ln", "deepnet"], choices=sorted(VARIANTS))
    args = parser.parse_args(argv)
    set_threads(args.threads)
    train_data, val_data = split_tokens()
    val = spaced_windows(val_data, 16, args.seq + 1)
    runs = {name: train(name, args, train_data, val) for name in args.variants}
    record = {"config": {k: getattr(args, k) for k in ("depth", "dim", "seq", "batch", "steps", "lr", "warmup",
                                                       "eval_every", "seed")},
              "environment": environment(["torch"]), "runs": runs}
    record["plots"] = plot(record)
    text = markdown(record)
    write_report(OUT / "deepnet.json", record, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
