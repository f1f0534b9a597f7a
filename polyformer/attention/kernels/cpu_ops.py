"""The compiled CPU attention kernel's registered operators (`polyformer::attention` and its backward,
and the packed pair whose backward writes one fused projection's gradient), with their fake
implementations for tracing and their autograd formulas. `cpu.py` builds the kernel, decides when it
runs and calls these; its `attention` is the public entry and re-exports every name here.

Each operator takes a `window` last (default 0: none): with causal attention, row r then sees the keys
r - w < j <= r; without, |r - j| <= w // 2 (queries and keys one sequence); the kernel computes only
each block's band of keys (`cpu_attention.cpp`, `cpu_backward.cpp`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...autodiff import graph_gradients
from . import cpu


def unpack(columns: Tensor, heads: int, kv_heads: int, dim_value: int) -> tuple[Tensor, Tensor, Tensor]:
    """q (b, h, t, d), k (b, hk, t, d), v (b, hk, t, dv): views of the columns packed_columns found."""
    b, t, width = columns.shape
    d = (width - kv_heads * dim_value) // (heads + kv_heads)
    q, k, v = columns.split((heads * d, kv_heads * d, kv_heads * dim_value), dim=-1)
    return (q.view(b, t, heads, d).transpose(1, 2), k.view(b, t, kv_heads, d).transpose(1, 2),
            v.view(b, t, kv_heads, dim_value).transpose(1, 2))


def unit_stride(t: Tensor) -> Tensor:
    """t itself when the BLAS can read its rows in place (unit stride within a row, rows apart); the
    kernel reads a length-1 sequence dimension whatever its stride."""
    if t.stride(-1) == 1 and (t.shape[-2] <= 1 or t.stride(-2) >= t.shape[-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def heads_inner(b: int, n: int, h: int, d: int, like: Tensor) -> Tensor:
    """A new (b, h, n, d) tensor laid out as (b, n, h, d), the kernel's output layout."""
    return like.new_empty(b, n, h, d).transpose(1, 2)


@torch.library.custom_op("polyformer::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, keep: bool,
                 window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(out, log-sum-exp, kept weights or an empty tensor)."""
    out, lse, weights = cpu.module().forward(unit_stride(q), unit_stride(k), unit_stride(v), scale, causal,
                                             keep, window)
    return out, lse, weights


@attention_op.register_fake
def fake_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, keep: bool,
                   window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    b, h, i, _ = q.shape
    weights = q.new_empty(b, h, cpu.kept_floats(i, k.shape[-2], causal, window)) if keep else q.new_empty(0)
    return heads_inner(b, i, h, v.shape[-1], q), q.new_empty(b, h, i), weights


@torch.library.custom_op("polyformer::attention_backward", mutates_args=())
def attention_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          weights: Tensor, scale: float, causal: bool,
                          window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = cpu.module().backward(unit_stride(grad), unit_stride(q), unit_stride(k), unit_stride(v),
                                       out, lse, weights, scale, causal, window)
    return dq, dk, dv


@attention_backward_op.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, weights: Tensor,
      scale: float, causal: bool, window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    b, h, i, d = q.shape
    hk, j = k.shape[1], k.shape[2]
    if hk == h:
        return heads_inner(b, i, h, d, q), heads_inner(b, j, h, d, k), heads_inner(b, j, h, v.shape[-1], v)
    return heads_inner(b, i, h, d, q), k.new_empty(b, hk, j, d), v.new_empty(b, hk, j, v.shape[-1])


def _save(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, scale, causal, _keep, window = inputs      # torch.library fills the defaults in
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale, ctx.causal, ctx.window = scale, causal, window
    # the log-sum-exp and the kept weights get no gradient: without this, autograd would hand the
    # backward zeros of their size (38 MB of weights per layer at seq 512 batch 8, faulted in and
    # filled every step)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad: Tensor | None, _grad_lse: Tensor | None,
              _grad_weights: Tensor | None) -> tuple[Tensor | None, ...]:
    if grad is None:
        return (None,) * 7
    q, k, v, out, lse, weights = ctx.saved_tensors
    if torch.is_grad_enabled():             # create_graph=True: a differentiable backward
        return (*explicit_gradients(q, k, v, grad, ctx.scale, ctx.causal, ctx.window), None, None, None, None)
    return (*attention_backward_op(grad, q, k, v, out, lse, weights, ctx.scale, ctx.causal, ctx.window),
            None, None, None, None)


attention_op.register_autograd(_backward, setup_context=_save)


def explicit_gradients(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, scale: float, causal: bool,
                       window: int = 0) -> tuple[Tensor | None, ...]:
    """The gradients through SDPA's math backend, plain differentiable operations, so that they
    have gradients in turn."""
    return graph_gradients(lambda q, k, v: reference_attention(q, k, v, scale, causal, window), (q, k, v), grad)


def band_mask(i: int, j: int, window: int, device: torch.device, causal: bool = True) -> Tensor:
    """(i, j) bool: row r sees the keys r - window < j <= r (top-left aligned), or (not causal)
    |r - j| <= window // 2."""
    ones = torch.ones(i, j, dtype=torch.bool, device=device)
    if not causal:
        return ones.tril(window // 2) & ~ones.tril(-(window // 2) - 1)
    return ones.tril() & ~ones.tril(-window)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window: int = 0) -> Tensor:
    """The same attention through SDPA's math backend: plain differentiable operations."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = band_mask(q.shape[-2], k.shape[-2], window, q.device, causal) if window else None
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and not window, scale=scale,
            enable_gqa=k.shape[1] != q.shape[1])


@torch.library.custom_op("polyformer::attention_packed", mutates_args=())
def attention_packed_op(columns: Tensor, heads: int, kv_heads: int, dim_value: int, scale: float, causal: bool,
                        keep: bool, window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """attention_op on q, k, v unpacked from one (b, t, C) tensor, whose gradient its backward writes
    whole."""
    out, lse, weights = cpu.module().forward(*unpack(columns, heads, kv_heads, dim_value), scale, causal, keep,
                                             window)
    return out, lse, weights


@attention_packed_op.register_fake
def _(columns: Tensor, heads: int, kv_heads: int, dim_value: int, scale: float, causal: bool,
      keep: bool, window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    return fake_attention(*unpack(columns, heads, kv_heads, dim_value), scale, causal, keep, window)


@torch.library.custom_op("polyformer::attention_packed_backward", mutates_args=())
def attention_packed_backward_op(grad: Tensor, columns: Tensor, out: Tensor, lse: Tensor, weights: Tensor,
                                 heads: int, kv_heads: int, scale: float, causal: bool, window: int = 0) -> Tensor:
    q, k, v = unpack(columns, heads, kv_heads, out.shape[-1])
    return cpu.module().backward_packed(unit_stride(grad), q, k, v, out, lse, weights, scale, causal, window)


@attention_packed_backward_op.register_fake
def _(grad: Tensor, columns: Tensor, out: Tensor, lse: Tensor, weights: Tensor, heads: int, kv_heads: int,
      scale: float, causal: bool, window: int = 0) -> Tensor:
    return torch.empty_like(columns, memory_format=torch.contiguous_format)


def _save_packed(ctx: Any, inputs: tuple, output: tuple) -> None:
    columns, heads, kv_heads, dim_value, scale, causal, _keep, window = inputs
    ctx.save_for_backward(columns, *output)
    ctx.heads, ctx.kv_heads, ctx.dim_value, ctx.scale, ctx.causal = heads, kv_heads, dim_value, scale, causal
    ctx.window = window
    ctx.set_materialize_grads(False)        # as in _save


def _backward_packed(ctx: Any, grad: Tensor | None, _grad_lse: Tensor | None,
                     _grad_weights: Tensor | None) -> tuple[Tensor | None, ...]:
    if grad is None:
        return (None,) * 8
    columns, out, lse, weights = ctx.saved_tensors
    if torch.is_grad_enabled():             # create_graph=True: a differentiable backward
        def attend(columns: Tensor) -> Tensor:
            q, k, v = unpack(columns, ctx.heads, ctx.kv_heads, ctx.dim_value)
            return reference_attention(q, k, v, ctx.scale, ctx.causal, ctx.window)
        return (*graph_gradients(attend, (columns,), grad), None, None, None, None, None, None, None)
    return (attention_packed_backward_op(grad, columns, out, lse, weights, ctx.heads, ctx.kv_heads, ctx.scale,
                                         ctx.causal, ctx.window), None, None, None, None, None, None, None)


attention_packed_op.register_autograd(_backward_packed, setup_context=_save_packed)
