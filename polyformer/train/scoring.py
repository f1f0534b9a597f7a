"""What `eval` and the training loop's evaluations measure: the loss of a run on its validation
split (fixed random windows, the same every time), or on text of the user's choice (every token
of the given files, in consecutive windows)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .batches import Batches
from .objectives import MaskedLanguageModeling, Seq2Seq, token_accuracy
from .settings import RunSettings


def scores(loss: float, bytes_per_token: float) -> dict[str, float]:
    """A mean loss in nats per token, with its perplexity and bits per byte."""
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "bits_per_byte": loss / math.log(2) / bytes_per_token}


def task_loss(objective: Any, model: nn.Module, batch: Any) -> float:
    """The objective's loss on a batch without the weighted auxiliary terms it adds for training
    (routing commitment, ponder cost, ...): a score measures the prediction alone."""
    loss = objective.loss(model, batch)
    aux = objective.aux.total()
    return (loss if aux is None else loss - aux.to(loss.dtype)).item()


@torch.no_grad()
def evaluate(model: nn.Module, objective: Any, settings: RunSettings, data: Any,
             batches: int | None = None) -> dict[str, float]:
    """Validation loss over fixed batches (the same every time, auxiliary losses left out),
    perplexity and bits per byte."""
    n = batches or settings.train.eval_batches
    was_training = model.training
    model.eval()
    state = objective.state_dict()
    try:
        if isinstance(objective, Seq2Seq):
            g = torch.Generator().manual_seed(12345)
            losses = [task_loss(objective, model, objective.task.sample(settings.train.batch_size, generator=g))
                      for _ in range(n)]
            return {"loss": sum(losses) / n, "accuracy": token_accuracy(model, objective.task, n=64)}
        if hasattr(objective, "generator"):
            objective.generator.manual_seed(12345)
        fixed = Batches(data.val, settings.model.max_seq_len, settings.train.batch_size, seed=12345)
        loss = sum(task_loss(objective, model, fixed.batch(k)) for k in range(n)) / n
    finally:
        objective.load_state_dict(state)
        model.train(was_training)
    return scores(loss, data.bytes_per_token)


def windows(tokens: Tensor, seq_len: int) -> list[Tensor]:
    """Consecutive windows of at most seq_len + 1 tokens of a (N,) stream, window k starting at
    k * seq_len: each window's last token is the next one's first, so every token but the first
    is a target exactly once. The last window may be shorter (at least 2 tokens)."""
    if tokens.numel() < 2:
        raise ValueError(f"the text has {tokens.numel()} token(s); scoring needs at least 2")
    return [tokens[s: s + seq_len + 1] for s in range(0, tokens.numel() - 1, seq_len)]


def _summed(model: nn.Module, x: Tensor, objective: Any) -> tuple[float, int]:
    """(summed loss in nats, targets counted) of rows x (b, n + 1)."""
    if isinstance(objective, MaskedLanguageModeling):
        inp, target = objective.mask(x[:, :-1])
    else:                       # lm and prefix_lm runs: next-token loss, causal throughout
        inp, target = x[:, :-1], x[:, 1:]
    ignore = objective.ignore_index
    loss = F.cross_entropy(model(inp).transpose(1, 2).float(), target, ignore_index=ignore, reduction="sum")
    return loss.item(), int((target != ignore).sum())


@torch.no_grad()
def text_loss(model: nn.Module, objective: Any, tokens: Tensor, seq_len: int, batch_size: int,
              max_batches: int | None = None) -> tuple[float, int]:
    """(mean loss per target token, targets counted) of a causal run on a token stream (N,):
    next-token cross-entropy over `windows(tokens, seq_len)`, `batch_size` windows per forward
    (the first `max_batches` batches only, when given). An MLM run's masked-token loss over the
    same windows, the masks drawn from a fixed seed."""
    if isinstance(objective, Seq2Seq):
        raise ValueError("a seq2seq run learns a synthetic task and has no text to score: --data.paths does not "
                         "apply to it")
    if isinstance(objective, MaskedLanguageModeling):
        state = objective.state_dict()
        objective.generator.manual_seed(12345)
    parts = windows(tokens, seq_len)
    full = [w for w in parts if w.numel() == seq_len + 1]
    batches = [torch.stack(full[i: i + batch_size]) for i in range(0, len(full), batch_size)]
    if len(full) < len(parts):
        batches.append(parts[-1][None])
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for x in batches[:max_batches]:
            summed, n = _summed(model, x, objective)
            total, count = total + summed, count + n
    finally:
        model.train(was_training)
        if isinstance(objective, MaskedLanguageModeling):
            objective.load_state_dict(state)
    return total / max(count, 1), count
