"""Infini-attention (issue 21): training step time and peak memory of polyformer's `attn_infini` against
infini-transformer-pytorch 0.2.1 at equal settings, and the cached == uncached gap of each.

    python -m benchmarks.infini [--quick] [--delta] [--repeats 3] [--max-wait 30] [--threads 2] [--out-dir docs/memories]

writes docs/memories/benchmark_infini[_delta].json and .md (docs/memories/infini.md explains the kernel).

Equal settings: a byte LM (256 tokens), dim 256, depth 4, 4 heads of 64, pre-norm RMSNorm, a GELU-gated
feedforward of inner size int(8/3 dim), rotary on the whole head, no q / k / v bias, a sequence of 1024 tokens in
segments of 256, batch 4, the linear (or, --delta, the delta) memory rule. A training step is the language-model
loss over the whole sequence and its backward. Theirs runs segment by segment through
`InfiniTransformerWrapper(..., backward=True)`; with `detach_mems_every_num_segments` = the number of segments it
computes the same full gradient as ours (the row compared: "equal gradient"); its default of 2 truncates the
gradient every two segments (a row of its own, cheaper in memory for it, not the same computation). Time:
alternating rounds in this one process (`common.quiet_rounds`), medians; memory: `features.peak_step_bytes`.

Cache parity: the largest |logit| difference between a token-by-token cached pass over the sequence and the
full forward, for ours (`new_state`) and for theirs (its `cached_kv` / `past_memories` protocol, as its
`generate` drives it), in float32 and in float64 (where rounding no longer hides a mismatch). Target (issue 21): time and memory ratios <= 1 at equal gradient; parity to 1e-6 (theirs).
--quick: dim 64, depth 2, 2 heads, 128 tokens in segments of 32, batch 2, one round, output under /tmp.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from polyformer import Decoder, TransformerWrapper

from .common import environment, finish_report, log, markdown_table, one_shot_parser, peaks_and_times, started

FULL = dict(dim=256, depth=4, heads=4, seq=1024, segment=256, batch=4)
QUICK = dict(dim=64, depth=2, heads=2, seq=128, segment=32, batch=2)
VOCAB = 256
THEIRS = "infini-transformer-pytorch"


def ours(s: dict[str, Any], delta: bool) -> TransformerWrapper:
    torch.manual_seed(0)
    stack = Decoder(dim=s["dim"], depth=s["depth"], heads=s["heads"], attn_dim_head=s["dim"] // s["heads"],
                    rotary_pos_emb=True, use_rmsnorm=True, ff_glu=True, ff_mult=8 / 3, attn_infini=True,
                    attn_infini_segment=s["segment"], attn_infini_delta=delta)
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=s["seq"], attn_layers=stack).train()


def theirs(s: dict[str, Any], delta: bool) -> torch.nn.Module | None:
    try:
        from infini_transformer_pytorch import InfiniTransformer
    except ImportError:
        return None
    torch.manual_seed(0)
    return InfiniTransformer(num_tokens=VOCAB, dim=s["dim"], depth=s["depth"], dim_head=s["dim"] // s["heads"],
                             heads=s["heads"], use_mem_delta_rule=delta).train()


def our_step(model: TransformerWrapper, seq: torch.Tensor) -> Callable[[], Any]:
    x, y = seq[:, :-1], seq[:, 1:]

    def step() -> Any:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).transpose(1, 2), y).backward()

    return step


def their_step(model: torch.nn.Module, seq: torch.Tensor, segment: int, detach_every: int) -> Callable[[], Any]:
    from infini_transformer_pytorch import InfiniTransformerWrapper

    wrapper = InfiniTransformerWrapper(model, segment_length=segment, detach_mems_every_num_segments=detach_every)

    def step() -> Any:
        model.zero_grad(set_to_none=True)
        wrapper(seq, backward=True)

    return step


@torch.no_grad()
def our_parity(model: TransformerWrapper, x: torch.Tensor) -> float:
    model.eval()
    full = model(x)
    state = model.new_state(x.shape[0], x.shape[1])
    cached = torch.cat([model(x[:, t:t + 1], state=state) for t in range(x.shape[1])], 1)
    model.train()
    return float((cached - full).abs().max())


@torch.no_grad()
def their_parity(model: torch.nn.Module, x: torch.Tensor, segment: int) -> float:
    """Their cached protocol (as `InfiniTransformerWrapper.generate`): the current segment's tokens with the
    cached keys, new memories at each segment's end; against segment-by-segment full forwards."""
    model.eval()
    full, memories = [], None
    for piece in x.split(segment, 1):
        logits, _, memories = model(piece, past_memories=memories, return_new_memories=True)
        full.append(logits)
    full = torch.cat(full, 1)
    cached_kv, memories, steps = None, None, []
    for t in range(1, x.shape[1] + 1):
        start = (t - 1) // segment * segment
        logits, cached_kv, memories = model(x[:, start:t], cached_kv=cached_kv, past_memories=memories,
                                            return_new_memories=t % segment == 0)
        steps.append(logits[:, -1:])
    model.train()
    return float((torch.cat(steps, 1) - full).abs().max())


def measure(s: dict[str, Any], delta: bool, repeats: int, warmup: int, max_wait: float) -> dict[str, Any]:
    seq = torch.randint(0, VOCAB, (s["batch"], s["seq"] + 1), generator=torch.Generator().manual_seed(0))
    segments = s["seq"] // s["segment"]
    mine = ours(s, delta)
    runs: dict[str, Callable[[], Any]] = {"polyformer": our_step(mine, seq)}
    parity = {"polyformer": our_parity(mine, seq[:, :-1]),
              "polyformer float64": our_parity(copy.deepcopy(mine).double(), seq[:, :-1])}
    other = theirs(s, delta)
    if other is not None:
        runs[f"{THEIRS} (equal gradient)"] = their_step(other, seq, s["segment"], segments)
        runs[f"{THEIRS} (default: detach every 2 segments)"] = their_step(other, seq, s["segment"], 2)
        parity[THEIRS] = their_parity(other, seq[:, :-1], s["segment"])
        parity[f"{THEIRS} float64"] = their_parity(copy.deepcopy(other).double(), seq[:, :-1], s["segment"])
    log(f"cache parity (max |cached - full| logit): {parity}")
    rows = peaks_and_times(runs, s["batch"] * s["seq"], repeats, warmup=warmup, max_wait=max_wait)
    ratios = {}
    for name in rows:
        if name != "polyformer":
            a, b = rows["polyformer"], rows[name]
            ratios[name] = {"time": a["seconds"]["median"] / b["seconds"]["median"],
                            "peak memory": a["peak_bytes"] / max(1, b["peak_bytes"])}
    params = {"polyformer": sum(p.numel() for p in mine.parameters())}
    if other is not None:
        params[THEIRS] = sum(p.numel() for p in other.parameters())
    return {"settings": {**s, "delta": delta}, "rows": rows, "ratios": ratios, "parity": parity, "params": params}


def markdown(record: dict[str, Any]) -> str:
    point, env = record["point"], record["environment"]
    s = point["settings"]
    tokens = s["batch"] * s["seq"]
    table = markdown_table(["model", "step (ms, median)", "tokens / s", "peak (MiB)"], [
        [name, f"{r['seconds']['median'] * 1e3:.1f}", f"{tokens / r['seconds']['median']:,.0f}",
         f"{r['peak_bytes'] / 2**20:.1f}"] for name, r in point["rows"].items()])
    ratios = markdown_table(["polyformer against", "time ratio", "peak memory ratio"], [
        [name, f"{r['time']:.2f}", f"{r['peak memory']:.2f}"] for name, r in point["ratios"].items()])
    parity = ", ".join(f"{k}: {v:.1e}" for k, v in point["parity"].items())
    params = ", ".join(f"{k}: {v:,}" for k, v in point["params"].items())
    return "\n\n".join([
        f"# Infini-attention: training step ({'delta' if s['delta'] else 'linear'} memory rule)",
        f"dim {s['dim']}, depth {s['depth']}, {s['heads']} heads, {s['seq']} tokens in segments of {s['segment']} x "
        f"batch {s['batch']}; float32, {env['torch_threads']} threads; {env['cpu']}; torch "
        f"{env['packages'].get('torch')}, {THEIRS} {env['packages'].get(THEIRS)}; {env['date']}, commit "
        f"{env['polyformer_commit']}. Parameters: {params}. Method: `benchmarks/infini.py` (docstring).",
        table, ratios, f"Cache parity, max |cached - full| logit: {parity}.",
        "Target (issue 21): ratios <= 1 against the equal-gradient row; parity to 1e-6 as theirs."])


def main(argv: list[str] | None = None) -> int:
    parser = one_shot_parser("python -m benchmarks.infini", __doc__.split("\n\n")[0])
    parser.add_argument("--delta", action="store_true", help="the delta memory rule")
    args = started(parser, argv)
    s, repeats, warmup = (QUICK, 1, 0) if args.quick else (FULL, args.repeats, 1)
    out_dir = args.out_dir or (Path("/tmp/infini") if args.quick else Path("docs/memories"))
    record = {"point": measure(s, args.delta, repeats, warmup, args.max_wait),
              "environment": environment(["torch", THEIRS])}
    name = "benchmark_infini_delta.json" if args.delta else "benchmark_infini.json"
    return finish_report(out_dir / name, record, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
