"""Export a `TransformerWrapper`: `torch.export` of its forward with a dynamic batch and sequence
length, of one cached decode step, and ONNX of both.

The model code traces as one graph by itself (value checks run on eager calls only, see
`checks.tracing`), so `torch.export.export(model, (ids,))` works as it is; these helpers choose
the dynamic dimensions and the example inputs, and export an inference graph (eval mode; the
model's own mode is restored afterwards).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from .memory.kv_cache import DecodeState
from .wrappers import TransformerWrapper


class DecodeStep(nn.Module):
    """One cached decoding step of a `TransformerWrapper` over plain tensors, so it can be exported.

    forward(x (b, n) token ids, k, v, pos, mask, length) -> logits (b, n, num_tokens).

    k (layers, b, hk, max_len, d), v (layers, b, hv, max_len, dv), pos (b, max_len) long and
    mask (b, max_len) bool are a decode state's storage (`state.k`, `state.v`, `state.pos`,
    `state.mask`) and `length` its fill (`state.length`). The step writes the new tokens' keys,
    values, positions and mask in place after the first `length` positions, as the state itself
    does; the caller then advances its length by n. length 0 is the prompt, which the model's
    memory tokens precede: the length then grows by n + `net.num_memory_tokens`.

    The decode state must hold only keys and values: stacks with token shift (which caches block
    inputs) or cross-attention (which caches the context's keys) are refused.
    """

    def __init__(self, net: TransformerWrapper):
        super().__init__()
        if not isinstance(net, TransformerWrapper):
            raise TypeError(f"DecodeStep wraps a TransformerWrapper, got {type(net).__name__}")
        stack = net.attn_layers
        if not stack.causal:
            raise ValueError("DecodeStep needs a causal stack (a Decoder)")
        if stack.has_cross or any(block.shift is not None for block in stack.blocks):
            raise ValueError("DecodeStep needs a stack whose decode state is only keys and values: "
                             "not shift_tokens (it caches block inputs) nor cross-attention (the context)")
        kinds = {b.branch.decode_kind for b in stack.blocks if b.kind == "a"}
        if kinds - {"keys"}:
            raise ValueError("DecodeStep needs a stack whose decode state is only keys and values: not a kernel "
                             "with a recurrent summary (attn_performer, attn_linear, attn_rfa, gau)")
        if any(getattr(b.branch, "pattern", None) is not None for b in stack.blocks if b.kind == "a"):
            raise ValueError("DecodeStep cannot trace a decode step of an attention pattern (attn_window, attn_sparse, "
                             "...): which cached keys a step reads depends on the data; decode such models eagerly")
        moe = stack.cfg.ff.moe
        if moe is not None and moe.limited:
            raise ValueError("DecodeStep needs a stack whose decode state is only keys and values: not "
                             "ff_moe_capacity_factor / ff_moe_capacity (their running counts per expert)")
        self.net = net

    def forward(self, x: Tensor, k: Tensor, v: Tensor, pos: Tensor, mask: Tensor, length: int) -> Tensor:
        prefix = self.net.num_memory_tokens if length else 0
        return self.net(x, state=DecodeState.over(k, v, pos, mask, length, prefix))


class FunctionalDecodeStep(DecodeStep):
    """`DecodeStep` that leaves its inputs alone and returns the new state: forward(x, k, v, pos,
    mask, length) -> (logits, k, v, pos, mask), the state tensors updated copies of the inputs. For
    runtimes whose programs cannot write into their inputs (ONNX): feed the returned tensors to the
    next step, with length advanced as `DecodeStep` says."""

    def forward(self, x: Tensor, k: Tensor, v: Tensor, pos: Tensor, mask: Tensor,
                length: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        k, v, pos, mask = k.clone(), v.clone(), pos.clone(), mask.clone()
        return super().forward(x, k, v, pos, mask, length), k, v, pos, mask


@contextmanager
def _inference(model: nn.Module) -> Iterator[nn.Module]:
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _forward_args(model: object, owner: str, example: Tensor | None, mask: bool) -> tuple[Tensor, ...]:
    """The example inputs of a traced forward: (ids,) or (ids, an all-True mask)."""
    if not isinstance(model, TransformerWrapper):
        raise TypeError(f"{owner} exports a TransformerWrapper, got {type(model).__name__}")
    ids = example if example is not None else example_ids(model)
    return (ids, torch.ones_like(ids, dtype=torch.bool)) if mask else (ids,)


def example_ids(model: TransformerWrapper, batch: int = 2, seq: int = 8) -> Tensor:
    """Token ids (batch, seq) to trace with; seq is cut to max_seq_len for learned positions.
    Sizes of at least 2 keep a dynamic dimension from being specialised to 1."""
    n = min(seq, model.max_seq_len) if model.bounded else seq
    device = next(model.parameters()).device
    return torch.randint(0, model.num_tokens, (batch, n), device=device)


def decoder_shapes(model: TransformerWrapper, mask: bool = False, dynamic_batch: bool = True,
                   dynamic_seq: bool = True) -> tuple[dict[int, Dim], ...]:
    """`dynamic_shapes` for a forward on (ids,) or (ids, mask): batch >= 1, and seq >= 1 up to
    max_seq_len when the model has learned absolute positions (unbounded otherwise)."""
    dims: dict[int, Dim] = {}
    if dynamic_batch:
        dims[0] = Dim("batch", min=1)
    if dynamic_seq:
        dims[1] = Dim("seq", min=1, max=model.max_seq_len) if model.bounded else Dim("seq", min=1)
    return (dims, dims) if mask else (dims,)


def export_decoder(model: TransformerWrapper, example: Tensor | None = None, mask: bool = False,
                   dynamic_batch: bool = True, dynamic_seq: bool = True) -> ExportedProgram:
    """`torch.export` of `model(ids)` (or `model(ids, mask)` with mask=True) -> logits, for any
    batch size and sequence length (see `decoder_shapes`).

    Args:
        model: a `TransformerWrapper` (a Decoder or an Encoder stack).
        example: (b, n) token ids to trace with, b and n >= 2; default `example_ids(model)`.
        mask: the program also takes a (b, n) bool padding mask, True = keep.
    """
    args = _forward_args(model, "export_decoder", example, mask)
    with _inference(model):
        return torch.export.export(model, args, dynamic_shapes=decoder_shapes(model, mask, dynamic_batch, dynamic_seq))


def export_decode_step(model: TransformerWrapper, max_len: int = 8, batch: int = 2,
                       prompt: bool = False) -> ExportedProgram:
    """`torch.export` of one cached decode step (`DecodeStep`): the program's inputs are
    (x, state.k, state.v, state.pos, state.mask, state.length) of a state from
    `model.new_state(b, max_len)`, and it writes the step into that storage in place.

    With prompt=False (default) x is one token per row (b, 1) and length >= 1 is symbolic: one
    program for every step. With prompt=True x is the prompt (b, n), n symbolic, and length is 0.
    The batch size and the state's max_len are symbolic in both; `max_len` and `batch` here only
    size the example inputs.
    """
    return _export_step(DecodeStep(model), max_len, batch, prompt)   # DecodeStep refuses other models


def _export_step(step: DecodeStep, max_len: int, batch: int, prompt: bool) -> ExportedProgram:
    model = step.net
    if max_len < 4 or batch < 2:
        raise ValueError(f"a decode step is traced with max_len >= 4 and batch >= 2 (sizes 0 and 1 "
                         f"would be specialised), got max_len={max_len}, batch={batch}")
    state = model.new_state(batch, max_len)
    # every size symbolic; the trace finds how they relate (one batch, max_len >= length + n, ...)
    dyn = Dim.DYNAMIC
    storage = ({1: dyn, 3: dyn}, {1: dyn, 3: dyn}, {0: dyn, 1: dyn}, {0: dyn, 1: dyn})
    if prompt:
        x, length = example_ids(model, batch, max_len // 2), 0
        shapes = ({0: dyn, 1: dyn}, *storage, None)
    else:
        x, length = example_ids(model, batch, 1), max_len // 2
        shapes = ({0: dyn}, *storage, dyn)
    with _inference(model):
        return torch.export.export(step, (x, state.k, state.v, state.pos, state.mask, length),
                                   dynamic_shapes=shapes)


def export_onnx_decode_step(model: TransformerWrapper, path: str | os.PathLike | None = None, max_len: int = 8,
                            batch: int = 2, prompt: bool = False,
                            external_data: bool = False) -> "torch.onnx.ONNXProgram":
    """ONNX export of one cached decode step (`FunctionalDecodeStep`), for decoding with a KV cache in
    ONNX Runtime. Inputs "x", "k", "v", "pos", "mask", "length" as in `export_decode_step` (a
    state's storage from `model.new_state(b, max_len)`, numpy arrays of it); outputs "logits" and the
    updated "k_out", "v_out", "pos_out", "mask_out", which the caller passes to the next step as
    k, v, pos, mask with length advanced by the new tokens (plus `model.num_memory_tokens` after
    the prompt). prompt=True exports the prompt program instead of the one-token step: x (b, n),
    and no "length" input (it is 0). Each step returns whole copies of the state, as ONNX programs
    cannot write into their inputs. Saved to `path` when given. Needs `onnx` and `onnxscript`.
    """
    program = _export_step(FunctionalDecodeStep(model), max_len, batch, prompt)
    onnx_program = torch.onnx.export(program, dynamo=True, verbose=False,
                                     input_names=["x", "k", "v", "pos", "mask", "length"],
                                     output_names=["logits", "k_out", "v_out", "pos_out", "mask_out"])
    if path is not None:
        onnx_program.save(path, external_data=external_data)
    return onnx_program


def export_onnx(model: TransformerWrapper, path: str | os.PathLike | None = None, example: Tensor | None = None,
                mask: bool = False, dynamic_batch: bool = True, dynamic_seq: bool = True,
                external_data: bool = False) -> "torch.onnx.ONNXProgram":
    """ONNX export (the dynamo exporter) of `model(ids)` -> logits, inputs named "ids" (and
    "mask" with mask=True), output "logits", batch and sequence length dynamic as in
    `export_decoder`. Saved to `path` when given; `external_data=True` writes the weights to a
    file beside it (needed above 2 GB). Needs the `onnx` and `onnxscript` packages.
    """
    args = _forward_args(model, "export_onnx", example, mask)
    with _inference(model), warnings.catch_warnings():
        # ids and mask share their Dims on purpose; the exporter says so once per axis
        warnings.filterwarnings("ignore", message=".*will not be used, since it shares the same shape constraints")
        program = torch.onnx.export(model, args, dynamo=True, verbose=False,
                                    dynamic_shapes=decoder_shapes(model, mask, dynamic_batch, dynamic_seq),
                                    input_names=["ids", "mask"] if mask else ["ids"], output_names=["logits"])
    if path is not None:
        program.save(path, external_data=external_data)
    return program
