"""The Universal Transformer (Dehghani et al. 2019, arXiv:1807.03819): a depth policy of the layer stack
that builds one unit of blocks (the layout of a depth-1 stack, or `custom_layers`) and applies its weights
`depth` times. With ut_timestep_emb=True the 2D coordinate embedding is added to the stream before every
step t = 1, 2, ...:

    P[pos, 2j] = sin(pos / 10000^(2j/dim)) + sin(t / 10000^(2j/dim))
    P[pos, 2j + 1] = cos(pos / 10000^(2j/dim)) + cos(t / 10000^(2j/dim))

With act=True (act.py) each position takes its own number of steps, at most act_max_steps (default depth).

Each application of the unit is a layer of its own wherever a stack counts self-attention layers: a decode
state keeps application t's keys as layers t*u ... t*u + u - 1 (u self-attention blocks in the unit), and
Transformer-XL memories come one per application, so a cached step sees exactly the keys an uncached
forward computes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from . import act, checks, stack_policies
from .interfaces import Context
from .memory.kv_cache import StateView

if TYPE_CHECKING:
    from .config import LayersConfig
    from .stack import AttentionLayers, Intermediates


def unit(cfg: "LayersConfig") -> tuple[str, ...]:
    """The block kinds a stack builds: under universal=True the shared unit (the layout of the same stack at
    depth 1, or custom_layers), else its whole layout."""
    return dataclasses.replace(cfg, depth=1).layout if cfg.universal else cfg.layout


def steps(cfg: "LayersConfig") -> int:
    """How many times the unit runs at most: act_max_steps with ACT when given, else depth."""
    return cfg.act.max_steps if cfg.act is not None and cfg.act.max_steps is not None else cfg.depth


def coordinate_embedding(pos: Tensor, step: int, dim: int) -> Tensor:
    """Positions (b|1, n) and step t -> P (b|1, n, dim) in float32, the formula above."""
    freq = 10000.0 ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    at = pos.to(torch.float32)[..., None] * freq
    t = step * freq
    return torch.stack((at.sin() + t.sin(), at.cos() + t.cos()), dim=-1).flatten(-2)[..., :dim]


class Universal(nn.Module):
    """The loop over the stack's shared blocks (`stack.blocks`, one unit with `self_attn` self-attention
    blocks): `steps` applications, or ACT's halting (`halting`)."""

    def __init__(self, cfg: "LayersConfig", self_attn: int):
        super().__init__()
        self.steps = steps(cfg)
        self.self_attn = self_attn
        self.timestep = cfg.ut_timestep_emb
        self.halting = act.Halting(cfg.dim, cfg.act, self.steps) if cfg.act is not None else None

    def forward(self, stack: "AttentionLayers", x: Tensor, ctx: Context, record: "Intermediates", keep: bool) -> Tensor:
        """x (b, n, dim) -> the stream after the last step, before the final norm. With `keep` (and no ACT,
        whose steps may run on fewer rows) record.hiddens gets the stream entering every block of every
        application and record.mems each application's self-attention inputs; record.attn the weights."""
        prev: dict[str, Tensor | None] = {"a": None, "c": None}

        def step(s: Tensor, t: int, local: Context) -> Tensor:
            return self.apply(stack, s, t, local, record, keep and self.halting is None, prev)

        if self.halting is None:
            for t in range(self.steps):
                x = step(x, t, ctx)
            return x
        if ctx.mems is not None:
            raise ValueError("mems: an ACT stack (act=True) takes no Transformer-XL memories")
        if keep:
            record.hiddens.append(x)
        cfg = stack.cfg
        gather = ctx.state is None and not ctx.need_weights and not (cfg.residual_attn or cfg.cross_residual_attn)
        return self.halting(step, x, ctx, every_step=ctx.state is not None, gather=gather)

    def apply(self, stack: "AttentionLayers", x: Tensor, t: int, ctx: Context, record: "Intermediates", keep: bool,
              prev: dict[str, Tensor | None]) -> Tensor:
        """Application t (from 0) of the unit to x (b, n, dim)."""
        if self.timestep:
            x = x + coordinate_embedding(ctx.pos, t + 1, x.shape[-1]).to(x.dtype)
        return stack.run_blocks(stack.blocks, x, self.at_step(ctx, t, len(stack.blocks)), record, keep, prev)

    def at_step(self, ctx: Context, t: int, blocks: int) -> Context:
        """The context of application t: its layers of the decode state, its XL memories."""
        if ctx.state is None and ctx.mems is None:
            return ctx
        u = self.self_attn
        changes: dict[str, object] = {}
        if ctx.state is not None:
            changes["state"] = StateView(ctx.state, lambda layer: t * u + layer, t * blocks)
        if ctx.mems is not None:
            changes["mems"] = ctx.mems[t * u:(t + 1) * u]
            if ctx.mem_masks is not None:       # masks are kept per layer in the memo: a fresh one
                changes.update(mem_masks=ctx.mem_masks[t * u:(t + 1) * u], memo=stack_policies.carry(ctx.memo))
        return dataclasses.replace(ctx, **changes)


def problems(cfg: "LayersConfig") -> list[str]:
    """What universal=True, ut_timestep_emb and act cannot be or combine with, naming the keywords."""
    found = []
    for name in ("universal", "ut_timestep_emb"):
        found += checks.flag(getattr(cfg, name), name)
    if found:
        return found
    if cfg.act is not None:
        found += act.problems(cfg.act)
        if not cfg.universal:
            found.append("act=True repeats the shared blocks of universal=True until each position halts; "
                         "set universal=True")
    if not cfg.universal:
        if cfg.ut_timestep_emb:
            found.append("ut_timestep_emb=True adds the step embedding of universal=True, which is off")
        return found
    if cfg.reversible:
        found.append("reversible=True cannot combine with universal=True: its two streams run the blocks as "
                     "attention / feedforward pairs of their own")
    if cfg.residual == "deepnorm":
        found.append("deepnorm=True takes alpha and beta from depth separately initialised layers; universal=True "
                     "applies one unit's weights depth times")
    if cfg.sandwich_coef:
        found.append(f"sandwich_coef={cfg.sandwich_coef} orders the blocks over the whole depth; universal=True "
                     "repeats one unit: choose one")
    if isinstance(cfg.shift_tokens, tuple):
        found.append("shift_tokens as a tuple gives each block its own shift; universal=True shares the blocks: "
                     "give one integer")
    return found
