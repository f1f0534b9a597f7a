"""The auxiliary-loss channel: extra losses that blocks report during a forward (routing
commitment, compressive reconstruction, ACT ponder cost, adaptive-span L1, MoE balance and z-loss),
each by name with the weight its configuration gives it. A stack collects them in the forward's
`Context`; wrappers return them in `Intermediates.losses`; `AutoregressiveWrapper` and the training
objectives add `total()` to the main loss; the trainer logs each term by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn


@dataclass
class AuxLosses:
    """Named scalar losses and their weights. Reports under one name (one per block) are summed;
    `total()` is sum(weight * value) over names."""

    terms: dict[str, Tensor] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def report(self, name: str, value: Tensor, weight: float) -> None:
        """Add a scalar `value` under `name`; every report of a name must carry the same weight."""
        if value.numel() != 1:
            raise ValueError(f"auxiliary loss {name!r} must be a scalar, got shape {tuple(value.shape)}")
        if name in self.weights and self.weights[name] != weight:
            raise ValueError(f"auxiliary loss {name!r} reported with weights {self.weights[name]} and {weight}")
        value = value.reshape(()).float()
        self.terms[name] = self.terms[name] + value if name in self.terms else value
        self.weights[name] = float(weight)

    def merge(self, other: "AuxLosses") -> "AuxLosses":
        """Add every term of `other` into this record (an encoder's losses into a seq2seq model's)."""
        for name, value in other.terms.items():
            self.report(name, value, other.weights[name])
        return self

    def total(self) -> Tensor | None:
        """sum(weight * value), or None when nothing was reported."""
        if not self.terms:
            return None
        return sum(self.weights[n] * v for n, v in self.terms.items())

    def values(self) -> dict[str, float]:
        """The unweighted terms as plain numbers, for logs."""
        return {name: float(v.detach()) for name, v in self.terms.items()}

    def __bool__(self) -> bool:
        return bool(self.terms)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={float(v.detach()):.4g} (x{self.weights[n]:g})" for n, v in self.terms.items())
        return f"AuxLosses({inner})"


def loss_names(model: nn.Module) -> tuple[str, ...]:
    """The names of the auxiliary losses a model's blocks may report, sorted: every submodule that
    reports declares them in a `loss_names` attribute (a tuple of str). A DistributedDataParallel,
    FSDP or torch.compile wrapper holds the model as a submodule, so its blocks are found too."""
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "loss_names", ())
        if isinstance(declared, tuple):
            names.update(declared)
    return tuple(sorted(names))


def forward_with_losses(model: nn.Module, *args: Any, **kwargs: Any) -> tuple[Tensor, AuxLosses]:
    """model(*args, **kwargs) -> (its output, the auxiliary losses its blocks reported). A model
    that reports none is called plainly (no intermediates kept)."""
    if not loss_names(model):
        return model(*args, **kwargs), AuxLosses()
    out, record = model(*args, return_intermediates=True, **kwargs)
    return out, record.losses


def with_aux(loss: Tensor, aux: AuxLosses) -> Tensor:
    """The main loss plus the weighted auxiliary terms."""
    total = aux.total()
    return loss if total is None else loss + total.to(loss.dtype)
