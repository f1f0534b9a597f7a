"""Expert parallelism (GShard arXiv:2006.16668, Switch arXiv:2101.03961): a world of W processes in W / N
expert groups of N consecutive ranks; within a group each process holds E / N of every expert layer's experts
(rank r of the group: experts r E / N ... (r + 1) E / N - 1) and the tokens travel to them with all_to_all
(exchange.py). Every other parameter is replicated on all W processes.

Gradients are synchronised by `sync_gradients`, called after backward in place of DistributedDataParallel:
the replicated parameters' gradients all-reduced (sum) over the world and divided by W -- the arithmetic of
DDP's mean --, each expert's gradient (already the sum over its group's tokens, through the exchange's
backward) summed over its W / N replicas (the ranks of the other groups holding the same experts) and divided
by W, like the rest. The loss each process minimises is its share's mean, so the result is the gradient of the
mean over the world's batch. Checkpoints hold the full expert set (`full_state_dict`, `full_optimizer_state`:
collective, every rank calls them); a full state is loaded into the model before `place`, and into the
optimizer with `load_optimizer_state` after."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .experts import Experts

PARAMS = ("w_in", "b_in", "w_out", "b_out")


@dataclass
class Groups:
    """This process's groups: `expert` (the N ranks its experts are spread over), `replicas` (the W / N ranks
    holding the same experts; None when N = W), its rank in the expert group and the world's size."""

    expert: Any         # None when N = 1
    replicas: Any       # None when N = W
    size: int
    rank: int
    world: int


def groups(size: int) -> Groups:
    """The groups of an N = `size` expert-parallel world. Collective: every rank creates every group, in order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"train.expert_parallel must divide the number of processes ({world}), got {size}")
    expert = replicas = None
    if size == world:
        expert = dist.group.WORLD if size > 1 else None
    else:
        for first in range(0, world, size):
            made = dist.new_group(list(range(first, first + size))) if size > 1 else None
            expert = made if first <= rank < first + size else expert
        for r in range(size):
            made = dist.new_group(list(range(r, world, size))) if size > 1 else dist.group.WORLD
            replicas = made if rank % size == r else replicas
    return Groups(expert, replicas, size, rank % size, world)


def expert_layers(model: nn.Module) -> Iterator[tuple[str, Experts]]:
    """(name, module) of every expert layer's routed experts (not the shared ones)."""
    from .layer import MoeFeedForward

    for name, module in model.named_modules():
        if isinstance(module, MoeFeedForward):
            yield f"{name}.experts" if name else "experts", module.experts


def place(model: nn.Module, g: Groups) -> nn.Module:
    """Keep this rank's E / N experts of every expert layer (the stacked weights sliced, `offset` their first
    global expert), and route tokens through the expert group; the balance loss counts the world's tokens."""
    found = list(expert_layers(model))
    if not found:
        raise ValueError("train.expert_parallel > 1 spreads the experts of ff_moe=True layers over processes; "
                         "this model has none")
    for _, experts in found:
        if experts.num % g.size:
            raise ValueError(f"train.expert_parallel={g.size} must divide ff_num_experts={experts.num}")
    for _, experts in found:
        local = experts.num // g.size
        experts.offset = g.rank * local
        for name in PARAMS:
            p = getattr(experts, name)
            if p is not None:
                setattr(experts, name, nn.Parameter(p.detach()[experts.offset: experts.offset + local].clone(),
                                                    requires_grad=p.requires_grad))
        experts.group = g.expert
    balance_over(model, dist.group.WORLD)
    return model


def balance_over(model: nn.Module, group: Any) -> None:
    """Data-parallel training: every expert layer's balance loss takes f_i over `group`'s whole batch."""
    from .layer import MoeFeedForward

    for module in model.modules():
        if isinstance(module, MoeFeedForward):
            module.balance_group = group


def _expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, experts in expert_layers(model) for n in PARAMS if (p := getattr(experts, n)) is not None]


def _reduce(grads: list[Tensor], group: Any, scale: float) -> None:
    """Sum grads over `group` (None: this process alone) in one flat buffer, then times `scale`."""
    if not grads:
        return
    flat = torch.cat([t.reshape(-1) for t in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    for t, part in zip(grads, flat.split([t.numel() for t in grads])):
        t.copy_(part.view_as(t))


def sync_gradients(model: nn.Module, g: Groups) -> None:
    """After backward: the replicated parameters' gradients averaged over the world, each expert's summed over
    its replicas and divided by the world's size (see the module's docstring). An expert parameter that got
    no token on any rank of its group has a zero gradient (as the stacked weights of one process would)."""
    experts = _expert_params(model)
    ids = {id(p) for p in experts}
    for p in experts:
        if p.grad is None and p.requires_grad:
            p.grad = torch.zeros_like(p)
    _reduce([p.grad for p in model.parameters() if id(p) not in ids and p.grad is not None], dist.group.WORLD,
            1 / g.world)
    _reduce([p.grad for p in experts if p.grad is not None], g.replicas, 1 / g.world)


def broadcast_buffers(model: nn.Module) -> None:
    """Every buffer as rank 0 holds it, as DistributedDataParallel does before each forward: state that a
    forward updates from its own rows (k-means centroids, a feature redraw count) stays one model across
    the ranks."""
    for buffer in model.buffers():
        dist.broadcast(buffer, 0)


def clip_grad_norm(model: nn.Module, max_norm: float, g: Groups) -> Tensor:
    """nn.utils.clip_grad_norm_ over the whole model's gradients, the experts of every rank of the group
    included (after `sync_gradients`, the replicas agree)."""
    experts = _expert_params(model)
    ids = {id(p) for p in experts}
    dense = [p.grad for p in model.parameters() if id(p) not in ids and p.grad is not None]
    local = [p.grad for p in experts if p.grad is not None]
    device = next(model.parameters()).device
    spread = _square(local, device)
    if g.expert is not None:
        dist.all_reduce(spread, group=g.expert)
    total = (_square(dense, device) + spread).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for t in dense + local:
        t.mul_(coef.to(t))
    return total


def _square(grads: list[Tensor], device: torch.device) -> Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return sum(t.detach().float().square().sum() for t in grads)


def _gather(t: Tensor, g: Groups) -> Tensor:
    """The group's slices of a stacked expert tensor (E / N, ...) -> (E, ...), in rank order."""
    if g.expert is None:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(g.size)]
    dist.all_gather(parts, t.detach().contiguous(), group=g.expert)
    return torch.cat(parts)


def full_state_dict(model: nn.Module, g: Groups) -> dict[str, Tensor]:
    """The model's state dict with every expert layer's full expert set. Collective."""
    state = model.state_dict()
    for prefix, experts in expert_layers(model):
        for name in PARAMS:
            if getattr(experts, name) is not None:
                state[f"{prefix}.{name}"] = _gather(state[f"{prefix}.{name}"], g)
    return state


def _indexed(optimizer: torch.optim.Optimizer) -> dict[int, Tensor]:
    """The optimizer's parameters by their index in its state dict."""
    return dict(enumerate(p for group in optimizer.param_groups for p in group["params"]))


def full_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, g: Groups) -> dict:
    """The optimizer's state dict with the expert parameters' per-element states (AdamW's moments) of the full
    expert set: what one process holding every expert would have. Collective."""
    state = optimizer.state_dict()
    ids = {id(p) for p in _expert_params(model)}
    for index, p in _indexed(optimizer).items():
        if id(p) in ids and index in state["state"]:
            state["state"][index] = {k: _gather(v, g) if torch.is_tensor(v) and v.shape == p.shape else v
                                     for k, v in state["state"][index].items()}
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, state: dict) -> None:
    """Load a full optimizer state (`full_optimizer_state`, or one process's) into a placed model's
    optimizer: the expert parameters' states sliced to this rank's experts."""
    offsets = {id(p): experts.offset for _, experts in expert_layers(model) for n in PARAMS
               if (p := getattr(experts, n)) is not None}
    inner = dict(state["state"])
    for index, p in _indexed(optimizer).items():
        if id(p) in offsets and index in inner:
            o, n = offsets[id(p)], p.shape[0]
            inner[index] = {k: v[o: o + n] if torch.is_tensor(v) and v.dim() == p.dim() and v.shape[1:] == p.shape[1:]
                            else v for k, v in inner[index].items()}
    optimizer.load_state_dict({**state, "state": inner})
