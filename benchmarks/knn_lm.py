"""kNN-LM (issue 21): datastore build throughput, per-token retrieval latency and recall of the indexes,
and perplexity against λ on in-domain and new-domain text (the arena has no kNN-LM row: its variants
are models built from keywords, kNN-LM is a datastore added to a trained one).

    python -m benchmarks.knn_lm [--quick] [--repeats 3] [--max-wait 30] [--threads 2] [--out-dir docs/memories]

writes knn_lm.json and knn_lm.md (docs/memories/knn_lm.md explains the method and the numbers).

1. Retrieval, same process, alternating rounds (`common.quiet_rounds`): N clustered random keys of the model
   dimension (256; 10^5 and 10^6, quick: 2·10^4), 256 queries near stored keys, k = 1024 (quick 256):
   our Datastore's exact torch search over float16 keys, faiss's exact IndexFlatL2 (the reference users
   pick), and the approximate IVF (nprobe 8 and 64) and HNSW (M 32, efSearch k) indexes; ms per query token, the
   ratio to faiss flat, index build time, and top-1 / top-k recall against the exact result.
2. Build: tokens/s of `build_datastore` with the trained model against its plain forward on the same
   windows (the key hook and the copy's overhead), alternating.
3. Perplexity against λ: a byte-level `tiny` run trained briefly on stdlib .py sources (quick: 60 steps);
   in-domain: datastore on its training split, scored on its validation split; new domain: datastore on
   part of the stdlib's .txt / .rst / .html files (email messages, doctests, licences), scored on the
   others, which the model never trained on. float16 against float32 keys and the "final" key at λ 0.25.
"""

from __future__ import annotations

import math
from dataclasses import replace
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from polyformer.memory.datastore import Datastore
from polyformer.memory.knn_lm import KnnLM, batched, build_datastore, interpolate, sliding_windows
from polyformer.memory.vector_index import IndexSpec
from polyformer.train.corpus import Corpus, validation_score

from .common import (Competitor, environment, finish_report, log, markdown_table, one_shot_parser, quiet_rounds,
                     spread, started)

DIM, QUERIES = 256, 256
LAMBDAS = (0.0, 0.1, 0.25, 0.5, 0.75)


def clustered(n: int, gen: torch.Generator) -> torch.Tensor:
    centres = torch.randn(1024, DIM, generator=gen) * 3
    out = torch.empty(n, DIM)
    for s in range(0, n, 1 << 16):
        m = min(1 << 16, n - s)
        out[s: s + m] = centres[torch.randint(0, 1024, (m,), generator=gen)] + torch.randn(m, DIM, generator=gen)
    return out


def retrieval(n: int, k: int, repeats: int, max_wait: float) -> dict[str, Any]:
    import faiss

    gen = torch.Generator().manual_seed(n)
    keys = clustered(n, gen)
    values = torch.randint(0, 256, (n,), generator=gen)
    q = keys[torch.randint(0, n, (QUERIES,), generator=gen)] + 0.1 * torch.randn(QUERIES, DIM, generator=gen)
    stores, build = {}, {}
    ivf = IndexSpec(kind="ivf", train_size=min(n, 65536))
    for name, spec in (("ours flat (torch, fp16)", IndexSpec()), ("ivf", ivf), ("ivf nprobe 64", replace(ivf, nprobe=64)),
                       ("hnsw", IndexSpec(kind="hnsw", ef_search=max(64, k)))):
        start = time.perf_counter()
        stores[name] = Datastore(keys.half() if name.startswith("ours") else keys, values, spec)
        build[name] = time.perf_counter() - start
    flat = faiss.IndexFlatL2(DIM)
    start = time.perf_counter()
    flat.add(keys.numpy())
    build["faiss flat"] = time.perf_counter() - start
    qn = q.numpy()
    competitors = [Competitor(name, lambda s=s: s.search(q, k), units=QUERIES) for name, s in stores.items()]
    competitors.append(Competitor("faiss flat", lambda: flat.search(qn, k), units=QUERIES))
    rounds = quiet_rounds(competitors, repeats, warmup=1, max_wait=max_wait)
    exact = torch.from_numpy(flat.search(qn, k)[1])
    rows = []
    ref = min(competitors[-1].seconds)
    for c in competitors:
        ids = exact if c.name == "faiss flat" else stores[c.name].search(q, k)[2]
        top1 = (ids[:, 0] == exact[:, 0]).float().mean().item()
        topk = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids, exact)) / exact.numel()
        rows.append({"index": c.name, "ms_per_token": spread([s * 1e3 / QUERIES for s in c.seconds]),
                     "vs_faiss_flat": min(c.seconds) / ref, "build_s": build[c.name], "recall_top1": top1,
                     "recall_topk": topk})
    return {"n": n, "k": k, "dim": DIM, "rows": rows, "rounds": len(rounds)}


def train_run(out: Path, steps: int) -> Path:
    from polyformer.train.cli import main

    code = main(["train", "--preset", "tiny", "--steps", str(steps), "--out", str(out), "--train.progress", "false",
                 "--train.sample_tokens", "8", "--train.eval_every", str(steps), "--train.checkpoint_every", str(steps)])
    if code:
        raise RuntimeError("training the benchmark's run failed")
    return out


def new_domain() -> tuple[torch.Tensor, torch.Tensor]:
    """(datastore tokens, scored tokens) of the stdlib's non-.py text files, split by file name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".rst", ".html") and p.is_file()
                   and "site-packages" not in p.parts)
    pieces = [(p.relative_to(root).as_posix(), p.read_bytes()) for p in files]
    held = [x for x in pieces if validation_score(x[0]) < 0.2]
    store = [x for x in pieces if validation_score(x[0]) >= 0.2]
    return Corpus.from_pieces(store).tokens(), Corpus.from_pieces(held).tokens()


def target_scores(net: Any, store: Datastore, tokens: torch.Tensor, k: int, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p_LM, log p_kNN) of every target of `tokens`, so each λ is one logaddexp."""
    return KnnLM(net, store, k=k, key=key).target_log_probs(tokens, batch_size=16)


def perplexities(lm: torch.Tensor, knn: torch.Tensor) -> dict[str, float]:
    return {str(lam): math.exp(-interpolate(lm, knn, lam).mean().item()) for lam in LAMBDAS}


def quality(steps: int, store_tokens: int, score_tokens: int, k: int, repeats: int, max_wait: float) -> dict[str, Any]:
    from polyformer.train.commands import load_checkpointed
    from polyformer.train.setup import load_data

    with tempfile.TemporaryDirectory() as tmp:
        run = train_run(Path(tmp) / "run", steps)
        settings, net, _ = load_checkpointed(str(run))
        data = load_data(settings, run, fresh=False)
    domain_store, domain_score = new_domain()
    texts = {"in-domain (stdlib .py)": (data.train[:store_tokens], data.val[:score_tokens]),
             "new domain (stdlib .txt/.rst/.html)": (domain_store[:store_tokens], domain_score[:score_tokens])}
    rows, builds = [], {}
    for name, (build_on, score_on) in texts.items():
        start = time.perf_counter()
        store = build_datastore(net, build_on, key_dtype="float16", batch_size=16)
        builds[name] = build_on.numel() / (time.perf_counter() - start)
        lm, knn = target_scores(net, store, score_on, k, "ffn_input")
        row = {"text": name, "datastore": len(store), "scored": lm.numel(), "ppl": perplexities(lm, knn)}
        wide = Datastore(store.keys.float(), store.values)
        row["ppl_fp32_keys_0.25"] = perplexities(lm, target_scores(net, wide, score_on, k, "ffn_input")[1])["0.25"]
        final = build_datastore(net, build_on, key="final", batch_size=16)
        row["ppl_final_key_0.25"] = perplexities(*target_scores(net, final, score_on, k, "final"))["0.25"]
        rows.append(row)
    windows = [x for x, _ in batched(sliding_windows(data.train[:store_tokens], net.max_seq_len), 16)]
    plain = Competitor("forward only", lambda: [net(x[:, :-1]) for x in windows], units=store_tokens)
    build = Competitor("build_datastore", lambda: build_datastore(net, data.train[:store_tokens], batch_size=16),
                       units=store_tokens)
    with torch.no_grad():
        quiet_rounds([plain, build], repeats, warmup=0, max_wait=max_wait)
    throughput = {"tokens_per_s": store_tokens / min(build.seconds), "forward_tokens_per_s": store_tokens / min(plain.seconds),
                  "build_vs_forward": min(build.seconds) / min(plain.seconds)}
    return {"steps": steps, "k": k, "rows": rows, "build": throughput}


def markdown(record: dict[str, Any]) -> str:
    out = ["# kNN-LM benchmark", "", f"{'quick run' if record['quick'] else 'full run'}; {record['environment']['cpu']}, "
           f"{record['environment']['torch_threads']} threads", ""]
    for r in record["retrieval"]:
        out += [f"## Retrieval: {r['n']:,} keys of dim {r['dim']}, k {r['k']}, {QUERIES} queries", "",
                markdown_table(["index", "ms / token (median)", "vs faiss flat", "build s", "recall@1", f"recall@{r['k']}"],
                               [[x["index"], f"{x['ms_per_token']['median']:.3f}", f"{x['vs_faiss_flat']:.2f}",
                                 f"{x['build_s']:.2f}", f"{x['recall_top1']:.3f}", f"{x['recall_topk']:.3f}"]
                                for x in r["rows"]]), ""]
    q = record["quality"]
    out += ["## Perplexity against λ (byte-level tiny run, " f"{q['steps']} steps, k {q['k']})", "",
            markdown_table(["text", "datastore", "scored"] + [f"λ {lam}" for lam in LAMBDAS] + ["fp32 keys λ 0.25",
                                                                                          "final key λ 0.25"],
                           [[x["text"], f"{x['datastore']:,}", f"{x['scored']:,}"] + [f"{x['ppl'][str(lam)]:.3f}"
                                                                                    for lam in LAMBDAS]
                            + [f"{x['ppl_fp32_keys_0.25']:.3f}", f"{x['ppl_final_key_0.25']:.3f}"] for x in q["rows"]]),
            "", f"Build: {q['build']['tokens_per_s']:,.0f} tokens/s (forward alone {q['build']['forward_tokens_per_s']:,.0f}; "
                f"build / forward time {q['build']['build_vs_forward']:.2f})"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = one_shot_parser("benchmarks.knn_lm", __doc__.split("\n")[0])
    args = started(parser, argv)
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) / "knn_lm" if args.quick else Path("docs/memories"))
    sizes, k = ((20_000,), 256) if args.quick else ((100_000, 1_000_000), 1024)
    record: dict[str, Any] = {"quick": args.quick}
    record["retrieval"] = []
    for n in sizes:
        log(f"retrieval over {n:,} keys")
        record["retrieval"].append(retrieval(n, k, 1 if args.quick else args.repeats, args.max_wait))
    log("perplexity against lambda")
    record["quality"] = quality(60 if args.quick else 1000, 20_000 if args.quick else 400_000,
                                4_000 if args.quick else 40_000, 64 if args.quick else 1024,
                                1 if args.quick else args.repeats, args.max_wait)
    record["environment"] = environment(["torch", "faiss-cpu"])
    return finish_report(out_dir / "knn_lm.json", record, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
