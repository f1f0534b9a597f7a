"""The training loop behind `polyformer train`, and `eval` / `generate` on a run directory.

A run directory holds config.json (model + settings), the tokenizer, checkpoints/, log.csv,
loss.png and TensorBoard events when tensorboard is installed. Under `torchrun` the same loop runs
DistributedDataParallel (gloo on CPU, nccl on GPU); only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import flatten
from .batches import Batches
from .checkpoint import load_checkpoint, resume_checkpoint, save_checkpoint
from .distributed import Gathered, join, leave, shard
from .logs import CSVLog, TensorBoardLog, plot_losses
from .progress import progress_bar
from .objectives import Seq2Seq, token_accuracy
from .run import CONFIG, load_run_config, model_from_run, run_config, save_run_config
from .sample import prepare_for_sampling, sample, speculative_sample
from .settings import RunSettings, from_dict, resolve, to_dict
from .setup import (Data, build_objective, build_run_model, load_data, lr_factor, optimizer_for,
                    train_batches)
from .tokenizer import FILENAME as TOKENIZER_FILE


class Stop:
    """SIGINT / SIGTERM ask the loop to stop at the next step boundary, after a checkpoint."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "Stop":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum: int, frame: Any) -> None:
        self.signal = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def train(out: str, preset: str | None = None, config_file: str | None = None,
          overrides: list[tuple[str, str]] | None = None, resume: bool = False) -> int:
    rank, world = join()
    finished = False
    run_dir = Path(out)
    created = rank == 0 and not resume and not run_dir.exists()
    try:
        code = _train(run_dir, preset, config_file, overrides or [], resume, rank, world)
        finished = True
        return code
    except BaseException:
        # a new run that failed before its first checkpoint leaves nothing behind: neither a fresh
        # start ("already holds a run") nor --resume ("nothing to resume") could take it
        if created and run_dir.is_dir() and not any((run_dir / "checkpoints").glob("step-*")):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        leave(finished)


def _settings_for(run_dir: Path, preset: str | None, config_file: str | None,
                  overrides: list[tuple[str, str]], resume: bool) -> RunSettings:
    if not resume:
        if (run_dir / CONFIG).exists():
            raise SystemExit(f"polyformer: {str(run_dir)!r} already holds a run; pass --resume to continue it "
                             "or choose another --out (nothing was changed)")
        return resolve(preset, config_file, overrides)
    config = load_run_config(run_dir)
    if config["train"].get("converted_from"):
        raise SystemExit(f"polyformer: {str(run_dir)!r} was converted from a Hugging Face checkpoint "
                         "(polyformer convert): it can be sampled and evaluated, not resumed")
    settings = from_dict(config["train"]["settings"])
    fixed = [(dotted, value) for dotted, value in overrides if dotted not in CHANGEABLE]
    differ = _differences(settings, preset, config_file, fixed)
    if differ:
        listed = "; ".join(f"--{dotted} is {given!r} here but {ran!r} in the run" for dotted, given, ran in differ)
        raise SystemExit(f"polyformer: --resume continues {str(run_dir)!r} with its own settings, and this command "
                         f"differs: {listed}. Only --train.steps, --train.progress and --train.tensorboard may change; drop the others "
                         "or start a new run with another --out")
    overrides = [(dotted, value) for dotted, value in overrides if dotted in CHANGEABLE]
    return _with(settings, overrides)


CHANGEABLE = ("train.steps", "train.progress", "train.tensorboard")   # what a resume may change: length, display


def _differences(settings: RunSettings, preset: str | None, config_file: str | None,
                 overrides: list[tuple[str, str]]) -> list[tuple[str, object, object]]:
    """(setting, this command's value, the run's value) where the command repeated with --resume
    asks for something else than the run has. With --preset / --config the command's whole settings
    are compared (the original command plus --resume is accepted); without, only the settings it names."""
    import copy

    from .settings import set_value, to_dict as settings_dict

    if preset or config_file:
        given = resolve(preset, config_file, overrides)
    else:
        given = copy.deepcopy(settings)
        for dotted, value in overrides:
            set_value(given, dotted, value, source=f"--{dotted}")
    ours, theirs = flatten(settings_dict(given)), flatten(settings_dict(settings))
    return [(k, ours[k], theirs.get(k)) for k in ours if k not in CHANGEABLE and ours[k] != theirs.get(k)]


def _with(settings: RunSettings, overrides: list[tuple[str, str]]) -> RunSettings:
    from .settings import set_value, validate

    for dotted, value in overrides:
        set_value(settings, dotted, value, source=f"--{dotted}")
    validate(settings)
    return settings


def _train(run_dir: Path, preset: str | None, config_file: str | None, overrides: list[tuple[str, str]],
           resume: bool, rank: int, world: int) -> int:
    settings = _settings_for(run_dir, preset, config_file, overrides, resume)
    t = settings.train
    if t.fsdp and world == 1:
        raise SystemExit("polyformer: --fsdp shards the model across processes: start the run with "
                         "torchrun --nproc_per_node=N -m polyformer train ... --fsdp")
    if t.batch_size % world:
        raise SystemExit(f"polyformer: train.batch_size ({t.batch_size}) must be a multiple of the "
                         f"number of processes ({world})")
    torch.manual_seed(t.seed)
    if rank == 0:                   # rank 0 trains / saves the tokenizer, the others then read it
        run_dir.mkdir(parents=True, exist_ok=True)
        data = load_data(settings, run_dir, fresh=not resume)
    if world > 1:
        dist.barrier()
    if rank != 0:
        data = load_data(settings, run_dir, fresh=False)
    model = build_run_model(settings, data)
    objective = build_objective(settings, data, rank, world)
    objective.check(model)
    if rank == 0 and not resume:
        save_run_config(run_dir, run_config(model, {"settings": to_dict(settings), "corpus_sha256": data.corpus_sha256}))
    checkpoint = resume_checkpoint(run_dir) if resume else None
    if t.fsdp:                    # full weights go in before sharding, the optimizer state after
        state = load_checkpoint(checkpoint, model) if resume else None
        shard(model)
    optimizer = optimizer_for(model, t.lr, t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup, t.steps, t.min_lr_ratio))
    batches = train_batches(settings, data, objective, rank, world)
    step = 0
    if resume:
        if t.fsdp:
            load_checkpoint(checkpoint, None, Gathered(model, optimizer), scheduler, rng=False)
        else:
            state = load_checkpoint(checkpoint, model, optimizer, scheduler)
        step = state["step"]
        batches.load_state_dict(state["data_state"]["batches"])
        objective.load_state_dict(state["data_state"]["objective"])
    params = sum(p.numel() for p in model.parameters())
    say(rank, f"run {run_dir}: {params:,} parameters, objective {t.objective}, "
              f"{'resuming at step ' + str(step) if resume else 'new'}"
              + (f", corpus sha256 {data.corpus_sha256[:16]}, {data.train.numel():,} train / "
                 f"{data.val.numel():,} validation tokens" if data.train is not None else ""))
    net: nn.Module = nn.parallel.DistributedDataParallel(model) if world > 1 and not t.fsdp else model
    if t.compile:
        net = torch.compile(net)
    logs = _Logs(run_dir, step if resume else None, t.tensorboard) if rank == 0 else None
    bar = progress_bar(t.steps, step) if rank == 0 and t.progress else None
    autocast = (torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
                if t.bf16 else contextlib.nullcontext())
    tokens_per_step = t.batch_size * t.grad_accum * (settings.model.max_seq_len if data.train is not None
                                                     else 2 * t.task_length + 1)
    first = opening = step
    with Stop() as stop:
        started, last_loss = time.time(), float("nan")
        while step < t.steps:
            model.train()
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            batch = next(batches)
            parts = (list(zip(*(b.chunk(t.grad_accum) for b in batch))) if isinstance(batch, tuple)
                     else batch.chunk(t.grad_accum))
            for part in parts:            # gradient accumulation over equal micro-batches
                with autocast:
                    loss = objective.loss(net, part) / t.grad_accum
                loss.backward()
                total += loss.item()
            if world > 1:           # the logged loss is the global batch's
                reduced = torch.tensor(total)
                dist.all_reduce(reduced)
                total = reduced.item() / world
            if t.grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            last_loss = total
            now = time.time()
            rate = (step - first) * tokens_per_step / max(1e-9, now - started)
            if step == opening + 1:     # later rates (and the ETA) leave out the first step: kernel build, warm-up
                started, first = now, step
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{total:.3f}", tok_s=f"{rate:,.0f}")
            if world > 1:           # a signal seen by any rank stops every rank at this same step
                flag = torch.tensor(stop.signal or 0)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop.signal = int(flag) or None
            evaluate_now = step % t.eval_every == 0 or step == t.steps
            paused = time.time()
            if evaluate_now and bar is not None:
                bar.set_description("evaluating")
            metrics = evaluate(model, objective, settings, data) if evaluate_now else {}
            if logs is not None:
                logs.write(step, total, metrics.get("loss"), scheduler.get_last_lr()[0], rate)
            if evaluate_now and (rank == 0 or t.fsdp):   # a sharded model samples on every rank
                _report(model, settings, data, step, metrics, bar, show=rank == 0)
            if step % t.checkpoint_every == 0 or step == t.steps or stop.signal is not None:
                weights, optimizer_state = model, optimizer
                if t.fsdp:            # gathering is collective: every rank takes part, rank 0 writes
                    weights, optimizer_state = Gathered(model).gather(), Gathered(model, optimizer).gather()
                if rank == 0:
                    save_checkpoint(run_dir, step, weights, optimizer_state, scheduler,
                                    data_state={"batches": batches.state_dict(), "objective": objective.state_dict()},
                                    keep_last=t.keep_last)
                if world > 1:
                    dist.barrier()
            if bar is not None:
                bar.set_description("train")
            started += time.time() - paused     # evaluation, sampling and checkpoints are not training time
            if stop.signal is not None:
                say(rank, f"\nstopped by signal {stop.signal} at step {step}; checkpoint saved, "
                          f"continue with --resume")
                return 128 + stop.signal
    if bar is not None:
        bar.close()
    say(rank, f"done: {step} steps, last train loss {last_loss:.4f}")
    return 0


class _Logs:
    def __init__(self, run_dir: Path, resume_step: int | None, tensorboard: bool | None = None):
        self.run_dir = run_dir
        self.csv = CSVLog(run_dir / "log.csv", resume_step=resume_step)
        self.tensorboard = TensorBoardLog(run_dir / "tensorboard", resume_step=resume_step, asked=tensorboard)

    def write(self, step: int, train_loss: float, val_loss: float | None, lr: float, rate: float) -> None:
        row = {"step": step, "train_loss": train_loss, "val_loss": val_loss if val_loss is not None else "",
               "lr": lr, "tokens_per_s": round(rate, 1)}
        self.csv.log(row)
        self.tensorboard.log({k: v for k, v in row.items() if v != ""})
        if val_loss is not None:
            plot_losses(self.run_dir / "log.csv", self.run_dir / "loss.png")


@torch.no_grad()
def evaluate(model: nn.Module, objective: Any, settings: RunSettings, data: Data,
             batches: int | None = None) -> dict[str, float]:
    """Validation loss over fixed batches (the same every time), perplexity and bits per byte."""
    n = batches or settings.train.eval_batches
    was_training = model.training
    model.eval()
    state = objective.state_dict()
    try:
        if isinstance(objective, Seq2Seq):
            g = torch.Generator().manual_seed(12345)
            losses = [objective.loss(model, objective.task.sample(settings.train.batch_size, generator=g)).item()
                      for _ in range(n)]
            return {"loss": sum(losses) / n, "accuracy": token_accuracy(model, objective.task, n=64)}
        if hasattr(objective, "generator"):
            objective.generator.manual_seed(12345)
        fixed = Batches(data.val, settings.model.max_seq_len, settings.train.batch_size, seed=12345)
        loss = sum(objective.loss(model, fixed.batch(k)).item() for k in range(n)) / n
    finally:
        objective.load_state_dict(state)
        model.train(was_training)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "bits_per_byte": loss / math.log(2) / data.bytes_per_token}


def _report(model: nn.Module, settings: RunSettings, data: Data, step: int, metrics: dict[str, float],
            bar: Any, show: bool = True) -> None:
    text = f"step {step}: " + "  ".join(f"val {k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items())
    if settings.train.objective in ("lm", "prefix_lm"):
        text += "\nsample:\n" + sample(model, data.tokenizer, "\n", settings.train.sample_tokens, 0.8, 40, None, step)
    if show:
        (bar.write if bar is not None else print)(text)


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
    """A trained run: its settings, the model with the newest good checkpoint, and its data."""
    settings, model = load_model(run_dir)
    return settings, model, load_data(settings, Path(run_dir), fresh=False)


def evaluate_run(run_dir: str, batches: int | None = None) -> int:
    """`polyformer eval`: the scores on stdout, the checkpoint they are of on stderr."""
    settings, model, checkpoint = load_checkpointed(run_dir)
    data = load_data(settings, Path(run_dir), fresh=False)
    objective = build_objective(settings, data, 0, 1)
    result = evaluate(model, objective, settings, data, batches)
    print(f"polyformer eval: scored {checkpoint}", file=sys.stderr)
    print("  ".join(f"{k} {v:.4f}" for k, v in result.items()))
    return 0


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
             gamma: int | None = None) -> int:
    """`polyformer generate`: the run's text after `prompt`. With `draft` (a run on the same tokenizer),
    by speculative decoding with `gamma` draft tokens per target call (default 4), its acceptance on
    stderr; the whole text must then fit the target's window, where plain decoding would slide it."""
    settings, model, data = load_run(run_dir)
    _check_generates(settings, run_dir)
    if max_new_tokens < 1:
        raise SystemExit("polyformer generate: --max-new-tokens must be >= 1")
    if draft is None and gamma is not None:
        raise SystemExit("polyformer generate: --gamma sets speculative decoding's draft length; it needs --draft")
    prompt = prompt if prompt is not None else "\n"
    try:                                          # bad filter values, too long for learned positions
        if draft is None:
            prepare_for_sampling(model, int8)
            print(sample(model, data.tokenizer, prompt, max_new_tokens, temperature, k, p, seed))
            return 0
        gamma = 4 if gamma is None else gamma          # speculative_generate checks it
        draft_model = _draft_for(run_dir, draft)
        for net in (model, draft_model):
            prepare_for_sampling(net, int8)
        text, result = speculative_sample(model, draft_model, data.tokenizer, prompt, max_new_tokens, gamma,
                                          temperature, k, p, seed)
    except ValueError as err:
        raise SystemExit(f"polyformer generate: {err}") from None
    print(text)
    print(f"speculative decoding, gamma {gamma}: {result.accepted} of {result.proposed} draft tokens accepted "
          f"({result.acceptance_rate:.2f}), {result.tokens_per_target_call:.2f} tokens per target call",
          file=sys.stderr)
    return 0
