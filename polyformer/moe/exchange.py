"""Expert parallelism's token exchange: each process of an expert group holds E / N of the experts and
sends every token to the process holding its expert with `all_to_all` (torch.distributed; gloo on the
CPU, NCCL on a GPU), then the experts' outputs back. Differentiable: the backward sends the gradients
the reverse way."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """Rows of x, `send[r]` of them to rank r of `group`, in rank order; returns the rows received,
    `recv[r]` from rank r. Its backward is the same exchange with send and recv swapped."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
    return _AllToAll.apply(x, send, recv, group)


def exchange_counts(counts: Tensor, group: Any) -> Tensor:
    """counts (E,) int64: how many of this rank's tokens go to each expert, experts held E / N per rank in
    rank order -> (N, E / N): row r, how many tokens rank r sends to each of this rank's experts."""
    size = dist.get_world_size(group)
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.view(size, -1)


def apply_sharded(x: Tensor, counts: Tensor, local: Callable[[Tensor, Tensor], Tensor], group: Any) -> Tensor:
    """The experts on tokens sorted by expert, the experts spread over `group`.

    x (T, d): this rank's tokens sorted by their (global) expert; counts (E,): tokens per expert;
    local(x_local, counts_local) the rank's own experts on their tokens sorted by local expert
    (counts_local (E / N,)). Returns (T, d_out): each token's expert output, in x's order. Every rank of the
    group takes part in both exchanges forward and backward, also when no token comes to its experts."""
    size = dist.get_world_size(group)
    per_rank = counts.view(size, -1)                           # (N, L): what this rank sends where
    incoming = exchange_counts(counts, group)                   # (N, L): what each rank sends here
    send, recv = per_rank.sum(1).tolist(), incoming.sum(1).tolist()
    got = all_to_all(x, send, recv, group)                      # by source rank, then local expert
    order = _by_expert(incoming)                                # -> by local expert, then source rank
    y = local(got[order], incoming.sum(0))
    if got.requires_grad and not y.requires_grad:   # no token here: both exchanges' backward must still run
        y = y + got[:0].sum()
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return all_to_all(y[back], recv, send, group)


def _by_expert(counts: Tensor) -> Tensor:
    """counts (N, L) of rows laid out source-major (all of source 0's rows by expert, then source 1's)
    -> the permutation that lays them out expert-major (expert 0's rows from every source, ...)."""
    flat = counts.flatten()
    start = flat.cumsum(0) - flat                               # where each (source, expert) run begins
    runs = start.view(counts.shape).t().flatten()               # runs in expert-major order
    lengths = counts.t().flatten()
    first = torch.repeat_interleave(runs - (lengths.cumsum(0) - lengths), lengths)
    return first + torch.arange(int(lengths.sum()), device=counts.device)
