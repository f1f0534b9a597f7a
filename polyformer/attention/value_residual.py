"""Value residual learning (ResFormer, arXiv:2410.17897): every self-attention block after the first attends
with values mixed with the first block's, V'_n = (1 - λ) V_1 + λ V_n, λ = 1/2 in the paper; x-transformers'
learned_value_residual_mix (on by default) learns λ per position and value head, λ = sigmoid(W h + b) from the
block's normalised input h. Cross-attention blocks after the first mix with the first one's values, λ = 1/2.

The first block's values travel in the forward's memo (stack_policies.VALUES); values are mixed before a decode
state stores them, so a cached step reads the keys an uncached forward computes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor, nn

from .. import checks
from ..interfaces import KV, Context
from .keys import self_source

if TYPE_CHECKING:
    from ..config import LayersConfig
    from ..stack import AttentionLayers

VALUES = "value_residual"       # stack_policies.VALUES: the memo's holder of the first blocks' values, by kind


@dataclass(frozen=True)
class ValueResidualOptions:
    learned: bool = True        # learned_value_residual_mix: λ per position and value head (else 1/2)


def problems(cfg: "LayersConfig") -> list[str]:
    """What add_value_residual cannot combine with, naming the keywords."""
    if cfg.value_residual is None:
        return []
    found = checks.flag(cfg.value_residual.learned, "learned_value_residual_mix")
    for field, name, why in (
            ("mixer", "a mixer (attn_fnet, gau)", "has no values"),
            ("universal", "weight_tie_layers / universal=True", "the first block's weights run at every step"),
            ("reversible", "reversible=True", "its backward recomputes each block on its own"),
            ("hourglass", "hourglass", "its middle blocks run on a shortened sequence"),
            ("early_exit", "exit_layers", "an exited token's later values are made without the first block")):
        if getattr(cfg, field):
            found.append(f"add_value_residual cannot combine with {name}: {why}")
    layout, order = cfg.layout, cfg.execute_order
    if order is not None and all(isinstance(i, int) and 0 <= i < len(layout) for i in order):
        for kind in "ac":
            runs = [i for i in order if layout[i] == kind]
            if runs and (runs[0] != layout.index(kind) or runs.count(runs[0]) > 1):
                which = "self" if kind == "a" else "cross"
                found.append(f"add_value_residual with layers_execute_order: the first {which}-attention block "
                             f"(block {layout.index(kind)}) must run first of its kind, once")
    if cfg.attention_layers is not None and len({(a.kv_heads, a.dim_head) for a in cfg.attention_layers}) > 1:
        found.append("add_value_residual mixes every block's values with the first's: attn_per_layer blocks must "
                     "agree on attn_kv_heads and attn_dim_head")
    return found


class ValueResidual(nn.Module):
    """The first block of its kind keeps its values (b, hv, j, dv) for the others; a later block mixes its own
    with them, λ learned from the block input (b, i, dim) when `heads` is given, else 1/2."""

    def __init__(self, kind: str, first: bool, dim: int, heads: int | None):
        super().__init__()
        self.kind, self.first = kind, first
        self.mix = nn.Linear(dim, heads) if heads is not None else None

    def forward(self, kv: KV, x: Tensor, ctx: Context, layer: int) -> KV:
        store = ctx.memo.setdefault(VALUES, {})
        if self.first:
            store[self.kind] = kv.v
            return kv
        first = store.get(self.kind)
        if first is None or first.shape != kv.v.shape:
            got = None if first is None else tuple(first.shape)
            raise ValueError(f"add_value_residual: the first block's values {got} cannot mix with "
                             f"{tuple(kv.v.shape)} (XL memories of different lengths?)")
        if self.mix is None:
            return dataclasses.replace(kv, v=first.lerp(kv.v, 0.5))
        h = self_source(x, ctx, layer).x                                     # with this block's XL memory
        weight = self.mix(h).sigmoid().transpose(1, 2)[..., None]            # (b, hv, j, 1)
        return dataclasses.replace(kv, v=first + weight.to(kv.v.dtype) * (kv.v - first))


def attach(stack: "AttentionLayers") -> None:
    """Give each attention block of the stack its value residual stage (`branch.value_residual`)."""
    learned = stack.cfg.value_residual.learned
    seen: set[str] = set()
    for block in stack.blocks:
        if block.kind == "f":
            continue
        branch = block.branch
        first = block.kind not in seen
        seen.add(block.kind)
        heads = branch.project.v_heads if learned and block.kind == "a" and not first else None
        branch.value_residual = ValueResidual(block.kind, first, stack.cfg.dim, heads)
