"""What a run is made of, from its settings: the data (corpus, tokenizer, token streams), the
model and the objective. Shared by `train`, `eval` and `generate`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..encoder_decoder import XTransformer
from ..stack import Decoder, Encoder
from ..wrappers import TransformerWrapper
from .batches import Batches
from .corpus import Corpus, load_corpus
from .objectives import (LanguageModeling, MaskedLanguageModeling, Objective, PrefixLanguageModeling, Seq2Seq,
                         Seq2SeqTask)
from .record import check_corpus, save_record
from .settings import RunSettings
from .tokenizer import build_tokenizer, load_tokenizer

MASK = "<mask>"
SEQ2SEQ_TOKENS = 32          # vocabulary of the synthetic tasks (BOS comes on top)


@dataclass
class Data:
    """Token streams and what they came from; `bytes_per_token` converts loss to bits per byte."""

    train: Tensor | None
    val: Tensor | None
    tokenizer: object | None
    corpus_sha256: str | None
    bytes_per_token: float


def load_data(settings: RunSettings, run_dir: Path, fresh: bool, corpus_change: bool = False) -> Data:
    """Read and split the corpus. A fresh run trains (BPE) and saves its tokenizer and records its
    corpus (RUN/corpus.json); a resumed one loads the tokenizer and checks the corpus against the
    record (`record.CorpusChanged` names the files that differ), or with `corpus_change` records
    the corpus as it is now."""
    if settings.train.objective == "seq2seq":
        return Data(None, None, None, None, 1.0)
    corpus = load_corpus(settings.data.paths or None)
    if fresh or corpus_change:
        save_record(run_dir, corpus)
    else:
        check_corpus(run_dir, corpus)
    train_part, val_part = corpus.split(settings.data.val_fraction)
    cap = settings.data.max_bytes           # applied after the split, so validation keeps its share
    if cap is not None:
        train_part = first_bytes(train_part, cap)
        val_part = first_bytes(val_part, max(1024, int(cap * settings.data.val_fraction)))
    specials = (MASK,) if settings.train.objective == "mlm" else ()
    if fresh:
        tokenizer = build_tokenizer(settings.data.tokenizer, train_part.data, settings.data.vocab_size, specials)
        tokenizer.save(run_dir)
    else:
        tokenizer = load_tokenizer(run_dir)
    train, val = train_part.tokens(tokenizer), val_part.tokens(tokenizer)
    return Data(train, val, tokenizer, corpus.sha256, len(val_part.data) / max(1, val.numel()))


def check_windows(settings: RunSettings, data: Data) -> None:
    """Refuse, before step 1, a train or validation split shorter than one window
    (model.max_seq_len + 1 tokens), naming the settings that would make it fit."""
    need = settings.model.max_seq_len + 1
    for name, tokens in (("training", data.train), ("validation", data.val)):
        if tokens is None or tokens.numel() >= need:
            continue
        d = settings.data
        cap = f", raise --data.max_bytes ({d.max_bytes})" if d.max_bytes is not None else ""
        share = f"lower --data.val_fraction ({d.val_fraction})" if name == "training" else \
            f"raise --data.val_fraction ({d.val_fraction})"
        raise SystemExit(f"polyformer: the {name} split has {tokens.numel():,} tokens, fewer than one window of "
                         f"--model.max_seq_len + 1 = {need:,}: lower --model.max_seq_len ({need - 1}), {share}{cap} or "
                         "give more text in --data.paths (nothing was trained)")


def first_bytes(corpus: Corpus, n: int) -> Corpus:
    """The corpus's files in order up to n bytes (the last one cut)."""
    pieces, total = [], 0
    for name, content in corpus.contents():
        if total >= n:
            break
        pieces.append((name, content[: n - total]))
        total += len(pieces[-1][1])
    return Corpus.from_pieces(pieces, corpus.source)


def build_run_model(settings: RunSettings, data: Data) -> nn.Module:
    m, t = settings.model, settings.train
    if t.objective == "seq2seq":
        return XTransformer(dim=m.dim, enc_num_tokens=SEQ2SEQ_TOKENS, enc_depth=m.depth, enc_heads=m.heads,
                            enc_max_seq_len=t.task_length, dec_num_tokens=SEQ2SEQ_TOKENS + 1, dec_depth=m.depth,
                            dec_heads=m.heads, dec_max_seq_len=t.task_length + 1,
                            **{f"{side}_{k}": v for k, v in m.layers.items() for side in ("enc", "dec")})
    stack = Encoder if t.objective == "mlm" else Decoder
    layers = stack(dim=m.dim, depth=m.depth, heads=m.heads, **m.layers)
    return TransformerWrapper(num_tokens=data.tokenizer.vocab_size, max_seq_len=m.max_seq_len, attn_layers=layers)


def build_objective(settings: RunSettings, data: Data, rank: int, world_size: int) -> Objective:
    t = settings.train
    g = torch.Generator().manual_seed(t.seed + 1)
    if t.objective == "lm":
        return LanguageModeling()
    if t.objective == "mlm":
        return MaskedLanguageModeling(data.tokenizer.token_id(MASK), data.tokenizer.ordinary_vocab_size,
                                      generator=g, rank=rank, world_size=world_size)
    if t.objective == "prefix_lm":
        n = settings.model.max_seq_len
        return PrefixLanguageModeling(1, n // 2, generator=g, rank=rank, world_size=world_size)
    return Seq2Seq(Seq2SeqTask(t.task, SEQ2SEQ_TOKENS, t.task_length, generator=g, rank=rank, world_size=world_size))


def train_batches(settings: RunSettings, data: Data, objective: Objective, rank: int, world_size: int):
    """An iterator of global batches (batch_size * grad_accum rows, this rank's share), with
    state_dict / load_state_dict (the data position); a step splits one into grad_accum micro-batches."""
    rows = settings.train.batch_size * settings.train.grad_accum
    if isinstance(objective, Seq2Seq):
        return TaskBatches(objective.task, rows)
    return Batches(data.train, settings.model.max_seq_len, rows, settings.train.seed, rank, world_size)


class TaskBatches:
    """Synthetic seq2seq batches drawn from the task's own generator (its state is the position)."""

    def __init__(self, task: Seq2SeqTask, batch_size: int):
        self.task, self.batch_size = task, batch_size

    def __iter__(self) -> "TaskBatches":
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        return self.task.sample(self.batch_size)

    def state_dict(self) -> dict:
        return self.task.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.task.load_state_dict(state)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1 over `warmup` steps, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_for(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, biases, scalars)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
