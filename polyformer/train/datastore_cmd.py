"""`polyformer datastore` (a kNN-LM datastore over a run's training text or any files), and the kNN-LM
flags of `eval` and `generate` (`--knn DIR --knn-lambda --knn-k --knn-temperature`): see
polyformer/memory/knn_lm.py and datastore.py."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..memory.datastore import KEY_DTYPES, Datastore, model_fingerprint, text_fingerprint
from ..memory.knn_lm import KEY_LAYERS, KnnLM, build_datastore, check_knn
from ..memory.vector_index import KINDS, IndexSpec
from .tokenizer import FILENAME as TOKENIZER_FILE

KNN_FLAGS = ("knn_lambda", "knn_k", "knn_temperature")


def add_datastore_parser(sub: Any) -> None:
    ds = sub.add_parser("datastore", help="a kNN-LM datastore of a run's context representations and next tokens",
                        description="Build a kNN-LM datastore (Khandelwal et al. 2020) with a run's newest checkpoint: "
                                    "one entry per token of the run's training split (or of --data.paths), its key "
                                    "the model's representation of the left context, its value the token. "
                                    "Use it with `eval --knn DIR` and `generate --knn DIR`.")
    ds.add_argument("--run", required=True, help="run directory")
    ds.add_argument("--out", required=True, help="the datastore directory to create (must not exist, or be empty)")
    ds.add_argument("--index", choices=KINDS, default="flat", help="flat (exact, default), ivf or hnsw (faiss)")
    ds.add_argument("--nprobe", type=int, default=None,
                    help="with --index ivf: cells searched per query (default 8): more is slower, with a higher recall")
    ds.add_argument("--key", choices=KEY_LAYERS, default="ffn_input",
                    help="ffn_input: the final feedforward's input, as the paper (default); final: what the head reads")
    ds.add_argument("--key-dtype", choices=sorted(KEY_DTYPES), default="float16", help="how keys are stored")
    ds.add_argument("--stride", type=int, default=None,
                    help="a window every STRIDE tokens (default model.max_seq_len); smaller: more left context per key")
    ds.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")


def add_knn_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--knn", metavar="DIR", default=None,
                        help="interpolate with a kNN-LM datastore of this run (polyformer datastore)")
    parser.add_argument("--knn-lambda", type=float, default=None, help="with --knn: the kNN share λ in [0, 1] (0.25)")
    parser.add_argument("--knn-k", type=int, default=None, help="with --knn: neighbours per token (1024)")
    parser.add_argument("--knn-temperature", type=float, default=None,
                        help="with --knn: p_kNN is a softmax of -distance / T (1.0)")


def knn_options(args: argparse.Namespace, command: str) -> dict[str, Any] | None:
    """{"directory", "lam", "k", "temperature"} from the knn flags (checked), or None without --knn."""
    given = [f"--{f.replace('_', '-')}" for f in KNN_FLAGS if getattr(args, f) is not None]
    if args.knn is None:
        if given:
            raise SystemExit(f"polyformer {command}: {', '.join(given)} apply to kNN-LM; give the datastore with --knn DIR")
        return None
    lam = 0.25 if args.knn_lambda is None else args.knn_lambda
    k = 1024 if args.knn_k is None else args.knn_k
    temperature = 1.0 if args.knn_temperature is None else args.knn_temperature
    try:
        check_knn(lam, k, temperature)
    except ValueError as err:
        raise SystemExit(f"polyformer {command}: --{str(err).replace(' ', '-', 1)}") from None
    return {"directory": args.knn, "lam": lam, "k": k, "temperature": temperature}


def tokenizer_fingerprint(run_dir: str | Path) -> str:
    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise SystemExit(f"polyformer: {str(run_dir)!r} has no {TOKENIZER_FILE}; a datastore records the tokenizer")
    return text_fingerprint(json.dumps(json.loads(path.read_text(encoding="utf-8")), sort_keys=True))


def _causal(settings: Any, run_dir: str, command: str) -> None:
    if settings.train.objective not in ("lm", "prefix_lm"):
        raise SystemExit(f"polyformer {command}: kNN-LM needs a causal language model; {run_dir!r} is a "
                         f"{settings.train.objective!r} run")


def datastore_command(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
    """`polyformer datastore`: build and write the datastore; a summary on stderr."""
    from .commands import load_checkpointed
    from .corpus import load_corpus
    from .files import check_fresh
    from .setup import load_data
    from .tokenizer import load_tokenizer

    check_fresh(args.out)                                # before any work: nothing to throw away
    if args.batch_size < 1:
        raise SystemExit(f"polyformer datastore: --batch-size must be >= 1, got {args.batch_size}")
    given = dict(overrides)
    unknown = [name for name in given if name not in ("data.paths", "data.max_bytes")]
    if unknown:
        raise SystemExit(f"polyformer datastore: --{unknown[0]} does not apply: the datastore is made with the run's "
                         "own model and tokenizer; it takes --data.paths and --data.max_bytes")
    if args.nprobe is not None and (args.index != "ivf" or args.nprobe < 1):
        raise SystemExit(f"polyformer datastore: --nprobe must be an integer >= 1 and applies to --index ivf, got "
                         f"--nprobe {args.nprobe} with --index {args.index}")
    spec = IndexSpec(kind=args.index) if args.nprobe is None else IndexSpec(kind=args.index, nprobe=args.nprobe)
    settings, model, checkpoint = load_checkpointed(args.run)
    _causal(settings, args.run, "datastore")
    if args.stride is not None and not 1 <= args.stride <= settings.model.max_seq_len:
        raise SystemExit(f"polyformer datastore: --stride must be in [1, {settings.model.max_seq_len}] "
                         f"(model.max_seq_len), got {args.stride}")
    if "data.paths" in given:
        max_bytes = int(given["data.max_bytes"]) if "data.max_bytes" in given else None
        corpus = load_corpus(given["data.paths"].split(","), max_bytes)
        tokens, source, digest = corpus.tokens(load_tokenizer(args.run)), corpus.source, corpus.sha256
    else:
        if "data.max_bytes" in given:
            raise SystemExit("polyformer datastore: --data.max_bytes applies to --data.paths")
        data = load_data(settings, Path(args.run), fresh=False)
        tokens, source, digest = data.train, f"the training split of {args.run}", data.corpus_sha256
    meta = {"model": {"fingerprint": model_fingerprint(model),
                      "source": f"run {args.run}, checkpoint {checkpoint.name}"},
            "tokenizer": {"fingerprint": tokenizer_fingerprint(args.run), "source": f"{args.run}/{TOKENIZER_FILE}"},
            "corpus": {"source": source, "sha256": digest, "tokens": int(tokens.numel())},
            "stride": args.stride or settings.model.max_seq_len}
    start = time.perf_counter()
    store = build_datastore(model, tokens, args.key, args.stride, args.batch_size, spec, args.key_dtype, meta)
    store.save(args.out)
    took = time.perf_counter() - start
    print(f"polyformer datastore: {len(store):,} entries (key {args.key}, dim {store.dim}, {args.key_dtype}, "
          f"{args.index} index) from {source} in {took:.1f} s ({len(store) / max(took, 1e-9):,.0f} tokens/s) "
          f"-> {args.out}", file=sys.stderr)
    return 0


def knn_model(run_dir: str, model: nn.Module, options: dict[str, Any]) -> KnnLM:
    """The run's model with the datastore `options["directory"]`, which must have been built with
    this model (weights and config) and this tokenizer."""
    store = Datastore.load(options["directory"], model=model_fingerprint(model),
                           tokenizer=tokenizer_fingerprint(run_dir))
    return KnnLM(model, store, options["lam"], options["k"], options["temperature"])


def evaluate_knn(run_dir: str, settings: Any, model: nn.Module, options: dict[str, Any], tokens: torch.Tensor,
                 bytes_per_token: float, batch_size: int, max_batches: int | None) -> tuple[dict[str, float], int]:
    """(kNN-LM scores and the LM's alone, targets scored) over the windows of `tokens` (as `scoring.windows`;
    the first `max_batches` batches only, when given)."""
    from .scoring import scores

    _causal(settings, run_dir, "eval")
    knn = knn_model(run_dir, model, options)
    result = knn.score(tokens, batch_size=batch_size, max_batches=max_batches)
    lm = scores(result["lm_loss"], bytes_per_token)
    return {**scores(result["loss"], bytes_per_token), "lm_loss": lm["loss"], "lm_perplexity": lm["perplexity"]}, \
        result["count"]


def describe(options: dict[str, Any]) -> str:
    return (f" with kNN-LM (datastore {options['directory']}, lambda {options['lam']}, k {options['k']}, "
            f"temperature {options['temperature']})")


def sample_knn(run_dir: str, model: nn.Module, tokenizer: Any, options: dict[str, Any], prompt: str, n: int,
               temperature: float, k: int | None, p: float | None, seed: int) -> str:
    """`prompt` and `n` tokens sampled from the kNN-LM interpolation."""
    from .sample import filters, prompt_ids

    knn = knn_model(run_dir, model, options)
    out = knn.generate(prompt_ids(tokenizer, prompt, model), n, temperature=temperature,
                       generator=torch.Generator().manual_seed(seed), **filters(k, p))
    return prompt + tokenizer.decode(out[0].tolist())
