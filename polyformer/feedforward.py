"""Position-wise feedforward: GELU / ReLU / ReLU^2 (arXiv:2109.08668) / Swish, GLU variants (arXiv:2002.05202).

Training on the CPU, the plain feedforward (linear, GELU, ReLU or Swish, linear) runs as one autograd
function, `PooledFeedForward`, whose hidden tensors (tokens x inner: 32 MiB at 4096 tokens of inner
width 2048) come from `buffers` instead of fresh memory, and whose backward runs the activation's
derivative in place. That is the same arithmetic as autograd's, without the page faults of fresh
large tensors in every step; a training step at seq 1024 batch 4 ran about 0.25 s faster of 3.4-3.9
(paired rounds, `benchmarks/training.py`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import buffers, pooled
from .autodiff import graph_gradients
from .config import FeedForwardConfig


class ReluSquared(nn.Module):
    """relu(x)^2, from Primer (arXiv:2109.08668)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x).square()


class GeluTanh(nn.GELU):
    def __init__(self) -> None:
        super().__init__(approximate="tanh")


class FeedForward(nn.Module):
    """Linear -> activation (optionally gated: a * act(b)) -> dropout -> Linear. With `cfg.chunks` = c > 1
    (ff_chunks) the positions go through it in c pieces along the sequence, one after another: the same
    outputs, and only a piece's hidden tensor (n / c x inner) at a time without autograd."""

    def __init__(self, dim: int, cfg: FeedForwardConfig, dim_out: int | None = None):
        super().__init__()
        from .registry import ACTIVATION

        inner = int(dim * cfg.mult)
        self.glu = cfg.glu
        self.proj_in = nn.Linear(dim, inner * (2 if cfg.glu else 1), bias=cfg.bias)
        self.act = ACTIVATION[cfg.activation].build()
        self.dropout = nn.Dropout(cfg.dropout)
        self.proj_out = nn.Linear(inner, dim_out or dim, bias=cfg.bias)
        self.chunks = cfg.chunks

    def forward(self, x: Tensor) -> Tensor:
        if self.chunks > 1 and x.dim() > 1 and x.shape[-2] > 1:
            return torch.cat([self.dense(part) for part in self.split(x)], dim=-2)
        return self.dense(x)

    def split(self, x: Tensor) -> tuple[Tensor, ...]:
        """x (..., n, d) in the pieces `forward` takes: min(chunks, n) runs of positions."""
        return x.tensor_split(min(self.chunks, x.shape[-2]), dim=-2)

    def dense(self, x: Tensor) -> Tensor:
        """The feedforward on every position of x at once."""
        if pooled_applies(self, x):
            return PooledFeedForward.apply(x, self.proj_in.weight, self.proj_in.bias, self.proj_out.weight,
                                           self.proj_out.bias, self.act)
        return self.compute(x, self.proj_in, self.act, self.proj_out, self.glu, self.dropout)

    @staticmethod
    def compute(x: Tensor, proj_in: Callable, act: Callable, proj_out: Callable, glu: bool,
                dropout: Callable | None = None) -> Tensor:
        """The feedforward over given stages (the fast decode step passes them resolved)."""
        h = proj_in(x)
        if glu:
            h, gate = h.chunk(2, dim=-1)
            h = h * act(gate)
        else:
            h = act(h)
        return proj_out(dropout(h) if dropout is not None else h)


# --- the pooled training path -----------------------------------------------------------------

POOLED_ACTIVATIONS = (nn.GELU, GeluTanh, nn.ReLU, nn.SiLU)    # ATen has an out= form and an in-place derivative


def activate_into(act: nn.Module, h: Tensor, out: Tensor) -> Tensor:
    """act(h) written into out."""
    if isinstance(act, nn.GELU):
        return torch.ops.aten.gelu.out(h, approximate=act.approximate, out=out)
    if isinstance(act, nn.ReLU):
        return torch.clamp_min(h, 0, out=out)
    return torch.ops.aten.silu.out(h, out=out)


def activation_grad_(act: nn.Module, grad: Tensor, h: Tensor) -> Tensor:
    """grad *= act'(h), in place."""
    if isinstance(act, nn.GELU):
        return torch.ops.aten.gelu_backward.grad_input(grad, h, approximate=act.approximate, grad_input=grad)
    if isinstance(act, nn.ReLU):
        return torch.ops.aten.threshold_backward.grad_input(grad, h, 0, grad_input=grad)
    return torch.ops.aten.silu_backward.grad_input(grad, h, grad_input=grad)


def pooled_applies(ff: FeedForward, x: Tensor) -> bool:
    """Whether this call takes PooledFeedForward: the stages are plain linears around an activation it
    knows (no gate, no active dropout), and the call `pooled.applies` (autograd records it on the CPU,
    nothing traces or transforms it)."""
    if ff.glu or (ff.dropout.p > 0 and ff.training):
        return False
    if type(ff.proj_in) is not nn.Linear or type(ff.proj_out) is not nn.Linear or type(ff.act) not in POOLED_ACTIVATIONS:
        return False
    return pooled.applies(x, ff.proj_in.weight, ff.proj_out.weight)


class PooledFeedForward(torch.autograd.Function):
    """proj_out(act(proj_in(x))) with its two hidden tensors and the backward's hidden gradient taken
    from `buffers` (see the module docstring). Same operations as autograd's path; a backward under
    create_graph=True runs autograd's path again so that it has derivatives in turn."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w_in: Tensor, b_in: Tensor | None, w_out: Tensor, b_out: Tensor | None,
                act: nn.Module) -> Tensor:
        h = pooled.project(x.reshape(-1, x.shape[-1]), w_in, b_in)
        a = activate_into(act, h, buffers.empty(h.shape, x.dtype))
        y = F.linear(a, w_out, b_out)
        ctx.save_for_backward(x, w_in, b_in, h, a, w_out, b_out)
        ctx.act = act
        return y.view(*x.shape[:-1], w_out.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, w_in, b_in, h, a, w_out, b_out = ctx.saved_tensors
        need_x, need_w_in, need_b_in, need_w_out, need_b_out, _ = ctx.needs_input_grad
        if torch.is_grad_enabled():             # create_graph=True: autograd's path, with a graph
            return (*graph_gradients(lambda x, wi, bi, wo, bo: F.linear(ctx.act(F.linear(x, wi, bi)), wo, bo),
                                     (x, w_in, b_in, w_out, b_out), grad, ctx.needs_input_grad), None)
        rows = x.reshape(-1, x.shape[-1])
        g = grad.reshape(-1, grad.shape[-1])
        grad_w_out, grad_b_out = pooled.parameter_grads(g, a, need_w_out, need_b_out)
        grad_x = grad_w_in = grad_b_in = None
        if need_x or need_w_in or need_b_in:
            gh = activation_grad_(ctx.act, torch.mm(g, w_out, out=buffers.empty(h.shape, h.dtype)), h)
            grad_w_in, grad_b_in = pooled.parameter_grads(gh, rows, need_w_in, need_b_in)
            grad_x = gh.mm(w_in).view(x.shape) if need_x else None
        return grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out, None
