"""What every arena task shares: building a variant's model, the budget, the training loop with one
optimiser and schedule, and the measurements (tokens per second, peak memory, parameters).

Every variant of a task gets the same seed for its weights, the same batches in the same order (a
task's `step_loss(step)` draws its batch from the step alone), the same optimiser, learning rate
schedule and budget. A token budget gives every variant the same data; a time budget gives every
variant the same wall-clock time (faster variants then see more data, which is the point of it).
"""

from __future__ import annotations

import math
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from .variants import Variant


# --- models -----------------------------------------------------------------------------------

def build_model(v: Variant, *, num_tokens: int, max_seq_len: int, dim: int, depth: int, heads: int,
                causal: bool, seed: int) -> nn.Module:
    """A TransformerWrapper over a Decoder (causal) or Encoder with the variant's keywords, weights
    drawn from `seed`."""
    from polyformer import TransformerWrapper

    stack = build_layers(v, dim=dim, depth=depth, heads=heads, causal=causal, seed=seed)
    return TransformerWrapper(num_tokens=num_tokens, max_seq_len=max_seq_len, attn_layers=stack,
                              **v.wrapper)


def build_layers(v: Variant, *, dim: int, depth: int, heads: int, causal: bool, seed: int) -> nn.Module:
    """The variant's layer stack alone: (b, n, dim) in and out (the efficiency task)."""
    from polyformer import Decoder, Encoder

    if v.causal_only and not causal:
        raise ValueError(f"variant {v.name!r} needs a causal (Decoder) task")
    if v.encoder_only and causal:
        raise ValueError(f"variant {v.name!r} needs a bidirectional (Encoder) task")
    torch.manual_seed(seed)
    return (Decoder if causal else Encoder)(dim=dim, depth=depth, heads=heads, attn_dim_head=dim // heads,
                                            **v.layers)


def with_changes(base: dict[str, Any], changes: dict[str, Any] | None, task: str) -> dict[str, Any]:
    """`base` settings with `changes` (from --set) applied; a name `base` lacks fails, naming the valid ones."""
    changes = changes or {}
    unknown = sorted(set(changes) - set(base))
    if unknown:
        raise ValueError(f"--set: task {task!r} has no setting(s) {unknown}; its settings are {sorted(base)}")
    def like(k: str, v: Any) -> Any:          # a list setting given one value is a list of one
        if isinstance(base[k], tuple):
            return tuple(v) if isinstance(v, (list, tuple)) else (v,)
        return v

    return {**base, **{k: like(k, v) for k, v in changes.items()}}


def parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@contextmanager
def variant_env(v: Variant) -> Iterator[None]:
    """The variant's environment switches, restored afterwards."""
    old = {k: os.environ.get(k) for k in v.env}
    os.environ.update(v.env)
    try:
        yield
    finally:
        for k, value in old.items():
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value


def prime() -> None:
    """One tiny training step before any variant runs: the process's one-time costs (loading the
    compiled attention kernel and its threads, autograd, the optimiser) then fall on no variant's
    time or memory."""
    from polyformer import Decoder, TransformerWrapper

    model = TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=Decoder(dim=16, depth=1, heads=2))
    optimiser = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimiser.step()


def run_rows(task: str, variants: list[Variant], run_one: Callable[[Variant], dict[str, Any]],
             log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """{variant: run_one(variant)} under each variant's environment, each row with its wall time and
    the variant's description and keywords."""
    prime()
    rows = {}
    for v in variants:
        log(f"{task}: {v.name}")
        start = time.perf_counter()
        with variant_env(v):
            row = run_one(v)
        rows[v.name] = {"summary": v.summary, "paper": v.paper,
                        "keywords": {"layers": v.layers, "wrapper": v.wrapper, "env": v.env},
                        **row, "wall_s": time.perf_counter() - start}
    return rows


# --- budget -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """Training budget: `tokens` (every variant sees the same data) or `seconds` (the same time)."""

    tokens: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.seconds is None):
            raise ValueError("a budget is either tokens or seconds")
        if (self.tokens is not None and self.tokens < 1) or (self.seconds is not None and self.seconds <= 0):
            raise ValueError(f"the budget must be positive, got {self}")

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """'2M' / '500k' / '300000' / '3e5' tokens, or '90s' / '5min' of training time."""
        s = text.strip().lower()
        m = re.fullmatch(r"([0-9.e+]+)\s*(s|sec|seconds|min|m|k|tokens)?", s)
        if m is None:
            raise ValueError(f"--budget: expected tokens (500k, 2M, 3e5) or time (90s, 5min), got {text!r}")
        value, unit = float(m.group(1)), m.group(2) or ""
        if unit in ("s", "sec", "seconds"):
            return cls(seconds=value)
        if unit == "min":
            return cls(seconds=value * 60)
        scale = {"k": 1e3, "m": 1e6}.get(unit, 1)
        return cls(tokens=int(value * scale))

    def progress(self, tokens: int, seconds: float) -> float:
        return tokens / self.tokens if self.tokens is not None else seconds / self.seconds

    def describe(self) -> str:
        return f"{self.tokens:,} tokens" if self.tokens is not None else f"{self.seconds:g} s"

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "seconds": self.seconds}


# --- training ---------------------------------------------------------------------------------

@dataclass
class Optimiser:
    """AdamW with linear warmup then cosine decay to `floor` of the peak, over the budget's progress."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    warmup: float = 0.05            # fraction of the budget
    floor: float = 0.1
    clip: float = 1.0

    def rate(self, progress: float) -> float:
        if progress < self.warmup:
            return self.lr * max(progress, 1e-3) / self.warmup
        t = min(1.0, (progress - self.warmup) / max(1e-9, 1 - self.warmup))
        return self.lr * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class Trained:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    losses: list[tuple[int, float]] = field(default_factory=list)     # (step, loss), every `log_every`
    peak_mib: float | None = None                                     # tensor memory of one step
    first: tuple[int, float] = (0, 0.0)                               # (tokens, seconds) of step 1
    solved_at: int | None = None                                      # tokens when done() first held

    @property
    def tokens_per_s(self) -> float:
        """Throughput after the first step (which pays one-time costs: kernel loads, allocations)."""
        tokens, seconds = self.tokens - self.first[0], self.seconds - self.first[1]
        if self.steps < 2 or seconds <= 0:
            return self.tokens / self.seconds if self.seconds else float("nan")
        return tokens / seconds

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "tokens": self.tokens, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s, "peak_mib": self.peak_mib,
                "final_loss": self.losses[-1][1] if self.losses else None, "solved_at": self.solved_at,
                "losses": self.losses}


def train(model: nn.Module, step_loss: Callable[[int], tuple[Tensor, int]], budget: Budget, opt: Optimiser,
          log: Callable[[str], None] | None = None, log_every: int = 50,
          done: Callable[[], bool] | None = None, check_every: int = 500) -> Trained:
    """Optimise `step_loss(step) -> (loss, tokens in the step)` until the budget is spent, or until
    `done()` (asked every `check_every` steps, in eval mode) says the task is solved: the tokens
    seen by then are `solved_at`.

    Time (the time budget, tokens per second) counts the training steps only, not `done()`.
    Memory (`peak_mib`) is the peak of tensor bytes allocated during one more forward + backward
    after training, over those live at its start (activations, gradients, attention buffers; not
    the weights or the optimiser's state, which are the parameter count's business): measured by
    the profiler's allocator total, so it is exact and the same on every run, unlike resident size."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    optimiser = torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                                   {"params": other, "weight_decay": 0.0}], lr=opt.lr, betas=opt.betas)
    model.train()
    result = Trained()
    start = time.perf_counter()
    while budget.progress(result.tokens, result.seconds) < 1:
        lr = opt.rate(budget.progress(result.tokens, result.seconds))
        for group in optimiser.param_groups:
            group["lr"] = lr
        loss, tokens = step_loss(result.steps)
        loss.backward()
        if opt.clip:
            nn.utils.clip_grad_norm_(params, opt.clip)
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        result.steps += 1
        result.tokens += tokens
        result.seconds = time.perf_counter() - start
        if result.steps == 1:
            result.first = (result.tokens, result.seconds)
        if result.steps % log_every == 0 or result.steps == 1:
            value = float(loss.detach())
            result.losses.append((result.steps, value))
            if not math.isfinite(value):
                if log is not None:
                    log(f"  step {result.steps}: loss {value}; stopped")
                break
            if log is not None:
                log(f"  step {result.steps}: loss {value:.4f}, lr {lr:.2e}, "
                    f"{result.tokens / result.seconds:,.0f} tok/s, "
                    f"{budget.progress(result.tokens, result.seconds):.0%}")
        if done is not None and result.steps % check_every == 0:
            paused = time.perf_counter()
            model.eval()
            solved = done()
            model.train()
            start += time.perf_counter() - paused          # the check is not training time
            if solved:
                result.solved_at = result.tokens
                if log is not None:
                    log(f"  solved after {result.steps} steps ({result.tokens:,} tokens); stopped")
                break
    result.peak_mib = step_peak_mib(model, step_loss, result.steps)
    model.eval()
    return result


def step_peak_mib(model: nn.Module, step_loss: Callable[[int], tuple[Tensor, int]], step: int) -> float:
    """Peak tensor memory (MiB) of one forward + backward of `step_loss(step)`, gradients dropped
    after it (the weights are not updated)."""
    from ..features import peak_step_bytes

    def one_step() -> None:
        loss, _ = step_loss(step)
        loss.backward()

    model.train()
    model.zero_grad(set_to_none=True)
    peak = peak_step_bytes(one_step) / 2 ** 20
    model.zero_grad(set_to_none=True)
    return peak
