"""Several processes under `torchrun`: DistributedDataParallel, or FSDP sharding (`--fsdp`), with
checkpoints always written as full, unsharded state dicts by rank 0."""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..stack import AttentionLayers


def join() -> tuple[int, int]:
    """(rank, world size); joins the process group (nccl on GPU, gloo on CPU) when started by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def leave(finished: bool) -> None:
    """Leave the process group at the end of a run. The sharded model's hooks form reference cycles
    that would otherwise be freed during interpreter shutdown, after the group is gone, and gloo
    aborts the process then ("terminate called without an active exception"). So collect them
    first, and on a clean finish wait for every rank before tearing the group down."""
    if not dist.is_initialized():
        return
    gc.collect()
    if finished:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def shard(model: nn.Module) -> nn.Module:
    """FSDP2: every block of every stack is its own shard unit, then the model itself."""
    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns when the root returns a view (any 3-d nn.Linear output is one); the objectives
    # only read the logits (cross-entropy, no in-place change), so the warning is noise here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for stack in (m for m in model.modules() if isinstance(m, AttentionLayers)):
        for block in stack.blocks:
            fully_shard(block)
    fully_shard(model)
    return model


def _full() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


class Gathered:
    """A sharded model or optimizer seen whole: `state_dict()` gathers the full state (a collective,
    so every rank calls it), `load_state_dict()` scatters a full one back into the shards."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer
        self.state: dict | None = None

    def gather(self) -> "Gathered":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self.optimizer is None:
            self.state = get_model_state_dict(self.model, options=_full())
        else:
            self.state = get_optimizer_state_dict(self.model, self.optimizer, options=_full())
        return self

    def state_dict(self) -> dict:
        if self.state is None:
            raise RuntimeError("gather() first: gathering is collective, every rank must take part")
        return self.state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if self.optimizer is None:
            raise TypeError("a sharded model's weights are loaded before sharding")
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state, options=_full())
