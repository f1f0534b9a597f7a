"""SPALM (issue 21): the training step of SPALM against its base Transformer-XL model at equal settings
(time and peak memory), and the held-out loss with and without the long-term memory after a short
training.

    python -m benchmarks.spalm [--quick] [--repeats 3] [--max-wait 30] [--threads 2] [--out-dir docs/memories]

writes docs/memories/benchmark_spalm.json and .md (docs/memories/spalm.md explains the model).

Corpus: random documents of 2 segments over a 256-token vocabulary. The training documents appear twice in the
datastore's text, far apart (more than the exclusion radius), the held-out ones once; the datastore is built
with a frozen key model (`knn_lm.build_datastore`, key "ffn_input", flat exact index). Models: dim 128, depth 2,
4 heads, rotary, segments of 64, XL memory 64, tied embedding; SPALM retrieves k = 4 neighbours per position.
Step: the loss over one batch of documents (2 segments, the second with the first's XL memory) and its backward;
SPALM's includes the key model's forward and the search. Time: alternating quiet rounds (`common.quiet_rounds`),
medians; memory: `features.peak_step_bytes`. Quality: both trained the same steps (Adam 3e-3) from the same
initialisation on the training documents, then scored on the held-out ones: the XL model, SPALM, and SPALM's
net with the gate closed (the long-term memory off).
--quick: dim 64, segments of 16, fewer documents and steps, one round without warmup, output under /tmp.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import torch

from polyformer import Decoder, TransformerWrapper, XLAutoregressiveWrapper
from polyformer.memory.datastore import model_fingerprint
from polyformer.memory.knn_lm import build_datastore
from polyformer.memory.spalm import Spalm

from .common import environment, finish_report, log, markdown_table, one_shot_parser, peaks_and_times, started

FULL = dict(dim=128, depth=2, heads=4, seq=64, mem=64, batch=8, k=4, docs=512, held=32, steps=300, lr=3e-3)
QUICK = dict(dim=64, depth=2, heads=2, seq=16, mem=16, batch=8, k=4, docs=64, held=8, steps=60, lr=3e-2)
VOCAB = 256


def model(s: dict[str, Any], seed: int) -> TransformerWrapper:
    torch.manual_seed(seed)
    stack = Decoder(dim=s["dim"], depth=s["depth"], heads=s["heads"], rotary_pos_emb=True)
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=s["seq"], attn_layers=stack, max_mem_len=s["mem"],
                              tie_embedding=True)


def corpus(s: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(datastore text, training documents (docs, 2 seq + 1), held-out documents (held, 2 seq + 1))."""
    gen = torch.Generator().manual_seed(0)
    train = torch.randint(0, VOCAB, (s["docs"], 2 * s["seq"] + 1), generator=gen)
    held = torch.randint(0, VOCAB, (s["held"], 2 * s["seq"] + 1), generator=gen)
    body = [train[:, :-1].reshape(-1)] * 2 + [held[:, :-1].reshape(-1), held[:1, :1].reshape(-1)]
    return torch.cat(body), train, held


def build(s: dict[str, Any]) -> tuple[Spalm, XLAutoregressiveWrapper, torch.Tensor, torch.Tensor]:
    text, train, held = corpus(s)
    key_model = model(s, 1).eval()
    ds = build_datastore(key_model, text, meta={"model": {"fingerprint": model_fingerprint(key_model)}})
    base_net = model(s, 0).train()
    spalm = Spalm(copy.deepcopy(base_net), ds, key_model, k=s["k"]).train()
    return spalm, XLAutoregressiveWrapper(base_net), train, held


def steps(spalm: Spalm, base: XLAutoregressiveWrapper, train: torch.Tensor, s: dict[str, Any]
          ) -> dict[str, Callable[[], Any]]:
    rows = torch.arange(s["batch"])
    starts = rows * 2 * s["seq"]

    def spalm_step() -> None:
        spalm.zero_grad(set_to_none=True)
        spalm(train[rows], starts=starts).backward()

    def base_step() -> None:
        base.zero_grad(set_to_none=True)
        base(train[rows]).backward()

    return {"SPALM": spalm_step, "Transformer-XL": base_step}


def trained_losses(spalm: Spalm, base: XLAutoregressiveWrapper, train: torch.Tensor, held: torch.Tensor,
                   s: dict[str, Any]) -> dict[str, float]:
    for name, module in (("SPALM", spalm), ("Transformer-XL", base)):
        gen = torch.Generator().manual_seed(1)          # both models see the same batches
        opt = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=s["lr"])
        order = [torch.randperm(train.shape[0], generator=gen)[:s["batch"]] for _ in range(s["steps"])]
        for i, rows in enumerate(order):
            opt.zero_grad()
            loss = spalm(train[rows], starts=rows * 2 * s["seq"]) if module is spalm else base(train[rows])
            loss.backward()
            opt.step()
            if i % 50 == 0:
                log(f"{name} step {i}: {loss.item():.3f}")
    spalm.eval()
    base.eval()
    with torch.no_grad():
        out = {"Transformer-XL": base(held).item(), "SPALM": spalm(held).item()}
        bias = spalm.gate.bias.clone()
        spalm.gate.bias.fill_(-1e4)
        out["SPALM, long-term memory off"] = spalm(held).item()
        spalm.gate.bias.copy_(bias)
    return out


def measure(s: dict[str, Any], repeats: int, warmup: int, max_wait: float) -> dict[str, Any]:
    spalm, base, train, held = build(s)
    rows = peaks_and_times(steps(spalm, base, train, s), s["batch"] * 2 * s["seq"], repeats, warmup=warmup,
                           max_wait=max_wait)
    a, b = rows["SPALM"], rows["Transformer-XL"]
    ratios = {"time SPALM / XL": a["seconds"]["median"] / b["seconds"]["median"],
              "peak memory SPALM / XL": a["peak_bytes"] / max(1, b["peak_bytes"])}
    return {"settings": s, "rows": rows, "ratios": ratios, "held_out_loss": trained_losses(spalm, base, train, held, s)}


def markdown(record: dict[str, Any]) -> str:
    point, env = record["point"], record["environment"]
    s = point["settings"]
    tokens = s["batch"] * 2 * s["seq"]
    table = markdown_table(["model", "step (ms, median)", "tokens / s", "peak (MiB)"], [
        [name, f"{r['seconds']['median'] * 1e3:.1f}", f"{tokens / r['seconds']['median']:,.0f}",
         f"{r['peak_bytes'] / 2**20:.1f}"] for name, r in point["rows"].items()])
    quality = markdown_table(["model", "held-out loss (nats / token)"],
                             [[name, f"{v:.3f}"] for name, v in point["held_out_loss"].items()])
    return "\n\n".join([
        "# SPALM: training step and held-out loss",
        f"dim {s['dim']}, depth {s['depth']}, {s['heads']} heads, segments of {s['seq']} (2 per document) x batch "
        f"{s['batch']}, XL memory {s['mem']}, k {s['k']}, {s['docs']} training documents (twice in the datastore), "
        f"{s['held']} held-out (once); {s['steps']} training steps; float32, {env['torch_threads']} threads; "
        f"{env['cpu']}; torch {env['packages'].get('torch')}; {env['date']}, commit {env['polyformer_commit']}. "
        "Method: `benchmarks/spalm.py` (docstring).", table,
        ", ".join(f"{k}: {v:.2f}x" for k, v in point["ratios"].items()), quality])


def main(argv: list[str] | None = None) -> int:
    args = started(one_shot_parser("python -m benchmarks.spalm", __doc__.split("\n\n")[0]), argv)
    s, repeats, warmup = (QUICK, 1, 0) if args.quick else (FULL, args.repeats, 1)
    out_dir = args.out_dir or (Path("/tmp/spalm") if args.quick else Path("docs/memories"))
    record = {"point": measure(s, repeats, warmup, args.max_wait), "environment": environment(["torch"])}
    return finish_report(out_dir / "benchmark_spalm.json", record, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
