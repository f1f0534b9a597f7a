"""`polyformer convert`: a Hugging Face model directory into a run directory (`--from-hf`), which
`polyformer generate` and `polyformer eval` accept, and a run directory back into a Hugging Face
model directory (`--to-hf`).

A converted run directory is an ordinary one: config.json (the model's polyformer config, the
settings `eval` uses, and under train.converted_from the Hugging Face config it came from),
tokenizer.json (the Hugging Face tokenizer.json kept as it is, kind "hf", when the model directory
has one) and checkpoints/step-000000. It is written under a temporary name and renamed into place,
so it is complete or absent. Converted runs are for sampling and evaluation; they are not resumed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..interop.hf import CONFIG, TOKENIZER, load_hf, save_hf
from ..wrappers import TransformerWrapper
from .checkpoint import load_checkpoint, resume_checkpoint, save_checkpoint
from .files import check_fresh, write_dir_atomic
from .run import load_run_config, model_from_run, run_config, save_run_config
from .settings import resolve, to_dict
from .tokenizer import FILENAME as RUN_TOKENIZER, ByteTokenizer, HFTokenizer, load_tokenizer

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
EVAL_CONTEXT = 1024          # default --model.max_seq_len of a converted run: eval's sequence length


def _fail(message: str) -> SystemExit:
    return SystemExit(f"polyformer convert: {message}")


def _fresh(out: Path) -> None:
    try:
        check_fresh(out)
    except FileExistsError:
        raise _fail(f"{str(out)!r} exists and is not empty: choose a new --out (nothing was changed)") from None


def from_hf_dir(hf_dir: str, out: str, ignore: list[str] | None = None,
                overrides: list[tuple[str, str]] | None = None) -> int:
    """Convert HF_DIR (config.json, model.safetensors, optional tokenizer.json) into the run
    directory OUT. `overrides` are --section.key settings for `eval` (data.*, train.*, and
    model.max_seq_len, the evaluation context)."""
    src, target = Path(hf_dir), Path(out)
    _fresh(target)
    overrides = list(overrides or [])
    fixed = [k for k, _ in overrides if k.startswith("model.") and k != "model.max_seq_len"]
    if fixed:
        raise _fail(f"--{fixed[0]} comes from the checkpoint; of the model settings only --model.max_seq_len "
                    "(the evaluation context) can be given")
    try:
        model = load_hf(src, ignore=ignore or [])
    except (FileNotFoundError, ValueError) as error:
        raise _fail(str(error)) from None
    if not isinstance(model, TransformerWrapper):
        raise _fail(f"a run directory holds a language model for `generate` / `eval`, and this checkpoint is an "
                    f"encoder-decoder ({type(model).__name__}): use polyformer.interop.load_hf in Python")
    if not model.attn_layers.causal:
        raise _fail("a run directory holds a language model for `generate` / `eval`, and this checkpoint is an "
                    "encoder (BERT) without a language-model head: use polyformer.interop.load_hf in Python")
    hf_config = json.loads((src / CONFIG).read_text(encoding="utf-8"))
    tokenizer = HFTokenizer.from_file(src / TOKENIZER) if (src / TOKENIZER).is_file() else None
    if tokenizer is not None and tokenizer.vocab_size > model.num_tokens:
        raise _fail(f"{str(src / TOKENIZER)!r} has {tokenizer.vocab_size} tokens but the model only "
                    f"{model.num_tokens}: they do not belong together")
    try:
        settings = resolve(None, None, [("model.max_seq_len", str(min(model.max_seq_len, EVAL_CONTEXT)))] + overrides)
    except (KeyError, ValueError) as error:
        raise _fail(str(error).strip('"')) from None
    if model.bounded and settings.model.max_seq_len > model.max_seq_len:
        raise _fail(f"--model.max_seq_len {settings.model.max_seq_len} is beyond the model's learned positions "
                    f"({model.max_seq_len})")
    c = model.attn_layers.cfg
    settings.model.dim, settings.model.depth, settings.model.heads = c.dim, c.depth, c.attention.heads
    settings.model.layers = {}
    settings.train.objective = "lm"
    architecture = (hf_config.get("architectures") or [None])[0]
    train = {"settings": to_dict(settings), "corpus_sha256": None,
             "converted_from": {"directory": str(src.resolve()), "architecture": architecture, "config": hf_config,
                                "tokenizer": tokenizer is not None}}

    def fill(tmp: Path) -> None:
        save_run_config(tmp, run_config(model, train))
        if tokenizer is not None:
            tokenizer.save(tmp)
        save_checkpoint(tmp, 0, model, None, None, extra={"converted_from": str(src.resolve())}, keep_last=1)

    try:
        write_dir_atomic(target, fill)
    except FileExistsError as error:
        raise _fail(f"{error} (nothing was changed)") from None
    params = sum(p.numel() for p in model.parameters())
    note = "" if tokenizer is not None else (" (no tokenizer.json in the model directory: `generate` and `eval` "
                                             "need one, so add it and convert again)")
    print(f"converted {architecture} from {str(src)!r} into the run directory {str(target)!r}: "
          f"{params:,} parameters{note}")
    return 0


def to_hf_dir(run_dir: str, out: str) -> int:
    """Write the newest checkpoint of RUN_DIR as a Hugging Face model directory OUT (config.json,
    model.safetensors, and tokenizer.json when the run has a BPE or Hugging Face tokenizer)."""
    run, target = Path(run_dir), Path(out)
    _fresh(target)                                  # before any loading
    try:
        config = load_run_config(run)
        model = model_from_run(run)
        load_checkpoint(resume_checkpoint(run), model, rng=False)
    except (FileNotFoundError, ValueError) as error:
        raise _fail(str(error)) from None
    if not isinstance(model, TransformerWrapper):
        raise _fail(f"the run holds a {type(model).__name__}; only a TransformerWrapper converts to Hugging Face")
    origin = config.get("train", {}).get("converted_from") or {}
    special: dict[str, Any] = {k: v for k, v in (origin.get("config") or {}).items() if k in SPECIAL_IDS}
    tokenizer_json = None
    if (run / RUN_TOKENIZER).is_file():
        tokenizer = load_tokenizer(run)
        if not isinstance(tokenizer, ByteTokenizer):
            tokenizer_json = tokenizer.to_json()
    try:
        save_hf(model.eval(), target, tokenizer_json=tokenizer_json, **special)
    except (ValueError, FileExistsError) as error:
        raise _fail(str(error)) from None
    note = "" if tokenizer_json is not None else " (the run has no tokenizer a Hugging Face directory can hold)"
    print(f"wrote the Hugging Face model directory {str(target)!r} from {str(run)!r}{note}")
    return 0
