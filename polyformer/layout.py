"""Weight layout for decoding one sequence at a time on a CPU.

At batch 1 every linear layer is a matrix-vector product that streams its weight from memory once
per token, and how fast the BLAS streams it depends on the layout. `nn.Linear` keeps its weight
output-major, (out, in) in memory; on this project's CPU (AMD EPYC, MKL, one thread) the product
runs about 1.4x faster on the expanding matrices (q|k|v, the feedforward's first layer) when the
weight is input-major, (in, out) in memory - the layout GPT-2's Conv1D keeps - while the shrinking
ones are faster as they are (`benchmarks/generation.py` measures both).

    input_major(model)            # in place; returns the model

changes only the memory layout: each weight keeps its shape (out, in), its values and its
Parameter object (a transposed-contiguous tensor, strides (1, out)), so the state dict,
checkpoints, tied weights, training and Hugging Face export see the same model; the products differ
from the output-major ones only by float rounding (a different summation order).
"""

from __future__ import annotations

import torch
from torch import nn


def is_input_major(weight: torch.Tensor) -> bool:
    """Whether a 2-d (out, in) weight is stored input-major (its transpose is contiguous)."""
    return weight.ndim == 2 and weight.t().is_contiguous() and not weight.is_contiguous()


def linear_layers(model: nn.Module, skip: tuple[str, ...] = ()) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every `nn.Linear` of `model` not named in `skip` (names as in
    `named_modules`); an unknown name in `skip` is refused. Shared by `input_major` and
    `quantize_int8`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    names = {name for name, _ in model.named_modules()}
    unknown = [s for s in skip if s not in names]
    if unknown:
        raise ValueError(f"skip: no module named {unknown} in the model")
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in skip]


def input_major(model: nn.Module, only_expanding: bool = True, skip: tuple[str, ...] = ()) -> nn.Module:
    """Re-lay every `nn.Linear` weight of `model` input-major, in place (see the module docstring).

    Args:
        only_expanding: only the layers with more outputs than inputs (the ones that gain on a CPU);
            False: every linear layer.
        skip: module names (as in `named_modules`) to leave as they are.

    Returns the model. A weight shared with another module (a tied head) is left as it is, so the
    embedding that shares it keeps its layout.
    """
    targets = linear_layers(model, skip)
    users: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    for name, m in targets:
        if users[id(m.weight)] > 1:
            continue
        if only_expanding and m.out_features <= m.in_features:
            continue
        if is_input_major(m.weight) or m.out_features == 1 or m.in_features == 1:
            continue                                  # already input-major, or both layouts are one
        with torch.no_grad():
            m.weight.data = m.weight.data.t().contiguous().t()
    return model
