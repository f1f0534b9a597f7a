"""Linear layers of a CPU training step whose large outputs and input gradients come from `buffers`.

A fused projection's output at 4096 tokens (q|k|v of width 1536: 24 MiB) and the attention output
projection's (8 MiB) are allocated anew in every step on autograd's path; glibc gives such blocks back
to the system between steps, and the next step faults them in again. `linear` runs the same product
into pooled memory (and the backward's input gradient too) wherever `applies`, the test the pooled
feedforward uses as well: autograd records the call on the CPU and nothing traces or transforms it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import buffers
from .autodiff import graph_gradients, transformed


def applies(x: Tensor, *params: Tensor) -> bool:
    """Whether a call on x with these parameters takes a pooled path: autograd records it on the CPU, in
    one dtype, outside autocast, torch.compile, export, jit, torch.func transforms and forward-mode AD."""
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        return False
    if x.device.type != "cpu" or x.dim() < 2 or any(p.dtype != x.dtype or p.device != x.device for p in params):
        return False
    if torch.is_autocast_enabled("cpu"):
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting():
        return False
    return not transformed(x, *params) and buffers.available()


def linear(layer: nn.Module, x: Tensor) -> Tensor:
    """layer(x), through PooledLinear when layer is a plain nn.Linear and the call `applies`."""
    if type(layer) is nn.Linear and applies(x, layer.weight):
        return PooledLinear.apply(x, layer.weight, layer.bias)
    return layer(x)


def project(rows: Tensor, weight: Tensor, bias: Tensor | None, shape: tuple[int, ...] | None = None) -> Tensor:
    """rows (n, in) @ weight^T + bias into a pooled tensor of `shape` (default (n, out)), returned as it
    is: not a view, so views of it have it as their base (cpu.packed_columns looks for that)."""
    out = buffers.empty(shape or (rows.shape[0], weight.shape[0]), rows.dtype)
    flat = out.view(rows.shape[0], weight.shape[0])
    if bias is None:
        torch.mm(rows, weight.t(), out=flat)
    else:
        torch.addmm(bias, rows, weight.t(), out=flat)
    return out


def parameter_grads(g: Tensor, rows: Tensor, need_weight: bool, need_bias: bool) -> tuple[Tensor | None, Tensor | None]:
    """The weight's and bias's gradients of a linear layer that read `rows` (n, in), for the output
    gradient g (n, out)."""
    return g.t().mm(rows) if need_weight else None, g.sum(0) if need_bias else None


class PooledLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) with its output and the input's gradient in pooled memory. A backward
    under create_graph=True runs F.linear's own, so that it has derivatives in turn."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight, bias)
        return project(x.reshape(-1, x.shape[-1]), weight, bias, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        if torch.is_grad_enabled():             # create_graph=True: F.linear's path, with a graph
            return graph_gradients(F.linear, (x, weight, bias), grad, ctx.needs_input_grad)
        need_x, need_weight, need_bias = ctx.needs_input_grad
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = None
        if need_x:
            grad_x = torch.mm(g, weight, out=buffers.empty(x.shape, g.dtype).view(g.shape[0], -1)).view(x.shape)
        return (grad_x, *parameter_grads(g, x.reshape(-1, x.shape[-1]), need_weight, need_bias))
