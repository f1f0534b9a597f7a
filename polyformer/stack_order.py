"""The order blocks run in, a depth policy of the stack (x-transformers 2.x keywords):

- layers_execute_order: indices into the built blocks, run in that order, any block any number of times
  (e.g. each of 3 layers recurrent 4 times, arXiv:2405.15071). Each run of a self-attention block is a
  layer of its own wherever a stack counts them: the decode state keeps run r's keys in slot r, XL memories
  come one per run, so a cached step sees the keys an uncached forward computes.
- unet_skips: U-Net long skips (as in U-ViT, arXiv:2209.12152): of D units (the default block, e.g. 'a', 'f';
  one layer with custom_layers / par_ratio / sandwich_coef), unit D-1-k starts from W [x_k ; x], x_k the
  stream entering unit k, for k < D // 2 (W: 2 dim -> dim, no bias).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from . import checks, stack_policies
from .interfaces import Context
from .memory.kv_cache import StateView

if TYPE_CHECKING:
    from .config import LayersConfig
    from .stack import AttentionLayers, Intermediates


def unit_length(cfg: "LayersConfig") -> int:
    """Layers per unit for unet_skips: the default block's, or one with an explicit layout."""
    if cfg.custom_layers is not None or cfg.sandwich_coef or cfg.par_ratio is not None:
        return 1
    return len(cfg.layout) // cfg.depth


def problems(cfg: "LayersConfig") -> list[str]:
    """What layers_execute_order and unet_skips cannot be or combine with, naming the keywords."""
    found = checks.flag(cfg.unet_skips, "unet_skips")
    others = (("universal", "weight_tie_layers / universal=True"), ("reversible", "reversible=True"),
              ("hourglass", "hourglass"), ("early_exit", "exit_layers"), ("knn_memory", "knn_memory_layers"))
    order, n = cfg.execute_order, len(cfg.layout)
    if order is not None:
        if not order or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in order):
            found.append(f"layers_execute_order must be a non-empty sequence of block indices in [0, {n}), "
                         f"got {order!r}")
        found += [f"layers_execute_order cannot combine with {name}: it runs the blocks in its own order"
                  for field, name in others if getattr(cfg, field)]
        if any(a.kernel.name == "infini" for a in cfg.self_attention):
            found.append("layers_execute_order cannot combine with attn_infini: its memory is carried per block")
    if cfg.unet_skips is True:
        if order is not None:
            found.append("unet_skips cannot combine with layers_execute_order: the skips pair the built units")
        found += [f"unet_skips cannot combine with {name}: it runs the blocks in its own order"
                  for field, name in others if getattr(cfg, field)]
        if n // unit_length(cfg) < 2:
            found.append(f"unet_skips needs at least 2 units to pair, the layout has {n // unit_length(cfg)}")
    return found


class Loop(nn.Module):
    """Runs `stack.blocks` in layers_execute_order (else as built), with U-Net skips."""

    def __init__(self, stack: "AttentionLayers"):
        super().__init__()
        cfg, n = stack.cfg, len(stack.blocks)
        layout = [block.kind for block in stack.blocks]
        self.order = tuple(cfg.execute_order) if cfg.execute_order is not None else tuple(range(n))
        self.remap = cfg.execute_order is not None
        self.self_index = [layout[:i].count("a") for i in range(n)]    # a block's index among the 'a' blocks
        self.n_self = layout.count("a")
        runs = [i for i in self.order if layout[i] == "a"]
        self.slots = {e: r for r, e in enumerate(e for e, i in enumerate(self.order) if layout[i] == "a")}
        self.executed = tuple(self.self_index[i] for i in runs)        # each run's block, by self-attention index
        self.blocks = n
        self.unit = unit_length(cfg) if cfg.unet_skips else 0
        units = n // self.unit if self.unit else 0
        self.pairs = {(units - 1 - k) * self.unit: k for k in range(units // 2)}   # run index -> the unit it reads
        self.combines = nn.ModuleDict({str(e): nn.Linear(2 * cfg.dim, cfg.dim, bias=False) for e in self.pairs})

    def kinds(self, kinds: tuple[str, ...]) -> tuple[str, ...]:
        """The decode state's layer kinds, one per run of a self-attention block (kinds: one per built block)."""
        return tuple(kinds[i] for i in self.executed) if self.remap else kinds

    def forward(self, stack: "AttentionLayers", x: Tensor, ctx: Context, record: "Intermediates", keep: bool,
                prev: dict[str, Tensor | None]) -> Tensor:
        """x (b, n, dim) -> the stream after the last run, before the final norm."""
        saved: list[Tensor] = []
        for e, i in enumerate(self.order):
            if self.unit and e % self.unit == 0:
                saved.append(x)
                if e in self.pairs:
                    x = self.combines[str(e)](torch.cat((saved[self.pairs[e]], x), dim=-1))
            local = self.context(ctx, e, i) if self.remap else ctx
            x = stack.run_blocks((stack.blocks[i],), x, local, record, keep, prev)
        return x

    def context(self, ctx: Context, e: int, i: int) -> Context:
        """The context of run e (of block i): its slot of the decode state, its XL memory, token-shift and
        expert-count keys of its own (blocks 2 * blocks * e + i, and below)."""
        if ctx.state is None and ctx.mems is None:
            return ctx
        slot = self.slots.get(e)
        changes: dict[str, object] = {}
        if ctx.state is not None:
            changes["state"] = StateView(ctx.state, lambda layer: slot, 2 * self.blocks * e)
        if ctx.mems is not None and slot is not None:
            own = [None] * self.n_self
            own[self.self_index[i]] = ctx.mems[slot]
            changes["mems"] = own
            if ctx.mem_masks is not None:       # masks are memoised per layer: a fresh memo
                masks = [None] * len(own)
                masks[self.self_index[i]] = ctx.mem_masks[slot]
                changes.update(mem_masks=masks, memo=stack_policies.carry(ctx.memo))
        return dataclasses.replace(ctx, **changes)
