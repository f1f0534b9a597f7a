"""The attention z-loss under x-transformers' wrapper spellings: `TransformerWrapper(attn_z_loss_weight=w)`,
`forward(return_attn_z_loss=True)` (the record's `attn_z_loss`), `AutoregressiveWrapper(add_attn_z_loss=True)`.

The layer-level `attn_z_loss_weight` (scoring.py) reports the loss from every block in every forward; these ask for
it for one forward: each dense block takes its reference path, and its normaliser's input, the scores exactly as
its softmax sees them (bias, mask, soft-capping and sinks included), gives scoring.z_loss under the same name and
weight. Blocks that report it themselves (the layer keyword) are left as they are."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from torch import Tensor, nn

from .. import checks
from ..losses import AuxLosses, forward_with_losses
from .attention import Attention
from .kernels.dense import DenseKernel
from .kernels.direct import switch
from .scoring import LOSS, ScoreStage, z_loss
from .taps import recorded, tapped

if TYPE_CHECKING:
    from ..stack import AttentionLayers

DEFAULT_WEIGHT = 1e-4       # x-transformers' forward default


def check_weight(owner: str, weight: Any) -> float | None:
    if weight is not None and (not checks.number(weight) or weight < 0):
        raise ValueError(f"{owner}: attn_z_loss_weight must be a number >= 0 (or None), got {weight!r}")
    return None if weight is None else float(weight)


def _layer_weight(stack: "AttentionLayers") -> float | None:
    found = {a.scores.z_loss_weight for a in stack.cfg.self_attention if a.scores is not None}
    found.discard(0.0)
    return found.pop() if len(found) == 1 else None


def weight_of(owner: str, stack: "AttentionLayers", *given: float | None) -> float:
    """The first weight given, else the blocks' own attn_z_loss_weight, else 1e-4; one that differs from the
    blocks' own is refused (one loss, one weight)."""
    own = _layer_weight(stack)
    weight = next((w for w in given if w is not None), own if own is not None else DEFAULT_WEIGHT)
    if own is not None and weight != own:
        raise ValueError(f"{owner}: attn_z_loss_weight={weight} differs from the attention blocks' own "
                         f"attn_z_loss_weight={own}; give one")
    return weight


def _normalizers(stack: "AttentionLayers") -> list[tuple[DenseKernel, nn.Module]]:
    """(kernel, the module whose input is the softmax's scores) of every block that does not report itself."""
    found = []
    for block in stack.blocks:
        if block.kind == "f":
            continue
        attn = block.branch
        kernel = getattr(attn, "kernel", None)
        if not isinstance(attn, Attention) or not isinstance(kernel, DenseKernel):
            what = (switch("attention.kernel.", attn.cfg_kernel) if isinstance(attn, Attention)
                    else switch("mixer.", stack.cfg.mixer.name) if stack.cfg.mixer is not None
                    else type(attn).__name__)
            raise ValueError(f"the attention z-loss (attn_z_loss_weight / return_attn_z_loss / add_attn_z_loss) needs "
                             f"every attention block's score matrix; {what} forms none")
        normalize = kernel.normalize
        if isinstance(normalize, ScoreStage):
            if normalize.z_weight > 0:
                continue
            if normalize.sigmoid_bias is not None:
                raise ValueError("the attention z-loss is of a softmax's normaliser; attn_sigmoid has none")
            normalize = normalize.inner
        found.append((kernel, normalize))
    recomputed = [k for k in ("gradient_checkpointing", "reversible") if getattr(stack.cfg, k) is True]
    if found and recomputed:    # a backward's recomputation runs outside the request: another path, no taps
        raise ValueError(f"the per-forward attention z-loss cannot combine with {recomputed[0]}=True (its backward "
                         "recomputes the blocks without the request); give the stack attn_z_loss_weight instead")
    return found


def check(owner: str, stack: "AttentionLayers") -> None:
    """Refuse, when the model is built, a stack whose blocks cannot give the z-loss."""
    try:
        _normalizers(stack)
    except ValueError as err:
        raise ValueError(f"{owner}: {err}") from None


@contextmanager
def requested(stack: "AttentionLayers", weight: float) -> Iterator[AuxLosses]:
    """Within: every dense block runs its reference path and reports its z-loss into the record yielded."""
    found = AuxLosses()

    def report(module: nn.Module, args: tuple[Tensor, Tensor | None]) -> None:
        found.report(LOSS, z_loss(*args), weight)

    taps = _normalizers(stack)
    fused = [kernel.can_fuse for kernel, _ in taps]
    try:
        for kernel, _ in taps:
            kernel.can_fuse = False
        with tapped([normalize for _, normalize in taps], report, pre=True):
            yield found
    finally:
        for (kernel, _), was in zip(taps, fused):
            kernel.can_fuse = was


def returned(wrapper: nn.Module, args: dict[str, Any]) -> tuple[Any, Any]:
    """wrapper.forward(**args) with the z-loss asked for: (output, its record with `attn_z_loss`, the weighted
    sum over blocks, also in `record.losses`)."""
    args = recorded(args, "return_attn_z_loss")
    weight = weight_of(type(wrapper).__name__, wrapper.attn_layers, args.pop("attn_z_loss_weight", None),
                       wrapper.attn_z_loss_weight)
    with requested(wrapper.attn_layers, weight) as found:
        out, record = wrapper.forward(**args)
    record.losses.merge(found)
    record.attn_z_loss = record.losses.weights[LOSS] * record.losses.terms[LOSS] if LOSS in record.losses.terms \
        else None
    return out, record


def with_losses(net: nn.Module, add: bool, *args: Any, **kwargs: Any) -> tuple[Tensor, AuxLosses]:
    """AutoregressiveWrapper's forward of its net: with `add` (add_attn_z_loss), the z-loss is asked for."""
    if not add:
        return forward_with_losses(net, *args, **kwargs)
    out, record = net(*args, return_attn_z_loss=True, **kwargs)
    return out, record.losses
