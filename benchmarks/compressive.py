"""Compressive Transformer (issue 21): training step time and peak memory of polyformer's compressed memory
against compressive-transformer-pytorch 0.4.0 at equal settings, and whether each trains its key / value
projections.

    python -m benchmarks.compressive [--quick] [--repeats 3] [--max-wait 30] [--threads 2] [--out-dir docs/memories]

writes docs/memories/benchmark_compressive.json and .md (docs/memories/compressive.md explains the memory).

Equal settings: a byte LM (256 tokens), dim 256, depth 4, 4 heads of 64, feedforward x4 GELU, pre-norm, segments
of 256 tokens, batch 4, XL memory 256, compressed memory 64, c = 4, a 1D convolution of kernel and stride c per
layer, reconstruction loss weight 1. Theirs: `CompressiveTransformer(gru_gated_residual=False,
enhanced_recurrence=False)` (plain residuals, each layer its own memory, as ours); its learned relative position
term against our rotary embedding. A training step is one segment's forward with full memories (both primed by
three segments), its language-model loss plus the reconstruction loss, and the backward. Time: alternating rounds
(`common.quiet_rounds`), medians; memory: `features.peak_step_bytes`. Target (issue 21): at least as fast, no more
memory.

Their K / V weights: SelfAttention.forward calls `self.to_kv.weight.detach_()` on every training step that
compresses, in place: the parameter stops requiring grad and never changes again. The benchmark takes an SGD
step of each model and records whether the K / V weights moved (theirs: no; ours: yes). Their backward is
lighter for it (no K / V weight gradients).
--quick: dim 64, depth 2, segments of 64, one round without warmup, output under /tmp unless --out-dir.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from polyformer import Decoder, TransformerWrapper

from .common import environment, finish_report, log, markdown_table, one_shot_parser, peaks_and_times, started

FULL = dict(dim=256, depth=4, heads=4, seq=256, batch=4, mem=256, cmem=64, ratio=4)
QUICK = dict(dim=64, depth=2, heads=2, seq=64, batch=2, mem=64, cmem=16, ratio=4)
VOCAB = 256


def ours(s: dict[str, Any]) -> TransformerWrapper:
    torch.manual_seed(0)
    stack = Decoder(dim=s["dim"], depth=s["depth"], heads=s["heads"], attn_dim_head=s["dim"] // s["heads"],
                    rotary_pos_emb=True)
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=s["seq"], attn_layers=stack, max_mem_len=s["mem"],
                              max_cmem_len=s["cmem"], cmem_ratio=s["ratio"], cmem_fn="conv1d").train()


def theirs(s: dict[str, Any]) -> torch.nn.Module | None:
    try:
        from compressive_transformer_pytorch import CompressiveTransformer
    except ImportError:
        return None
    torch.manual_seed(0)
    return CompressiveTransformer(num_tokens=VOCAB, dim=s["dim"], seq_len=s["seq"], depth=s["depth"], heads=s["heads"],
                                  mem_len=s["mem"], cmem_len=s["cmem"], cmem_ratio=s["ratio"],
                                  gru_gated_residual=False, enhanced_recurrence=False).train()


def our_step(model: TransformerWrapper, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    mems = None
    with torch.no_grad():
        for _ in range(3):
            _, mems = model(x, mems=mems, return_mems=True)

    def step() -> Any:
        model.zero_grad(set_to_none=True)
        logits, record = model(x, mems=mems, return_intermediates=True)
        loss = F.cross_entropy(logits.transpose(1, 2), y) + record.losses.total()
        loss.backward()
        return record.mems

    return step


def their_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    mems = None
    with torch.no_grad():
        for _ in range(3):
            _, mems, _ = model(x, memories=mems)

    def step() -> Any:
        model.zero_grad(set_to_none=True)
        logits, new, aux = model(x, memories=mems)
        (F.cross_entropy(logits.transpose(1, 2), y) + aux.sum()).backward()
        return new

    return step


def kv_trains(model: torch.nn.Module, weight: Callable[[], torch.Tensor], step: Callable[[], Any]) -> bool:
    """Whether one step and an SGD update (lr 0.1) change the K / V weights `weight()`."""
    before = weight().detach().clone()
    step()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    return not torch.equal(before, weight().detach())


def measure(s: dict[str, Any], repeats: int, warmup: int, max_wait: float) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, VOCAB, (s["batch"], s["seq"] + 1), generator=gen)
    x, y = seq[:, :-1], seq[:, 1:]
    runs: dict[str, Callable[[], Any]] = {}
    trains: dict[str, bool] = {}
    mine = ours(s)
    runs["polyformer"] = our_step(mine, x, y)
    kv = slice(s["dim"], None)              # to_qkv rows: q | k | v
    trains["polyformer"] = kv_trains(mine, lambda: mine.attn_layers.blocks[0].branch.project.to_qkv.weight[kv],
                                     runs["polyformer"])
    other = theirs(s)
    if other is not None:
        runs["compressive-transformer-pytorch"] = their_step(other, x, y)
        attn = other.attn_layers[0].fn.fn
        trains["compressive-transformer-pytorch"] = kv_trains(other, lambda: attn.to_kv.weight,
                                                              runs["compressive-transformer-pytorch"])
    log(f"K / V weights train: {trains}")
    rows = peaks_and_times(runs, s["batch"] * s["seq"], repeats, warmup=warmup, max_wait=max_wait,
                           rows={name: {"kv_weights_train": t} for name, t in trains.items()})
    ratios = {}
    if other is not None:
        a, b = rows["polyformer"], rows["compressive-transformer-pytorch"]
        ratios = {"time polyformer / theirs": a["seconds"]["median"] / b["seconds"]["median"],
                  "peak memory polyformer / theirs": a["peak_bytes"] / max(1, b["peak_bytes"])}
    return {"settings": s, "rows": rows, "ratios": ratios}


def markdown(record: dict[str, Any]) -> str:
    point, env = record["point"], record["environment"]
    s = point["settings"]
    tokens = s["batch"] * s["seq"]
    table = markdown_table(["model", "step (ms, median)", "tokens / s", "peak (MiB)", "K / V weights train"], [
        [name, f"{r['seconds']['median'] * 1e3:.1f}", f"{tokens / r['seconds']['median']:,.0f}",
         f"{r['peak_bytes'] / 2**20:.1f}", "yes" if r["kv_weights_train"] else "no (detached in place)"]
        for name, r in point["rows"].items()])
    return "\n\n".join([
        "# Compressive Transformer: training step",
        f"dim {s['dim']}, depth {s['depth']}, {s['heads']} heads, segments of {s['seq']} x batch {s['batch']}, "
        f"memory {s['mem']}, compressed memory {s['cmem']}, c {s['ratio']}, conv1d; float32, {env['torch_threads']} "
        f"threads; {env['cpu']}; torch {env['packages'].get('torch')}, compressive-transformer-pytorch "
        f"{env['packages'].get('compressive-transformer-pytorch')}; {env['date']}, commit {env['polyformer_commit']}. "
        "Method: `benchmarks/compressive.py` (docstring).", table,
        ", ".join(f"{k}: {v:.2f}x" for k, v in point["ratios"].items()),
        "Target (issue 21): time and peak memory ratios <= 1. Their K / V projection stops training after its first "
        "compressing step (`to_kv.weight.detach_()`), which also spares their backward the K / V weight gradients."])


def main(argv: list[str] | None = None) -> int:
    args = started(one_shot_parser("python -m benchmarks.compressive", __doc__.split("\n\n")[0]), argv)
    s, repeats, warmup = (QUICK, 1, 0) if args.quick else (FULL, args.repeats, 1)
    out_dir = args.out_dir or (Path("/tmp/compressive") if args.quick else Path("docs/memories"))
    record = {"point": measure(s, repeats, warmup, args.max_wait),
              "environment": environment(["torch", "compressive-transformer-pytorch"])}
    return finish_report(out_dir / "benchmark_compressive.json", record, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
