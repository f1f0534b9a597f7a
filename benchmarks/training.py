"""Training-step speed (issue 6): polyformer against x-transformers 2.31.10 (default attention and
`attn_flash=True`) and Hugging Face GPT-2 of the same shape, plus polyformer's bf16 autocast and
torch.compile numbers.

    python -m benchmarks.run --suite training [--quick]

One step = forward, cross-entropy over every position, backward, AdamW step, grads set to None;
float32 on the CPU, random weights and tokens (nothing is downloaded). Vocab 256, dim 512, depth 6,
8 heads; seq 512 batch 8 and seq 1024 batch 4. All competitors of a shape live in one process and
are timed in alternating rounds; medians over the rounds no other process disturbed are reported
(`quiet_rounds`: this machine is shared, and one busy neighbour on its 2 cores triples a step).

Model FLOPs (PaLM, arXiv:2204.02311, appendix B), per trained token:
    6 * N + 12 * depth * seq * dim
N counts the weights of every matrix multiply: depth * 12 * dim^2 (q, k, v, out; feedforward in and
out at 4x) plus the output projection dim * vocab. Token and position embeddings are lookups and are
not counted, nor are biases and norms. The attention term counts QK^T and AV over the full seq x seq
square, as PaLM does, although a causal kernel needs only about half of it. The same nominal count
is used for every library, so model FLOPs utilisation (MFU) compares speed, not bookkeeping.
MFU = model FLOP/s / matmul peak, the peak being the best median GFLOP/s of large float32 matrix
products measured in the same run with the same threads (`matmul_peak`).
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import (QUIET, Competitor, OthersMeter, log, markdown_table, pyplot, quiet_rounds, save_figure,
                     spread, wait_for_quiet)

VOCAB, DIM, DEPTH, HEADS = 256, 512, 6, 8
SHAPES = ((512, 8), (1024, 4))               # (seq, batch)
LIBRARIES = ("polyformer", "polyformer, ATen attention", "x-transformers", "x-transformers flash", "HF GPT-2")
TARGETS = {"x-transformers flash": 1.1, "x-transformers": 1.5, "HF GPT-2": 1.35}
MFU_TARGET = 0.65


# --- the models -------------------------------------------------------------------------------

def build(library: str, max_seq_len: int, *, dim: int = DIM, depth: int = DEPTH, heads: int = HEADS,
          vocab: int = VOCAB, seed: int = 0) -> nn.Module:
    """A decoder LM of the given shape from one of LIBRARIES; dropout off everywhere."""
    torch.manual_seed(seed)
    if library.startswith("polyformer"):
        from polyformer import Decoder, TransformerWrapper

        return TransformerWrapper(num_tokens=vocab, max_seq_len=max_seq_len,
                                  attn_layers=Decoder(dim=dim, depth=depth, heads=heads))
    if library in ("x-transformers", "x-transformers flash"):
        import x_transformers as xt

        return xt.TransformerWrapper(num_tokens=vocab, max_seq_len=max_seq_len, attn_layers=xt.Decoder(
            dim=dim, depth=depth, heads=heads, attn_flash=library.endswith("flash")))
    if library == "HF GPT-2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_embd=dim, n_layer=depth, n_head=heads, vocab_size=vocab, n_positions=max_seq_len,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=None, pad_token_id=0, attn_implementation="sdpa")
        return GPT2LMHeadModel(cfg)
    raise ValueError(f"unknown library {library!r}; expected one of {LIBRARIES}")


def logits_of(model: nn.Module, x: Tensor) -> Tensor:
    """(b, n, vocab) logits, whatever the library returns."""
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def matmul_params(dim: int = DIM, depth: int = DEPTH, vocab: int = VOCAB) -> int:
    """N of the FLOP formula: weights that take part in matrix multiplies (see the module docstring)."""
    return depth * 12 * dim * dim + dim * vocab


def model_flops_per_token(seq: int, dim: int = DIM, depth: int = DEPTH, vocab: int = VOCAB) -> int:
    return 6 * matmul_params(dim, depth, vocab) + 12 * depth * seq * dim


# --- the measured peak ------------------------------------------------------------------------

PEAK_SHAPES = ((2048, 2048, 2048), (4096, 512, 2048), (4096, 2048, 512), (4096, 512, 1536))


def matmul_peak(repeats: int = 9, attempts: int = 3) -> dict[str, Any]:
    """Median GFLOP/s of float32 (m, k) @ (k, n) for a square product and the model's own GEMM
    shapes (tokens x dim x 4 dim, ...); the peak is the best of the medians. A shape measured while
    other processes were busy is measured again (up to `attempts` times)."""
    results, others = {}, {}
    for m, k, n in PEAK_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        for attempt in range(attempts):
            if attempt:
                wait_for_quiet()
            for _ in range(2):
                a @ b
            rates = []
            meter = OthersMeter().start()
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                rates.append(2 * m * k * n / (time.perf_counter() - start) / 1e9)
            busy = meter.cpus()
            if busy < QUIET:
                break
        results[f"{m}x{k}x{n}"], others[f"{m}x{k}x{n}"] = statistics.median(rates), busy
    return {"gflops_by_shape": results, "others_cpus": others, "peak_gflops": max(results.values())}


# --- one step ---------------------------------------------------------------------------------

def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor,
               autocast: torch.dtype | None = None) -> Callable[[], float]:
    vocab = model_vocab(model)

    def step() -> float:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            logits = logits_of(model, x)
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def forward_backward(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], float]:
    """forward + backward only (the torch.compile comparison); gradients dropped afterwards."""
    vocab = model_vocab(model)

    def step() -> float:
        loss = F.cross_entropy(logits_of(model, x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss.item()
    return step


def model_vocab(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    return cfg.vocab_size if cfg is not None else model.num_tokens


def batch(seq: int, size: int, vocab: int = VOCAB, seed: int = 1234) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def trainer(library: str, seq: int, size: int, autocast: torch.dtype | None = None) -> tuple[nn.Module, Callable]:
    model = build(library, seq).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = batch(seq, size)
    step = train_step(model, opt, x, y, autocast)
    if library == "polyformer, ATen attention":      # our own CPU attention kernel off: the baseline
        from polyformer.attention.kernels import cpu

        def aten_step() -> float:
            with cpu.switched_off():
                return step()
        return model, aten_step
    return model, step


# --- the suite --------------------------------------------------------------------------------

def _summary(c: Competitor, flops_per_step: float, peak: float) -> dict[str, Any]:
    tokens = c.units
    med = statistics.median(c.seconds)
    cpu = statistics.median(c.cpu_seconds)
    return {"step_seconds": spread(c.seconds), "tokens_per_s": tokens / med,
            "cpu_seconds_median": cpu, "cpu_per_wall": cpu / med,
            "model_tflops_per_s": flops_per_step / med / 1e12, "mfu": flops_per_step / med / 1e9 / peak,
            "seconds": c.seconds, "cpu_seconds": c.cpu_seconds}


def run(quick: bool = False, repeats: int | None = None, out_dir: Path | None = None) -> dict[str, Any]:
    """Time every library at both shapes, bf16 autocast and torch.compile for polyformer; return the
    record (JSON-ready) with a `markdown` section and `plots`."""
    warnings.filterwarnings("ignore")
    repeats = repeats or (2 if quick else 9)   # 9: the step times of this shared machine move ±20%
    shapes = tuple((s, b // 4) for s, b in SHAPES) if quick else SHAPES
    log("measuring the float32 matmul peak ...")
    peak_before = matmul_peak()
    record: dict[str, Any] = {"shapes": {}, "repeats": repeats, "quick": quick,
                              "config": {"vocab": VOCAB, "dim": DIM, "depth": DEPTH, "heads": HEADS,
                                         "dtype": "float32", "optimizer": "AdamW(lr=1e-4)",
                                         "threads": torch.get_num_threads()},
                              "flop_formula": "per token: 6 * N + 12 * depth * seq * dim; N = depth * 12 * dim^2 "
                                              "+ dim * vocab (matmul weights; embeddings not counted)",
                              "matmul_params": matmul_params()}
    for seq, size in shapes:
        log(f"training step, seq {seq} batch {size}: building ...")
        comps, losses, params = [], {}, {}
        for lib in LIBRARIES:
            model, step = trainer(lib, seq, size)
            losses[lib] = step()                  # also the first warmup
            params[lib] = sum(p.numel() for p in model.parameters())
            comps.append(Competitor(lib, step, seq * size))
        rounds = quiet_rounds(comps, repeats, warmup=1)
        record["shapes"][f"{seq}x{size}"] = {"seq": seq, "batch": size, "initial_loss": losses, "params": params,
                                            "competitors": comps, "rounds": rounds}
        del comps

    # polyformer only: bf16 autocast against float32, and torch.compile on forward + backward
    seq, size = shapes[0]
    log(f"bf16 autocast vs float32, seq {seq} batch {size} ...")
    comps = []
    for name, dtype in (("polyformer float32", None), ("polyformer bf16 autocast", torch.bfloat16)):
        _, step = trainer("polyformer", seq, size, autocast=dtype)
        comps.append(Competitor(name, step, seq * size))
    rounds = quiet_rounds(comps, repeats, warmup=2)
    record["bf16"] = {"seq": seq, "batch": size, "competitors": comps, "rounds": rounds,
                      "cpu_flags": cpu_flags(("amx_bf16", "amx_tile", "avx512_bf16", "avx512f"))}

    log(f"torch.compile, forward + backward, seq {seq} batch {size} ...")
    x, y = batch(seq, size)
    eager = build("polyformer", seq).train()
    compiled_model = build("polyformer", seq).train()
    comps = [Competitor("polyformer eager", forward_backward(eager, x, y), seq * size)]
    compile_info: dict[str, Any] = {"seq": seq, "batch": size}
    try:
        compiled = torch.compile(compiled_model)
        start = time.perf_counter()
        forward_backward(compiled, x, y)()
        compile_info["first_call_seconds"] = time.perf_counter() - start
        comps.append(Competitor("polyformer torch.compile", forward_backward(compiled, x, y), seq * size))
    except Exception as err:                   # the backend needs a C++ toolchain; report, don't fail
        compile_info["error"] = f"{type(err).__name__}: {err}"[:500]
    compile_info["rounds"] = quiet_rounds(comps, repeats, warmup=1)
    compile_info["competitors"] = comps
    record["compile"] = compile_info

    log("measuring the float32 matmul peak again ...")
    peak_after = matmul_peak()
    peak = max(peak_before["peak_gflops"], peak_after["peak_gflops"])
    record["matmul_peak"] = {"before": peak_before, "after": peak_after, "peak_gflops": peak}
    finish(record, peak)
    record["markdown"] = markdown(record)
    if out_dir is not None:
        record["plots"] = plots(record, out_dir)
    return record


def cpu_flags(wanted: tuple[str, ...]) -> dict[str, bool]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return {f: f in have for f in wanted}


def finish(record: dict[str, Any], peak: float) -> None:
    """Competitor objects -> summaries (in place), with speedups and MFU."""
    for key, shape in record["shapes"].items():
        flops = model_flops_per_token(shape["seq"]) * shape["seq"] * shape["batch"]
        shape["flops_per_step"] = flops
        shape["results"] = {c.name: _summary(c, flops, peak) for c in shape.pop("competitors")}
        ours = shape["results"]["polyformer"]["tokens_per_s"]
        shape["polyformer_speedup"] = {lib: ours / r["tokens_per_s"] for lib, r in shape["results"].items()
                                       if lib != "polyformer"}
    for part in ("bf16", "compile"):
        seq, size = record[part]["seq"], record[part]["batch"]
        flops = model_flops_per_token(seq) * seq * size
        record[part]["results"] = {c.name: _summary(c, flops, peak) for c in record[part].pop("competitors")}
        names = list(record[part]["results"])
        if len(names) == 2:
            a, b = (record[part]["results"][n]["tokens_per_s"] for n in names)
            record[part]["speedup"] = b / a


def rounds_note(rounds: list[dict[str, Any]]) -> str:
    quiet = sum(x["quiet"] for x in rounds)
    if quiet:
        return f"{quiet} undisturbed of {len(rounds)} run"
    return f"**no undisturbed round** of {len(rounds)} (all kept; numbers inflated)"


def markdown(record: dict[str, Any]) -> str:
    peak = record["matmul_peak"]
    lines = ["## Training step", "",
             f"Forward + cross-entropy + backward + AdamW, float32, vocab {VOCAB} / dim {DIM} / depth {DEPTH} / "
             f"{HEADS} heads, random weights and tokens, {record['config']['threads']} threads; median of "
             f"{record['repeats']} alternating rounds after 1 warmup step (plus the build-time step); a round "
             f"during which other processes kept more than {QUIET} CPUs busy is discarded and run again.", "",
             f"Model FLOPs per token = 6 N + 12 depth seq dim (PaLM), N = depth 12 dim^2 + dim vocab = "
             f"{record['matmul_params'] / 1e6:.2f}M matmul weights; embeddings are lookups and not counted; "
             "the attention term counts the full seq x seq square (a causal kernel needs about half). "
             f"MFU is against the float32 matmul peak measured in this run: {peak['peak_gflops']:.1f} GFLOP/s "
             "(best median of " + ", ".join(f"{k} {v:.0f}" for k, v in peak["before"]["gflops_by_shape"].items())
             + " GFLOP/s before the suite; " + ", ".join(f"{v:.0f}" for v in peak["after"]["gflops_by_shape"].values())
             + " after).", ""]
    rows = []
    for key, shape in record["shapes"].items():
        for lib, r in shape["results"].items():
            speed = shape["polyformer_speedup"].get(lib)
            target = TARGETS.get(lib)
            rows.append([f"{shape['seq']} x {shape['batch']}", lib, f"{r['step_seconds']['median']:.2f}",
                         f"{r['tokens_per_s']:.0f}", f"{r['mfu'] * 100:.1f}%",
                         f"{speed:.2f}x" if speed else "-",
                         (f">= {target}x: " + ("met" if speed >= target else "**not met**")) if target else "-",
                         f"{r['cpu_per_wall']:.2f}"])
    lines += [markdown_table(["seq x batch", "library", "s/step", "tokens/s", "MFU", "polyformer speedup",
                              "target", "CPU/wall"], rows), ""]
    lines += ["Rounds: " + "; ".join(f"{s['seq']} x {s['batch']}: {rounds_note(s['rounds'])}"
                                    for s in record["shapes"].values()) + ".", ""]
    mfu = record["shapes"][next(iter(record["shapes"]))]["results"]["polyformer"]["mfu"]
    lines += [f"polyformer MFU at the first shape: {mfu * 100:.1f}% (target >= {MFU_TARGET * 100:.0f}%: "
              + ("met" if mfu >= MFU_TARGET else "**not met**") + "). CPU/wall is the process's CPU time per "
              "wall second (2.0 = both threads busy the whole step; less means waiting or a busy machine).", ""]
    bf = record["bf16"]
    flags = bf["cpu_flags"]
    rows = [[n, f"{r['step_seconds']['median']:.2f}", f"{r['tokens_per_s']:.0f}"] for n, r in bf["results"].items()]
    lines += ["### bf16 autocast", "",
              f"`torch.autocast('cpu', dtype=torch.bfloat16)` around forward and loss, seq {bf['seq']} batch "
              f"{bf['batch']}; weights and AdamW stay float32. CPU flags: "
              + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in flags.items())
              + (" - this CPU has no AMX units; bf16 matmuls run on AVX-512 BF16." if flags and not flags.get("amx_tile")
                 else "") + "", "",
              markdown_table(["run", "s/step", "tokens/s"], rows), "",
              f"bf16 / float32 speed: {bf.get('speedup', float('nan')):.2f}x ({rounds_note(bf['rounds'])}).", ""]
    comp = record["compile"]
    lines += ["### torch.compile", ""]
    if "error" in comp:
        lines += [f"torch.compile failed: `{comp['error']}`", ""]
    else:
        rows = [[n, f"{r['step_seconds']['median']:.2f}", f"{r['tokens_per_s']:.0f}"] for n, r in comp["results"].items()]
        lines += [f"Plain polyformer decoder, forward + backward (no optimizer), seq {comp['seq']} batch "
                  f"{comp['batch']}; default inductor backend; first compiled call (compilation) took "
                  f"{comp['first_call_seconds']:.0f} s.", "",
                  markdown_table(["run", "s/step", "tokens/s"], rows), "",
                  f"torch.compile gain: {comp.get('speedup', float('nan')):.2f}x ({rounds_note(comp['rounds'])}).", ""]
    return "\n".join(lines)


def plots(record: dict[str, Any], out_dir: Path) -> list[str]:
    plt = pyplot()
    shapes = list(record["shapes"].values())
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(LIBRARIES)
    for i, lib in enumerate(LIBRARIES):
        xs = [j + i * width for j in range(len(shapes))]
        axes[0].bar(xs, [s["results"][lib]["tokens_per_s"] for s in shapes], width, label=lib)
        axes[1].bar(xs, [s["results"][lib]["mfu"] * 100 for s in shapes], width, label=lib)
    for ax, title in zip(axes, ("tokens / s (higher is better)", "MFU % of measured matmul peak")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels([f"seq {s['seq']} x batch {s['batch']}" for s in shapes])
        ax.set_title(title)
    axes[1].axhline(MFU_TARGET * 100, color="grey", linestyle="--", linewidth=1)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Training step, float32, dim {DIM} depth {DEPTH} heads {HEADS}, "
                 f"{record['config']['threads']} threads")
    return save_figure(fig, out_dir, "training.png")


def to_json(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != "markdown"}


if __name__ == "__main__":
    print("run this suite through `python -m benchmarks.run --suite training`", file=sys.stderr)
    sys.exit(2)
