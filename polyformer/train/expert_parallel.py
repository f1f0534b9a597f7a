"""`--train.expert_parallel N` in the training loop: what it refuses, and the loop's hooks (moe/parallel.py
does the work). The model is built whole on every rank (same seed), a resumed run's full weights loaded, then
each rank keeps its experts; DistributedDataParallel is replaced by `sync` after backward (the same mean over
the world for the replicated parameters); checkpoints are gathered whole (collective), rank 0 writes them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..moe import parallel
from .settings import TrainSettings


def refuse(t: TrainSettings, world: int) -> None:
    """SystemExit naming the setting when expert parallelism cannot run as asked."""
    n = t.expert_parallel
    if n == 1:
        return
    if t.fsdp:
        raise SystemExit(f"polyformer: train.expert_parallel={n} does not combine with --fsdp (FSDP would shard the "
                         "placed experts again): drop one of them")
    if t.compile:
        raise SystemExit(f"polyformer: train.expert_parallel={n} exchanges tokens by counts torch.compile cannot "
                         "trace: drop --train.compile")
    if world == 1:
        raise SystemExit(f"polyformer: train.expert_parallel={n} spreads the experts over processes: start the run "
                         f"with torchrun --nproc_per_node=M -m polyformer train ... (M a multiple of {n})")
    if world % n:
        raise SystemExit(f"polyformer: train.expert_parallel={n} must divide the number of processes ({world})")


class ExpertParallel:
    """The placed model's hooks: gradient sync, clipping, whole checkpoints."""

    def __init__(self, model: nn.Module, size: int):
        self.model = model
        self.total = sum(p.numel() for p in model.parameters())     # every expert's, before placing
        self.groups = parallel.groups(size)
        try:
            parallel.place(model, self.groups)
        except ValueError as err:
            raise SystemExit(f"polyformer: {err}") from None

    def sync(self) -> None:
        parallel.sync_gradients(self.model, self.groups)
        parallel.broadcast_buffers(self.model)

    def clip(self, max_norm: float) -> Tensor:
        return parallel.clip_grad_norm(self.model, max_norm, self.groups)

    def gathered(self, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """(weights, optimizer) for `save_checkpoint`, each whole. Collective: every rank calls it."""
        return (_State(parallel.full_state_dict(self.model, self.groups)),
                _State(parallel.full_optimizer_state(optimizer, self.model, self.groups)))

    def optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """What `load_checkpoint` loads a whole optimizer state into: this rank's share of it."""
        return _Loader(lambda state: parallel.load_optimizer_state(optimizer, self.model, state))


class _State:
    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


class _Loader:
    def __init__(self, load: Any):
        self.load_state_dict = load
