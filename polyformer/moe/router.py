"""The router of a mixture of experts: logits and probabilities in float32, top-k experts per token with
their gates, and the router's losses: Switch's load balance (arXiv:2101.03961) and ST-MoE's z-loss
(arXiv:2202.08906)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .options import MoeOptions


@dataclass
class Routing:
    logits: Tensor      # (t, E) float32
    probs: Tensor       # (t, E) float32, softmax of the logits
    gates: Tensor       # (t, k) float32: the chosen experts' probabilities, renormalised to sum 1 if asked
    experts: Tensor     # (t, k) long: the chosen experts, most probable first


class Router(nn.Module):
    """Tokens (t, dim) -> `Routing`. In training with jitter eps, the router's input is multiplied by noise
    drawn from U(1 - eps, 1 + eps) (Switch); the experts see the token unchanged."""

    def __init__(self, dim: int, options: MoeOptions):
        super().__init__()
        self.top_k = options.top_k
        self.renormalize = options.renormalized
        self.jitter = options.jitter
        self.weight = nn.Parameter(torch.empty(options.num_experts, dim))
        bound = 1 / math.sqrt(dim)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: Tensor) -> Routing:
        if self.training and self.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        logits = F.linear(x.float(), self.weight.float())
        probs = logits.softmax(dim=-1)
        gates, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, gates, experts)


def routed(experts: Tensor, num_experts: int, real: Tensor | None) -> Tensor:
    """The real tokens' routing choices per expert, (E,) float32; experts (t, k), real (t,) bool or None
    (every token)."""
    counts = F.one_hot(experts, num_experts).float().sum(dim=1)       # (t, E)
    return (counts if real is None else counts * real[:, None]).sum(dim=0)


def load(experts: Tensor, num_experts: int, real: Tensor | None) -> Tensor:
    """f: the fraction of the real tokens' routing choices that went to each expert, (E,) float32 summing
    to 1."""
    counts = routed(experts, num_experts, real)
    return counts / counts.sum().clamp_min(1.0)


def mean_over(values: Tensor, real: Tensor | None) -> Tensor:
    """The mean over tokens (dim 0) of values (t, ...), over the real ones when `real` (t,) is given."""
    if real is None:
        return values.mean(dim=0)
    w = real.to(values.dtype).view(-1, *[1] * (values.dim() - 1))
    return (values * w).sum(dim=0) / w.sum().clamp_min(1.0)


def balance_loss(routing: Routing, real: Tensor | None, group: object | None = None) -> Tensor:
    """Switch's load-balancing loss without its weight: E * sum_i f_i P_i, f_i the fraction of routing
    choices sent to expert i (no gradient), P_i the mean router probability of expert i; 1 when the router's
    probabilities are uniform.

    With `group` (data-parallel training, each process a share of the batch): f_i is the whole batch's (the
    counts all-reduced over the group) and P_i this process's summed probabilities times the group's size over
    the batch's token count, so that the mean over processes of this value is the whole batch's loss."""
    e = routing.probs.shape[-1]
    if group is None:
        return e * (load(routing.experts, e, real) * mean_over(routing.probs, real)).sum()
    import torch.distributed as dist

    summed = routing.probs if real is None else routing.probs * real[:, None]
    tokens = real.sum() if real is not None else routing.probs.new_tensor(float(routing.probs.shape[0]))
    stats = torch.cat([routed(routing.experts, e, real), tokens.reshape(1).float()]).detach()
    dist.all_reduce(stats, group=group)
    f = stats[:e] / stats[:e].sum().clamp_min(1.0)
    return e * (f * summed.sum(dim=0)).sum() * dist.get_world_size(group) / stats[e].clamp_min(1.0)


def z_loss(routing: Routing, real: Tensor | None) -> Tensor:
    """ST-MoE's router z-loss without its weight: mean over tokens of logsumexp(logits)^2."""
    return mean_over(torch.logsumexp(routing.logits, dim=-1).square(), real)
