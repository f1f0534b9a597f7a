"""`polyformer eval` and `polyformer generate` on a run directory. Neither needs the training
corpus on disk, except `eval` without --data.paths, which scores the run's own validation split."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from torch import nn

from .checkpoint import checkpoint_step, load_checkpoint, resume_checkpoint
from .corpus import load_corpus
from .record import CorpusChanged
from .run import load_run_config, model_from_run
from .sample import early_exit_sample, prepare_for_sampling, sample, speculative_sample
from .scoring import evaluate, scores, text_loss
from .settings import EVAL_SETTINGS, RunSettings, from_dict, set_value, validate
from .setup import Data, build_objective, load_data
from .tokenizer import FILENAME as TOKENIZER_FILE, load_tokenizer


def load_model(run_dir: str) -> tuple[RunSettings, nn.Module]:
    """A trained run's settings and its model with the newest good checkpoint, in eval mode."""
    settings, model, _ = load_checkpointed(run_dir)
    return settings, model


def load_checkpointed(run_dir: str) -> tuple[RunSettings, nn.Module, Path]:
    """`load_model`, and the checkpoint directory the weights came from."""
    path = Path(run_dir)
    config = load_run_config(path)
    settings = from_dict(config["train"]["settings"])
    origin = config["train"].get("converted_from")
    if origin and not (path / TOKENIZER_FILE).is_file():
        raise SystemExit(f"polyformer: {str(path)!r} was converted from the Hugging Face directory "
                         f"{origin.get('directory')!r}, which has no tokenizer.json, so it cannot read a prompt or a "
                         "corpus: put the model's tokenizer.json beside its config.json and convert again")
    model = model_from_run(path)
    checkpoint = resume_checkpoint(path)
    load_checkpoint(checkpoint, model, rng=False)
    return settings, model.eval(), Path(checkpoint)


def load_run(run_dir: str) -> tuple[RunSettings, nn.Module, Data]:
    """A trained run: its settings, the model with the newest good checkpoint, and its data (read
    from its corpus, which must be the one it recorded)."""
    settings, model = load_model(run_dir)
    return settings, model, load_data(settings, Path(run_dir), fresh=False)


def eval_settings(settings: RunSettings, overrides: list[tuple[str, str]], batches: int | None) -> RunSettings:
    """The run's settings with eval's own (`EVAL_SETTINGS`); data.paths and data.max_bytes start
    empty (the validation split; whole files). Any other setting is refused, saying why."""
    asked = copy.deepcopy(settings)
    asked.data.paths, asked.data.max_bytes = [], None
    for dotted, value in overrides:
        set_value(asked, dotted, value, source=f"--{dotted}")        # a typo gets the closest names
        if dotted not in EVAL_SETTINGS:
            raise SystemExit(f"polyformer eval: --{dotted} does not apply: a run is scored as it was trained, with "
                             f"its own model and tokenizer; eval takes --{', --'.join(EVAL_SETTINGS)}")
    given = dict(overrides)
    if "data.max_bytes" in given and not asked.data.paths:
        raise SystemExit("polyformer eval: --data.max_bytes applies to --data.paths (the validation split is the "
                         "run's own)")
    if batches is not None:
        if "train.eval_batches" in given and asked.train.eval_batches != batches:
            raise SystemExit("polyformer eval: --batches and --train.eval_batches are the same setting; give one")
        asked.train.eval_batches = batches
    validate(asked)
    return asked


def evaluate_run(run_dir: str, batches: int | None = None, overrides: list[tuple[str, str]] | None = None,
                 knn: dict[str, Any] | None = None) -> int:
    """`polyformer eval`: the scores on stdout, the checkpoint they are of (path and step) and the
    text scored on stderr. With --data.paths, every token of those files (`scoring.text_loss`).
    With `knn` (datastore_cmd.knn_options), kNN-LM scores of every token, and the LM's alone."""
    settings, model, checkpoint = load_checkpointed(run_dir)
    asked = eval_settings(settings, overrides or [], batches)
    given = dict(overrides or [])
    if knn is not None:
        return _evaluate_knn(run_dir, settings, model, checkpoint, asked, knn, batches is not None or
                             "train.eval_batches" in given)
    if asked.data.paths:
        if settings.train.objective == "seq2seq":
            raise SystemExit("polyformer eval: a seq2seq run learns a synthetic task and has no text to score; "
                             "drop --data.paths")
        tokenizer = load_tokenizer(run_dir)
        corpus = load_corpus(asked.data.paths, asked.data.max_bytes)
        tokens = corpus.tokens(tokenizer)
        objective = build_objective(settings, Data(None, None, tokenizer, None, 1.0), 0, 1)
        limit = asked.train.eval_batches if batches is not None or "train.eval_batches" in given else None
        loss, count = text_loss(model, objective, tokens, settings.model.max_seq_len, asked.train.batch_size, limit)
        result = scores(loss, len(corpus.data) / tokens.numel())
        what = f"{count:,} tokens of {len(corpus.files)} file(s), {len(corpus.data):,} bytes: {corpus.source}"
    else:
        data = _validation(settings, run_dir)
        objective = build_objective(settings, data, 0, 1)
        result, what = evaluate(model, objective, asked, data), "the run's validation split"
    print(f"polyformer eval: scored {checkpoint} (step {checkpoint_step(checkpoint)}) on {what}", file=sys.stderr)
    print("  ".join(f"{k} {v:.4f}" for k, v in result.items()))
    return 0


def _evaluate_knn(run_dir: str, settings: RunSettings, model: nn.Module, checkpoint: Path, asked: RunSettings,
                  knn: dict[str, Any], limited: bool) -> int:
    from .datastore_cmd import describe, evaluate_knn

    if asked.data.paths:
        corpus = load_corpus(asked.data.paths, asked.data.max_bytes)
        tokens = corpus.tokens(load_tokenizer(run_dir))
        per_token, what = len(corpus.data) / tokens.numel(), f"{len(corpus.files)} file(s): {corpus.source}"
    else:
        data = _validation(settings, run_dir)
        tokens, per_token = data.val, data.bytes_per_token
        what = ("the run's validation split (plain eval scores its eval_batches fixed batches instead: compare "
                "loss with lm_loss, the LM alone on these same tokens)")
    result, count = evaluate_knn(run_dir, settings, model, knn, tokens, per_token, asked.train.batch_size,
                                 asked.train.eval_batches if limited else None)
    windows = f"the first {asked.train.eval_batches} batches of windows" if limited else "every window"
    print(f"polyformer eval: scored {checkpoint} (step {checkpoint_step(checkpoint)}) on {count:,} tokens, {windows}, "
          f"of {what}{describe(knn)}", file=sys.stderr)
    print("  ".join(f"{k} {v:.4f}" for k, v in result.items()))
    return 0


def _validation(settings: RunSettings, run_dir: str) -> Data:
    try:
        return load_data(settings, Path(run_dir), fresh=False)
    except FileNotFoundError as err:
        if err.filename is None:
            raise
        raise SystemExit(f"polyformer eval: the run's validation split is read from its corpus, and "
                         f"{err.filename!r} is not there: restore it, or score text of your choice with "
                         "--data.paths FILE_OR_DIR") from None
    except CorpusChanged as err:
        raise SystemExit(f"polyformer eval: the run's validation split is no longer the text it was measured on: "
                         f"{err}. Restore the files, or score text of your choice with --data.paths "
                         "FILE_OR_DIR") from None


def _tokenizer_json(run_dir: str) -> Any:
    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise SystemExit(f"polyformer generate: {run_dir!r} has no {TOKENIZER_FILE}")
    return json.loads(path.read_text(encoding="utf-8"))


def _check_generates(settings: RunSettings, run_dir: str) -> None:
    if settings.train.objective not in ("lm", "prefix_lm"):
        raise SystemExit(f"polyformer generate: {run_dir!r} is a {settings.train.objective!r} run, which does not "
                         "generate text")


def _draft_for(run_dir: str, draft: str) -> nn.Module:
    """The draft run's model, once it is known to fit the target run (`generate --draft`)."""
    settings, model = load_model(draft)
    _check_generates(settings, draft)
    if _tokenizer_json(draft) != _tokenizer_json(run_dir):
        raise SystemExit(f"polyformer generate: the draft run {draft!r} has another tokenizer than {run_dir!r}; "
                         "speculative decoding needs both models on one vocabulary")
    return model


def generate(run_dir: str, max_new_tokens: int, prompt: str | None, temperature: float, k: int | None,
             p: float | None, seed: int, int8: bool = False, draft: str | None = None,
             gamma: int | None = None, knn: dict[str, Any] | None = None, early_exit: float | None = None) -> int:
    """`polyformer generate`: the run's text after `prompt`, from its model and tokenizer alone. With
    `draft` (a run on the same tokenizer), by speculative decoding with `gamma` draft tokens per
    target call (default 4), its acceptance on stderr; the whole text must then fit the target's
    window, where plain decoding would slide it."""
    settings, model = load_model(run_dir)
    _check_generates(settings, run_dir)
    _tokenizer_json(run_dir)
    tokenizer = load_tokenizer(run_dir)
    if max_new_tokens < 1:
        raise SystemExit("polyformer generate: --max-new-tokens must be >= 1")
    if draft is None and gamma is not None:
        raise SystemExit("polyformer generate: --gamma sets speculative decoding's draft length; it needs --draft")
    prompt = prompt if prompt is not None else "\n"
    if knn is not None and (draft is not None or int8):
        raise SystemExit("polyformer generate: --knn samples from the model the datastore was built with; it does "
                         "not combine with --draft or --int8")
    if early_exit is not None and (knn is not None or draft is not None):
        raise SystemExit("polyformer generate: --early-exit does not combine with --knn or --draft")
    try:                                          # bad filter values, too long for learned positions
        if early_exit is not None:      # exit_layers (generate/early_exit.py): the mean layers used on stderr
            prepare_for_sampling(model, int8)
            text, used = early_exit_sample(model, tokenizer, prompt, max_new_tokens, early_exit, temperature, k, p, seed)
            print(text)
            print(f"early exit at threshold {early_exit:g}: {used.mean_layers:.2f} of {used.depth} layers per token "
                  "on average", file=sys.stderr)
            return 0
        if knn is not None:
            from .datastore_cmd import sample_knn

            print(sample_knn(run_dir, model, tokenizer, knn, prompt, max_new_tokens, temperature, k, p, seed))
            return 0
        if draft is None:
            prepare_for_sampling(model, int8)
            print(sample(model, tokenizer, prompt, max_new_tokens, temperature, k, p, seed))
            return 0
        gamma = 4 if gamma is None else gamma          # speculative_generate checks it
        draft_model = _draft_for(run_dir, draft)
        for net in (model, draft_model):
            prepare_for_sampling(net, int8)
        text, result = speculative_sample(model, draft_model, tokenizer, prompt, max_new_tokens, gamma,
                                          temperature, k, p, seed)
    except ValueError as err:
        raise SystemExit(f"polyformer generate: {err}") from None
    print(text)
    print(f"speculative decoding, gamma {gamma}: {result.accepted} of {result.proposed} draft tokens accepted "
          f"({result.acceptance_rate:.2f}), {result.tokens_per_target_call:.2f} tokens per target call",
          file=sys.stderr)
    return 0
