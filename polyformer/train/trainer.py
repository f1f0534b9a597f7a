"""The training loop behind `polyformer train` (`eval` and `generate` are in commands.py).

A run directory holds config.json (model + settings), the tokenizer, corpus.json (what the run
trains on, checked when it resumes), checkpoints/, log.csv, loss.png and TensorBoard events when
tensorboard is installed. Under `torchrun` the same loop runs DistributedDataParallel (gloo on
CPU, nccl on GPU); only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..losses import loss_names
from ..moe.parallel import balance_over
from .checkpoint import checkpoint_step, load_checkpoint, resume_checkpoint, save_checkpoint
from .distributed import Gathered, join, leave, shard
from .expert_parallel import ExpertParallel, refuse
from .logs import TRAIN_FIELDS, CSVLog, TensorBoardLog, plot_losses
from .progress import progress_bar
from .record import CorpusChanged
from .resume import Complete, check_remaining, planned_steps, settings_for, updated_config
from .run import run_config, save_run_config
from .sample import sample
from .scoring import evaluate
from .settings import RunSettings, to_dict
from .setup import (Data, build_objective, build_run_model, check_windows, load_data, lr_factor, optimizer_for,
                    train_batches)


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
          overrides: list[tuple[str, str]] | None = None, resume: bool = False, corpus_change: bool = False) -> int:
    """`polyformer train`; `corpus_change` (--allow-corpus-change) lets a resume continue on a
    corpus other than the one the run recorded."""
    if corpus_change and not resume:
        raise SystemExit("polyformer: --allow-corpus-change lets --resume continue on a changed corpus; a new run "
                         "records its corpus as it is")
    rank, world = join()
    finished = False
    run_dir = Path(out)
    created = rank == 0 and not resume and not run_dir.exists()
    try:
        code = _train(run_dir, preset, config_file, overrides or [], resume, corpus_change, rank, world)
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


def _train(run_dir: Path, preset: str | None, config_file: str | None, overrides: list[tuple[str, str]],
           resume: bool, corpus_change: bool, rank: int, world: int) -> int:
    settings, config = settings_for(run_dir, preset, config_file, overrides, resume)
    t = settings.train
    refuse(t, world)
    if t.fsdp and world == 1:
        raise SystemExit("polyformer: --fsdp shards the model across processes: start the run with "
                         "torchrun --nproc_per_node=N -m polyformer train ... --fsdp")
    if t.batch_size % world:
        raise SystemExit(f"polyformer: train.batch_size ({t.batch_size}) must be a multiple of the "
                         f"number of processes ({world})")
    plan, note = t.steps, None
    if resume:                    # before anything is read or written
        checkpoint = resume_checkpoint(run_dir)
        plan = planned_steps(config)
        try:
            note = check_remaining(run_dir, checkpoint, checkpoint_step(checkpoint), settings, plan)
        except Complete as done:
            say(rank, str(done))
            return 0
    torch.manual_seed(t.seed)
    if rank == 0:                   # rank 0 trains / saves the tokenizer, the others then read it
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            data = load_data(settings, run_dir, fresh=not resume, corpus_change=corpus_change)
        except CorpusChanged as err:
            raise SystemExit(f"polyformer: cannot resume {str(run_dir)!r}: {err}. Restore those files to continue on "
                             "the text it trained on, or pass --allow-corpus-change to continue on the corpus as it "
                             "is now (nothing was changed)") from None
    if world > 1:
        dist.barrier()
    if rank != 0:
        data = load_data(settings, run_dir, fresh=False)
    check_windows(settings, data)
    model = build_run_model(settings, data)
    objective = build_objective(settings, data, rank, world)
    objective.check(model)
    if rank == 0 and not resume:
        save_run_config(run_dir, run_config(model, {"settings": to_dict(settings), "corpus_sha256": data.corpus_sha256,
                                                    "schedule_steps": plan}))
    if t.fsdp or t.expert_parallel > 1:     # full weights go in before sharding, the optimizer state after
        state = load_checkpoint(checkpoint, model) if resume else None
    if t.fsdp:
        shard(model)
    experts = ExpertParallel(model, t.expert_parallel) if t.expert_parallel > 1 else None
    optimizer = optimizer_for(model, t.lr, t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(          # past its plan, the final rate holds
        optimizer, lambda s: lr_factor(s, t.warmup, plan, t.min_lr_ratio))
    batches = train_batches(settings, data, objective, rank, world)
    step = 0
    if resume:
        if t.fsdp:
            load_checkpoint(checkpoint, None, Gathered(model, optimizer), scheduler, rng=False)
        elif experts is not None:
            load_checkpoint(checkpoint, None, experts.optimizer(optimizer), scheduler, rng=False)
        else:
            state = load_checkpoint(checkpoint, model, optimizer, scheduler)
        step = state["step"]
        batches.load_state_dict(state["data_state"]["batches"])
        objective.load_state_dict(state["data_state"]["objective"])
        if rank == 0:             # what a later `--resume` alone continues: these steps, this corpus
            save_run_config(run_dir, updated_config(config, settings, plan, data.corpus_sha256), overwrite=True)
    params = experts.total if experts is not None else sum(p.numel() for p in model.parameters())
    say(rank, f"run {run_dir}: {params:,} parameters, objective {t.objective}, "
              f"{'resuming at step ' + str(step) if resume else 'new'}"
              + (f", corpus sha256 {data.corpus_sha256[:16]}, {data.train.numel():,} train / "
                 f"{data.val.numel():,} validation tokens" if data.train is not None else ""))
    if note is not None:
        say(rank, note)
    ddp = world > 1 and not t.fsdp and experts is None       # expert parallel: `experts.sync` instead
    net: nn.Module = nn.parallel.DistributedDataParallel(model) if ddp else model
    if world > 1:                 # MoE balance loss: f_i over the whole batch
        balance_over(model, dist.group.WORLD)
    if t.compile:
        net = torch.compile(net)
    aux_names = loss_names(model)      # auxiliary losses the blocks report, logged by name
    logs = _Logs(run_dir, step if resume else None, t.tensorboard, aux_names) if rank == 0 else None
    bar, show_bar = None, rank == 0 and t.progress
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
            total, aux = 0.0, torch.zeros(len(aux_names))
            batch = next(batches)
            parts = (list(zip(*(b.chunk(t.grad_accum) for b in batch))) if isinstance(batch, tuple)
                     else batch.chunk(t.grad_accum))
            for part in parts:            # gradient accumulation over equal micro-batches
                with autocast:
                    loss = objective.loss(net, part) / t.grad_accum
                loss.backward()
                total += loss.item()
                reported = objective.aux.values()
                aux += torch.tensor([reported.get(name, 0.0) for name in aux_names]) / t.grad_accum
            if world > 1:           # the logged losses are the global batch's
                reduced = torch.cat((torch.tensor([total]), aux))
                dist.all_reduce(reduced)
                total, aux = reduced[0].item() / world, reduced[1:] / world
            if experts is not None:     # in place of DDP: the replicated gradients averaged, experts' summed
                experts.sync()
            if t.grad_clip and experts is not None:
                experts.clip(t.grad_clip)
            elif t.grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            last_loss = total
            now = time.time()
            rate = (step - first) * tokens_per_step / max(1e-9, now - started)
            if step == opening + 1:     # later rates (and the ETA) leave out the first step: kernel build, warm-up
                started, first = now, step
            if bar is None and show_bar:    # opened after the first step: a kernel build's line comes first
                bar = progress_bar(t.steps, step)
            elif bar is not None:
                bar.update(1)
            if bar is not None:
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
                logs.write(step, total, metrics.get("loss"), scheduler.get_last_lr()[0], rate,
                           dict(zip(aux_names, aux.tolist())))
            if evaluate_now and (rank == 0 or t.fsdp or experts is not None):   # a sharded model samples on every rank
                _report(model, settings, data, step, metrics, bar, show=rank == 0)
            if step % t.checkpoint_every == 0 or step == t.steps or stop.signal is not None:
                weights, optimizer_state = model, optimizer
                if t.fsdp:            # gathering is collective: every rank takes part, rank 0 writes
                    weights, optimizer_state = Gathered(model).gather(), Gathered(model, optimizer).gather()
                elif experts is not None:
                    weights, optimizer_state = experts.gathered(optimizer)
                if rank == 0:
                    save_checkpoint(run_dir, step, weights, optimizer_state, scheduler,
                                    data_state={"batches": batches.state_dict(), "objective": objective.state_dict()},
                                    keep_last=t.keep_last)
                if world > 1:
                    dist.barrier()
            started += time.time() - paused     # evaluation, sampling and checkpoints are not training time
            if bar is not None:
                bar.set_description("train")
                bar.unpause()                   # nor are they in the bar's ETA
            if stop.signal is not None:
                say(rank, f"\nstopped by signal {stop.signal} at step {step}; checkpoint saved, "
                          f"continue with --resume")
                return 128 + stop.signal
    if bar is not None:
        bar.close()
    say(rank, f"done: {step} steps, last train loss {last_loss:.4f}")
    return 0


class _Logs:
    def __init__(self, run_dir: Path, resume_step: int | None, tensorboard: bool | None = None,
                 aux_names: tuple[str, ...] = ()):
        self.run_dir = run_dir
        self.csv = CSVLog(run_dir / "log.csv", TRAIN_FIELDS + tuple(f"aux_{n}" for n in aux_names),
                          resume_step=resume_step)
        self.tensorboard = TensorBoardLog(run_dir / "tensorboard", resume_step=resume_step, asked=tensorboard)

    def write(self, step: int, train_loss: float, val_loss: float | None, lr: float, rate: float,
              aux: dict[str, float] | None = None) -> None:
        row = {"step": step, "train_loss": train_loss, "val_loss": val_loss if val_loss is not None else "",
               "lr": lr, "tokens_per_s": round(rate, 1), **{f"aux_{n}": v for n, v in (aux or {}).items()}}
        self.csv.log(row)
        self.tensorboard.log({k: v for k, v in row.items() if v != ""})
        if val_loss is not None:
            plot_losses(self.run_dir / "log.csv", self.run_dir / "loss.png")


def _report(model: nn.Module, settings: RunSettings, data: Data, step: int, metrics: dict[str, float],
            bar: Any, show: bool = True) -> None:
    text = f"step {step}: " + "  ".join(f"val {k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items())
    if settings.train.objective in ("lm", "prefix_lm"):
        text += "\nsample:\n" + sample(model, data.tokenizer, "\n", settings.train.sample_tokens, 0.8, 40, None, step)
    if show:
        (bar.write if bar is not None else print)(text)
