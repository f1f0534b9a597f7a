"""The cost of each optional polyformer feature relative to the plain decoder (issue 6): training-step
time, peak memory, and whether the attention keeps the fused `scaled_dot_product_attention` path.

    python -m benchmarks.run --suite features [--quick]

Plain model: `TransformerWrapper(num_tokens=256, max_seq_len=256, attn_layers=Decoder(dim=256,
depth=4, heads=4))`; each row adds one keyword. One training step (forward, cross-entropy, backward,
AdamW) at seq 256 batch 4, float32; every variant is timed once per round in alternating rounds and
the median is compared with the plain model's.

Memory: the peak of tensor bytes allocated during one step over those live when it starts
(activations, gradients, temporaries; weights and AdamW state already exist), from the allocator's
running total that `torch.profiler` records with `profile_memory=True`. Unlike RSS it does not depend
on what the C allocator keeps cached from earlier variants; polyformer's own buffer pool
(`polyformer/buffers.py`) is emptied before the measured step, so its buffers count too.

Fused path: during one training-mode forward, calls to `torch.nn.functional.scaled_dot_product_attention`
and to `DenseKernel.reference` are counted (the function and each kernel instance are wrapped for
that forward only); "yes" means every attention call went to SDPA.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .common import Competitor, log, markdown_table, pyplot, quiet_rounds, save_figure, spread
from .training import batch, train_step

VOCAB, DIM, DEPTH, HEADS, SEQ, BATCH = 256, 256, 4, 4, 256, 4

# (row label, Decoder keywords, TransformerWrapper keywords)
FEATURES: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("plain", {}, {}),
    ("rotary_pos_emb", {"rotary_pos_emb": True}, {}),
    ("alibi_pos_emb", {"alibi_pos_emb": True}, {}),
    ("rel_pos_bias", {"rel_pos_bias": True}, {}),
    ("position_infused_attn", {"position_infused_attn": True}, {}),
    ("attn_num_mem_kv=16", {"attn_num_mem_kv": 16}, {}),
    ("num_memory_tokens=16", {}, {"num_memory_tokens": 16}),
    ("attn_kv_heads=2", {"attn_kv_heads": 2}, {}),
    ("attn_kv_heads=1", {"attn_kv_heads": 1}, {}),
    ("attn_talking_heads", {"attn_talking_heads": True}, {}),
    ("attn_sparse_topk=8", {"attn_sparse_topk": 8}, {}),
    ("attn_use_entmax15", {"attn_use_entmax15": True}, {}),
    ("attn_collab_heads", {"attn_collab_heads": True}, {}),
    ("attn_on_attn", {"attn_on_attn": True}, {}),
    ("gate_values", {"gate_values": True}, {}),
    ("residual_attn", {"residual_attn": True}, {}),
    ("macaron", {"macaron": True}, {}),
    ("sandwich_coef=2", {"sandwich_coef": 2}, {}),
    ("shift_tokens=1", {"shift_tokens": 1}, {}),
    ("gate_residual", {"gate_residual": True}, {}),
    ("use_rezero", {"use_rezero": True}, {}),
    ("use_rmsnorm", {"use_rmsnorm": True}, {}),
    ("use_scalenorm", {"use_scalenorm": True}, {}),
    ("ff_glu", {"ff_glu": True}, {}),
    ("ff_relu_squared", {"ff_relu_squared": True}, {}),
    ("gradient_checkpointing", {"gradient_checkpointing": True}, {}),
)


def build(decoder: dict[str, Any], wrapper: dict[str, Any], seq: int = SEQ, seed: int = 0) -> nn.Module:
    from polyformer import Decoder, TransformerWrapper

    torch.manual_seed(seed)
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=seq, **wrapper,
                              attn_layers=Decoder(dim=DIM, depth=DEPTH, heads=HEADS, **decoder))


def attention_paths(model: nn.Module, run: Callable[[], Any]) -> dict[str, int]:
    """Calls to the fused paths (SDPA, our CPU kernel) and to DenseKernel.reference during `run()`, and
    how many dense kernels exist."""
    from polyformer.attention.kernels import cpu
    from polyformer.attention.kernels.dense import DenseKernel

    counts = {"sdpa": 0, "cpu_kernel": 0, "reference": 0}
    kernels = [m for m in model.modules() if isinstance(m, DenseKernel)]
    sdpa, cpu_attention = F.scaled_dot_product_attention, cpu.attention

    def counted(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    F.scaled_dot_product_attention = counted("sdpa", sdpa)     # the kernel looks them up at call time
    cpu.attention = counted("cpu_kernel", cpu_attention)
    for k in kernels:
        k.reference = counted("reference", k.reference)   # instance attribute: the class is untouched
    try:
        run()
    finally:
        F.scaled_dot_product_attention = sdpa
        cpu.attention = cpu_attention
        for k in kernels:
            del k.reference
    counts["kernels"] = len(kernels)
    return counts


def fused_verdict(c: dict[str, int]) -> str:
    fused = c["sdpa"] + c["cpu_kernel"]
    if c["reference"] == 0 and fused > 0:
        return "yes"
    if fused == 0:
        return "no"
    return f"partly ({fused} of {fused + c['reference']})"


def peak_step_bytes(step: Callable[[], Any]) -> int:
    """Peak bytes allocated during one call over those live when it starts (profiler's running total).
    polyformer's buffer pool is emptied first, so that the buffers a step takes from it are allocated,
    and counted, within the call rather than reused unseen from an earlier one."""
    from torch.profiler import ProfilerActivity, profile

    from polyformer import buffers

    gc.collect()
    buffers.release()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)
    memory = [e["args"] for e in events if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    if not memory:
        return 0
    # the running total is the allocator's since profiling was first switched on, and frees made while no
    # profiler listens (the pool released between variants) never lower it: measure from this call's start
    start = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(m["Total Allocated"] for m in memory) - start


def run(quick: bool = False, repeats: int | None = None, out_dir: Path | None = None) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    repeats = repeats or (2 if quick else 5)
    seq, size = (128, 2) if quick else (SEQ, BATCH)
    x, y = batch(seq, size)
    comps, info = [], {}
    for label, dec, wrap in FEATURES:
        try:
            model = build(dec, wrap, seq).train()
        except Exception as err:               # a keyword this version does not take: report the row
            info[label] = {"error": f"{type(err).__name__}: {err}"[:300]}
            log(f"features: {label}: {info[label]['error']}")
            continue
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = train_step(model, opt, x, y)
        paths = attention_paths(model, lambda: model(x))
        step()                                  # AdamW state now exists: the peak below is the step's own
        info[label] = {"keywords": {**dec, **wrap}, "paths": paths, "fused": fused_verdict(paths),
                       "peak_step_bytes": peak_step_bytes(step),
                       "params": sum(p.numel() for p in model.parameters())}
        comps.append(Competitor(label, step, seq * size))
        log(f"features: {label}: fused {info[label]['fused']}, step peak "
            f"{info[label]['peak_step_bytes'] / 2 ** 20:.0f} MiB")
    rounds = quiet_rounds(comps, repeats, warmup=1)
    plain = next(c for c in comps if c.name == "plain")
    t0 = statistics.median(plain.seconds)
    m0 = info["plain"]["peak_step_bytes"]
    for c in comps:
        t = statistics.median(c.seconds)
        info[c.name].update(step_seconds=spread(c.seconds), time_ratio=t / t0,
                            memory_ratio=info[c.name]["peak_step_bytes"] / m0,
                            cpu_seconds=c.cpu_seconds, seconds=c.seconds)
    record: dict[str, Any] = {"config": {"vocab": VOCAB, "dim": DIM, "depth": DEPTH, "heads": HEADS, "seq": seq,
                                         "batch": size, "dtype": "float32", "threads": torch.get_num_threads()},
                              "repeats": repeats, "quick": quick, "features": info,
                              "rounds": {"total": len(rounds), "quiet": sum(x["quiet"] for x in rounds),
                                         "others_cpus": [max(x["others_cpus"].values()) for x in rounds]}}
    record["markdown"] = markdown(record)
    if out_dir is not None:
        record["plots"] = plots(record, out_dir)
    return record


def markdown(record: dict[str, Any]) -> str:
    cfg, info = record["config"], record["features"]
    plain = info["plain"]
    rows = []
    for label, _, _ in FEATURES:
        r = info.get(label, {})
        if "error" in r:
            rows.append([f"`{label}`", "error", "-", "-", r["error"]])
            continue
        p = r["paths"]
        rows.append([f"`{label}`", f"{r['time_ratio']:.2f}", f"{r['memory_ratio']:.2f}", r["fused"],
                     f"{r['step_seconds']['median'] * 1e3:.0f} ms, {r['peak_step_bytes'] / 2 ** 20:.0f} MiB "
                     f"(SDPA {p['sdpa']}, CPU kernel {p['cpu_kernel']}, reference {p['reference']})"])
    return "\n".join([
        "## Cost of optional features", "",
        f"polyformer only. Plain: `Decoder(dim={cfg['dim']}, depth={cfg['depth']}, heads={cfg['heads']})`, vocab "
        f"{cfg['vocab']}; each row adds one keyword. Training step (forward, backward, AdamW) at seq {cfg['seq']} "
        f"batch {cfg['batch']}, float32, {cfg['threads']} threads, median of {record['repeats']} alternating "
        f"rounds ({record['rounds']['quiet']} undisturbed of {record['rounds']['total']} run; disturbed rounds "
        "are discarded). Memory: peak tensor bytes allocated during one step over those live at its start "
        f"(torch.profiler's allocator total). Plain: {plain['step_seconds']['median'] * 1e3:.0f} ms/step, "
        f"{plain['peak_step_bytes'] / 2 ** 20:.0f} MiB. Fused: all attention calls of one forward went to "
        "a fused kernel, `scaled_dot_product_attention` or, in float32 without mask or bias, "
        "polyformer's own CPU kernel (counted against `DenseKernel.reference`).", "",
        markdown_table(["feature", "time ratio", "memory ratio", "keeps fused attention", "step (attention calls)"],
                       rows), ""])


def plots(record: dict[str, Any], out_dir: Path) -> list[str]:
    plt = pyplot()

    rows = [(label, r) for label, r in record["features"].items() if "time_ratio" in r]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [r["time_ratio"] for _, r in rows], 0.4, label="time ratio")
    ax.barh([y - 0.2 for y in ys], [r["memory_ratio"] for _, r in rows], 0.4, label="memory ratio")
    ax.set_yticks(list(ys))
    ax.set_yticklabels([label + ("" if r["fused"] == "yes" else "  (unfused)") for label, r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", linewidth=1)
    ax.set_xlabel("relative to the plain decoder (1.0)")
    ax.legend()
    ax.set_title(f"polyformer feature cost, training step seq {record['config']['seq']} batch {record['config']['batch']}")
    return save_figure(fig, out_dir, "features.png")
