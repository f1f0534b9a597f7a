"""Memorizing Transformer (issue 21): training step time and peak memory of a language model with one kNN
memory layer, polyformer against memorizing-transformers-pytorch 0.4.1 at equal settings, and a live check of
that package's FIFO and clear-on-boundary behaviour.

    python -m benchmarks.memorizing [--quick] [--repeats 3] [--max-wait 30] [--threads 2] [--out-dir docs/memories]

writes docs/memories/benchmark_memorizing.json and .md (docs/memories/memorizing.md explains the layer).

Settings (both): dim 256, depth 4, 4 heads of 64, the kNN layer third of four, 32 retrieved per query, a memory
of 4096 entries per batch row, segments of 256 tokens, batch 2, float32, no XL memory. A step is one segment's
forward (retrieval, then writing its keys / values), the next-token loss and its backward; the memories are filled
to capacity before timing, so every timed step evicts. Rows: ours with the exact torch search (knn_index "flat"),
ours with faiss HNSW (knn_index "hnsw": M 32, efSearch 64, widened by the evicted share), the same
with the package's HNSW settings (M 15, efSearch 32: set on the store, no keyword), the package's (faiss HNSW,
M 15, efSearch 16, which faiss raises to k; its index is reset when over capacity, so it holds 256 to 4096
entries; its memmap database). Both models
keep one key / value head (ours: attn_one_kv_head), as the package's kNN layer does. The package imports
`einops_exts` and `joblib`, which its --no-deps install lacks here: the two functions it uses from each are
provided in-process (`_stand_ins`). Its model differs in kind where the paper leaves room: a joint softmax
over memory and local keys instead of the paper's gate, T5 relative bias (ours: rotary). Time: alternating
rounds (`common.quiet_rounds`), medians; memory: `features.peak_step_bytes` (both through `common.peaks_and_times`).
Target (issue 21): at least as fast, no more memory. --quick: segments of 64, memory 512, one round.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from polyformer import Decoder, TransformerWrapper
from polyformer.attention.knn_memory import memories as knn_memories

from .common import environment, finish_report, log, markdown_table, one_shot_parser, peaks_and_times, started

DIM, DEPTH, HEADS, DIM_HEAD, TOPK, BATCH, VOCAB = 256, 4, 4, 64, 32, 2, 256
THEIR_HNSW = dict(hnsw_m=15, ef_search=32)     # the package's M; its efSearch 16 is raised to k = 32 by faiss


def _stand_ins() -> None:
    """The two helpers each of einops_exts and joblib that the package calls, when they are not installed."""
    from einops import repeat

    if "einops_exts" not in sys.modules:
        try:
            import einops_exts  # noqa: F401
        except ImportError:
            module = types.ModuleType("einops_exts")
            module.repeat_many = lambda tensors, pattern, **sizes: [repeat(t, pattern, **sizes) for t in tensors]
            sys.modules["einops_exts"] = module
    try:
        import joblib  # noqa: F401
    except ImportError:
        module = types.ModuleType("joblib")
        module.delayed = lambda fn: (lambda *args, **kw: (fn, args, kw))
        module.Parallel = lambda n_jobs=1: (lambda calls: [fn(*a, **kw) for fn, a, kw in calls])
        module.cpu_count = lambda: 1
        sys.modules["joblib"] = module


def theirs_module() -> Any | None:
    try:
        _stand_ins()
        import memorizing_transformers_pytorch as package
    except ImportError as error:
        log(f"memorizing-transformers-pytorch unavailable: {error}")
        return None
    return package


def ours(index: str, size: int) -> TransformerWrapper:
    torch.manual_seed(0)
    stack = Decoder(dim=DIM, depth=DEPTH, heads=HEADS, attn_dim_head=DIM_HEAD, attn_one_kv_head=True,
                    rotary_pos_emb=True, knn_memory_layers=(2,), knn_memory_size=size, knn_topk=TOPK, knn_index=index)
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=4096, attn_layers=stack).train()


def steps(seq: int, size: int, folder: str) -> dict[str, Callable[[], None]]:
    """name -> one training step on the next segment of a stream (memories filled to capacity first)."""
    data = torch.randint(0, VOCAB, (BATCH, 4 * seq + 1), generator=torch.Generator().manual_seed(0))
    segments = [data[:, s:s + seq + 1] for s in range(0, 4 * seq, seq)]
    out: dict[str, Callable[[], None]] = {}

    def stepper(model: torch.nn.Module, call: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        count = [0]

        def run() -> None:
            seg = segments[count[0] % len(segments)]
            count[0] += 1
            model.zero_grad(set_to_none=True)
            F.cross_entropy(call(seg[:, :-1]).transpose(1, 2), seg[:, 1:]).backward()
        for _ in range(-(-size // seq)):       # fill the memory
            run()
        return run

    for name, index, tuned in (("polyformer (flat, torch)", "flat", {}), ("polyformer (hnsw, faiss)", "hnsw", {}),
                               ("polyformer (hnsw, faiss, M 15, ef 32)", "hnsw", THEIR_HNSW)):
        model = ours(index, size)
        for m in knn_memories(model):    # before the first write: the indexes are made with the spec
            m.store.spec = dataclasses.replace(m.store.spec, **tuned)
        out[name] = stepper(model, model)
    package = theirs_module()
    if package is not None:
        torch.manual_seed(0)
        model = package.MemorizingTransformer(num_tokens=VOCAB, dim=DIM, depth=DEPTH, heads=HEADS, dim_head=DIM_HEAD,
                                              memorizing_layers=(3,), max_knn_memories=size,
                                              num_retrieved_memories=TOPK, knn_memories_directory=folder).train()
        memories = model.create_knn_memories(batch_size=BATCH)
        out["memorizing-transformers-pytorch"] = stepper(model, lambda x: model(x, memories))
    return out


def package_bugs(folder: str) -> dict[str, Any]:
    """What the package's memory gives back once full, and whether its clear-on-<sos> clears."""
    package = theirs_module()
    if package is None:
        return {}
    from memorizing_transformers_pytorch.knn_memory import KNNMemory

    memory = KNNMemory(dim=4, max_memories=8, num_indices=1, memmap_filename=f"{folder}/fifo.memmap",
                       multiprocessing=False)
    first, second = torch.eye(4).repeat(2, 1)[:6], -torch.eye(4).repeat(2, 1)[:6]     # 6 + 6 > 8 entries
    for keys in (first, second):
        memory.add(torch.stack((keys, keys * 10), dim=1)[None])     # (1, n, kv, d): value = 10 * key
    found, mask = memory.search(second[:1][None], 1)                 # the newest first entry, looked up exactly
    returned_key = found[0, 0, 0, 0]
    fifo = {"query": second[0].tolist(), "returned_key": returned_key.tolist(), "found": bool(mask.all()),
            "correct": bool(torch.equal(returned_key, second[0]))}
    torch.manual_seed(0)
    model = package.MemorizingTransformer(num_tokens=8, dim=16, depth=1, heads=1, dim_head=8, memorizing_layers=(1,),
                                          max_knn_memories=64, clear_memories_on_sos_token_id=1,
                                          knn_memories_directory=folder)
    memories = model.create_knn_memories(batch_size=1)
    model(torch.tensor([[2, 3, 4, 5]]), memories)
    held = memories[0].db_offsets.copy()
    model(torch.tensor([[1, 3, 4, 5]]), memories)                     # starts with <sos>: should clear first
    clear = {"entries_before": int(held[0]), "entries_after_sos_segment": int(memories[0].db_offsets[0]),
             "cleared": int(memories[0].db_offsets[0]) <= 4}
    return {"fifo_once_full": fifo, "clear_on_sos": clear}


def measure(seq: int, size: int, repeats: int, warmup: int, max_wait: float, folder: str) -> dict[str, Any]:
    rows = peaks_and_times(steps(seq, size, folder), BATCH * seq, repeats, warmup, max_wait)
    t = {name: row["seconds"]["median"] for name, row in rows.items()}
    theirs = t.get("memorizing-transformers-pytorch")
    ratios = {f"{name} / theirs": t[name] / theirs for name in t if theirs and name.startswith("polyformer")}
    return {"rows": rows, "ratios": ratios}


def markdown(record: dict[str, Any]) -> str:
    s = record["settings"]
    parts = [markdown_table(["model", "step (ms, median)", "tokens / s", "peak (MiB)"], [
        [name, f"{r['seconds']['median'] * 1e3:.1f}", f"{BATCH * s['seq'] / r['seconds']['median']:,.0f}",
         f"{r['peak_bytes'] / 2**20:.1f}"] for name, r in record["rows"].items()]),
        ", ".join(f"{k}: {v:.2f}x" for k, v in record["ratios"].items())]
    bugs = record.get("package_bugs") or {}
    if bugs:
        f, c = bugs["fifo_once_full"], bugs["clear_on_sos"]
        parts.append(f"The package's memory once full (8 entries, 6 + 6 written): the exact lookup of the newest "
                     f"first key {f['query']} returns {f['returned_key']} ({'right' if f['correct'] else 'wrong'}). "
                     f"clear_memories_on_sos_token_id: entries {c['entries_before']} before, "
                     f"{c['entries_after_sos_segment']} after a segment starting with <sos> "
                     f"({'cleared' if c['cleared'] else 'never cleared'}).")
    env = record["environment"]
    return "\n\n".join([
        "# Memorizing Transformer: training step",
        f"dim {DIM}, depth {DEPTH}, {HEADS} heads of {DIM_HEAD}, top-{TOPK}, "
        f"memory {s['size']} per row, segments of {s['seq']}, batch {BATCH}, float32, {env['torch_threads']} threads; "
        f"{env['cpu']}; torch {env['packages'].get('torch')}, memorizing-transformers-pytorch "
        f"{env['packages'].get('memorizing-transformers-pytorch')}, faiss-cpu {env['packages'].get('faiss-cpu')}; "
        f"{env['date']}, commit {env['polyformer_commit']}. Method: `benchmarks/memorizing.py` (docstring).", *parts])


def main(argv: list[str] | None = None) -> int:
    args = started(one_shot_parser("python -m benchmarks.memorizing", __doc__.split("\n\n")[0]), argv)
    seq, size, repeats, warmup = (64, 512, 1, 0) if args.quick else (256, 4096, args.repeats, 1)
    out_dir = args.out_dir or (Path("/tmp/memorizing") if args.quick else Path("docs/memories"))
    with tempfile.TemporaryDirectory() as folder:
        record = measure(seq, size, repeats, warmup, args.max_wait, folder)
        record["package_bugs"] = package_bugs(folder)
    record |= {"settings": {"seq": seq, "size": size},
               "environment": environment(["torch", "memorizing-transformers-pytorch", "faiss-cpu"])}
    return finish_report(out_dir / "benchmark_memorizing.json", record, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
