"""The attention kernel alone, at the training benchmark's shapes: polyformer's CPU kernel
(`polyformer/attention/kernels/cpu.py`) against ATen's fused CPU kernel (what
`scaled_dot_product_attention` runs for x-transformers' `attn_flash=True` and Hugging Face's "sdpa")
and the explicit einsum + softmax path (x-transformers' default attention).

    python -m benchmarks.attention [--repeats 7] [--out docs/benchmarks/attention.json]
    python -m benchmarks.run --suite attention      # the same, as a section of docs/benchmarks.md

Causal self-attention, float32, 8 heads of 64, seq 512 batch 8 and seq 1024 batch 4, the process's
threads (2 by default). Forward alone (autograd recording, as in training) and forward + backward
with a fixed output gradient; all three alternate in every round and the medians are reported. The
outputs and gradients of the three are compared before timing (the run exits 1 if they differ).

GFLOP/s count the products a causal kernel that recomputes its weights needs: forward 2 (QK^T, PV),
backward 5 (QK^T again, dV, dP, dQ, dK), each 2 * batch * heads * seq^2 / 2 * 64 FLOPs; the same
nominal count for every kernel, so the rates compare times. (Training keeps the weights up to 512
keys, `cpu.KEEP_KEYS`, and its backward then runs four of the five; "weights recomputed" is the
FlashAttention recipe, what polyformer runs at 1024.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from polyformer.attention.kernels import cpu
from polyformer.attention.kernels.dense import DenseKernel
from polyformer.attention.normalize import Softmax
from polyformer.interfaces import KV

from .common import Competitor, environment, log, markdown_table, quiet_rounds, set_threads, write_report

SHAPES = ((512, 8), (1024, 4))                # (seq, batch)
HEADS, DIM_HEAD = 8, 64
KERNELS = ("polyformer", "polyformer, weights recomputed", "ATen fused (SDPA)", "explicit")


def attend(kernel: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    if kernel == "polyformer":               # training keeps the weights for the backward (cpu.keeps)
        return lambda q, k, v: cpu.attention(q, k, v, DIM_HEAD ** -0.5, True)
    if kernel == "polyformer, weights recomputed":

        def recomputed(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            with cpu.recomputed_weights():
                return cpu.attention(q, k, v, DIM_HEAD ** -0.5, True)
        return recomputed
    if kernel == "ATen fused (SDPA)":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # polyformer's explicit reference path: einsum, masked softmax, einsum, as x-transformers' default
    explicit = DenseKernel(HEADS, DIM_HEAD ** -0.5, 0.0, Softmax(), fused=False)
    return lambda q, k, v: explicit(q, KV(k, v, None, None), mask=None, bias=None, causal=True).out


def inputs(seq: int, batch: int) -> tuple[list[Tensor], Tensor]:
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(batch, HEADS, seq, DIM_HEAD, generator=g).requires_grad_() for _ in range(3)]
    return qkv, torch.randn(batch, HEADS, seq, DIM_HEAD, generator=g)


def forward_only(fn: Callable, qkv: list[Tensor]) -> Callable[[], Any]:
    return lambda: fn(*qkv)


def forward_backward(fn: Callable, qkv: list[Tensor], grad: Tensor) -> Callable[[], Any]:
    return lambda: torch.autograd.grad(fn(*qkv), qkv, grad)


def agree(qkv: list[Tensor], grad: Tensor) -> float:
    """Largest difference of the outputs and gradients of every kernel from the explicit path's."""
    results = {}
    for kernel in KERNELS:
        out = attend(kernel)(*qkv)
        results[kernel] = [out, *torch.autograd.grad(out, qkv, grad)]
    return max((a - b).abs().max().item() for kernel in KERNELS
               for a, b in zip(results[kernel], results["explicit"]))


def causal_gflop(seq: int, batch: int, products: int) -> float:
    return products * 2 * batch * HEADS * seq * seq / 2 * DIM_HEAD / 1e9


def run(repeats: int) -> dict[str, Any]:
    if cpu.extension() is None:
        raise SystemExit(f"the CPU kernel could not be built: {cpu._built.get('error')}")
    record: dict[str, Any] = {"environment": environment(["torch"]), "repeats": repeats, "shapes": {}}
    for seq, batch in SHAPES:
        qkv, grad = inputs(seq, batch)
        difference = agree(qkv, grad)
        log(f"seq {seq} batch {batch}: largest difference from the explicit path {difference:.2e}")
        if difference > 1e-4:
            raise SystemExit(f"the kernels disagree by {difference:.2e} at seq {seq} batch {batch}")
        comps = []
        for kernel in KERNELS:
            comps.append(Competitor(f"{kernel} forward", forward_only(attend(kernel), qkv), 1))
            comps.append(Competitor(f"{kernel} forward+backward", forward_backward(attend(kernel), qkv, grad), 1))
        rounds = quiet_rounds(comps, repeats, warmup=1)
        medians = {c.name: statistics.median(c.seconds) for c in comps}
        record["shapes"][f"{seq}x{batch}"] = {
            "seq": seq, "batch": batch, "max_difference": difference, "median_seconds": medians,
            "seconds": {c.name: c.seconds for c in comps},
            "quiet_rounds": sum(r["quiet"] for r in rounds), "rounds": len(rounds)}
    return record


def markdown(record: dict[str, Any], footer: bool = True) -> str:
    rows = []
    for shape in record["shapes"].values():
        seq, batch, med = shape["seq"], shape["batch"], shape["median_seconds"]
        for part, products in (("forward", 2), ("forward+backward", 7)):
            ours = med[f"polyformer {part}"]
            for kernel in KERNELS:
                t = med[f"{kernel} {part}"]
                rows.append([f"{seq} x {batch}", part, kernel, f"{t * 1e3:.1f}",
                             f"{causal_gflop(seq, batch, products) / t:.0f}",
                             "-" if kernel == "polyformer" else f"{t / ours:.2f}x"])
    env = record["environment"]
    return "\n".join([
        "## Attention kernel alone", "",
        f"Causal self-attention, float32, {HEADS} heads of {DIM_HEAD}, {env['torch_threads']} threads, median of "
        f"{record['repeats']} undisturbed alternating rounds; autograd records in both parts, as in training. "
        "GFLOP/s count the causal half of each product (forward 2 products, backward 5, for every kernel; "
        "polyformer keeps the weights in training up to 512 keys and its backward then runs 4). ATen fused is what "
        "`scaled_dot_product_attention` runs for x-transformers' `attn_flash=True` and Hugging Face's sdpa; "
        "explicit is x-transformers' default attention.", "",
        markdown_table(["seq x batch", "part", "kernel", "ms", "GFLOP/s", "polyformer speedup"], rows), "",
        "Largest difference of outputs and gradients from the explicit path: "
        + ", ".join(f"{s['seq']} x {s['batch']}: {s['max_difference']:.1e}" for s in record["shapes"].values())
        + ".",
    ] + (["", f"Measured {env['date']} on {env['cpu']}, torch {env['packages']['torch']}, "
              f"polyformer commit {env['polyformer_commit']}."] if footer else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/benchmarks/attention.json")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    record = run(args.repeats)
    text = markdown(record)
    write_report(args.out, record, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
