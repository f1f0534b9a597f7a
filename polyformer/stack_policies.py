"""Stack policies of x-transformers 2.x that act on the whole stack, each a small piece:

- par_ratio: the PAR Transformer's layouts (arXiv:2009.04534): self-attention only in about the first
  two thirds of the stack, one per `par_ratio` blocks, feedforwards after (`par_layout`).
- layer_dropout: stochastic depth / LayerDrop (arXiv:1909.11556): in training each block is skipped
  whole with its probability; in eval every block runs (`LayerDrop`).
- cross_attn_tokens_dropout: in training each row keeps a random ceil((1 - p) * valid) of its context
  tokens for every cross-attention block of the forward (`drop_context`).
- reinject_input: the stack input x0, projected, joins the input of every branch, h = norm(x + W x0),
  the residual stream itself untouched (as in deep equilibrium models, arXiv:1909.01377); with
  learned_reinject_input_gate, W x0 * sigmoid(w . x0) (`Reinject`).

The execution order (layers_execute_order) and U-Net skips are in stack_order.py; the value residual
(add_value_residual) in attention/value_residual.py; weight_tie_layers is universal=True (universal.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from . import checks
from .interfaces import Context

if TYPE_CHECKING:
    from .config import LayersConfig
    from .stack import AttentionLayers, Block, Intermediates

REINJECT = "reinject_input"      # ctx.memo: the projected stack input every block adds to its branch input
VALUES = "value_residual"        # ctx.memo: the first self- / cross-attention block's values, by kind


@dataclass(frozen=True)
class ReinjectOptions:
    gate: bool = False          # learned_reinject_input_gate: scale W x0 by sigmoid(w . x0) per position


def par_layout(block: tuple[str, ...], depth: int, ratio: object) -> tuple[str, ...] | None:
    """The PAR layout of `depth` default blocks `block` (e.g. ('a', 'f')), as x-transformers lays it out: of
    depth * len(block) layers, depth * len(block) // ratio attention units (block without its 'f's), each padded
    with feedforwards to a width that fits them into the first two thirds, then feedforwards. None when ratio is
    out of range (problems() says why)."""
    total = depth * len(block)
    if not isinstance(ratio, int) or isinstance(ratio, bool) or not 1 < ratio <= total:
        return None
    unit = tuple(kind for kind in block if kind != "f")
    attn = total // ratio
    cut = total * 2 // 3                    # the paper puts attention in the first two thirds of the stack
    width = (cut + cut // attn) // attn
    if len(unit) > width:
        return None
    head = (unit + ("f",) * (width - len(unit))) * attn
    return head + ("f",) * (total - len(head))


def problems(cfg: "LayersConfig") -> list[str]:
    """What par_ratio, layer_dropout, cross_attn_tokens_dropout, reinject_input cannot be or combine with."""
    from .attention import value_residual
    from . import stack_order

    found = []
    if cfg.par_ratio is not None:
        block = dataclasses.replace(cfg, depth=1, par_ratio=None, custom_layers=None, sandwich_coef=None).layout
        if "f" not in block:
            found.append("par_ratio spreads feedforward blocks over the stack; this layout has none")
        elif par_layout(block, cfg.depth, cfg.par_ratio) is None:
            found.append(f"par_ratio must be an integer in (1, {cfg.depth * len(block)}] (depth {cfg.depth} x "
                         f"{len(block)} layers) leaving room for {''.join(k for k in block if k != 'f')!r} in the "
                         f"first two thirds, got {cfg.par_ratio!r}")
        for name in ("custom_layers", "sandwich_coef", "universal"):
            if getattr(cfg, name):
                found.append(f"par_ratio lays out the blocks itself; it cannot combine with {name}"
                             + (" (weight_tie_layers)" if name == "universal" else ""))
    drops = cfg.layer_dropout if isinstance(cfg.layer_dropout, tuple) else (cfg.layer_dropout,)
    if not all(checks.number(p) and 0 <= p <= 1 for p in drops):
        found.append(f"layer_dropout must be a probability in [0, 1] or a tuple of them, got {cfg.layer_dropout!r}")
    elif isinstance(cfg.layer_dropout, tuple) and len(drops) != len(_built(cfg)):
        found.append(f"layer_dropout as a tuple needs one probability per block ({len(_built(cfg))}), "
                     f"got {len(drops)}")
    elif any(drops) and cfg.reversible:
        found.append("layer_dropout cannot combine with reversible=True: its two streams run the blocks in pairs")
    p = cfg.cross_attn_tokens_dropout
    if not (checks.number(p) and 0 <= p < 1):
        found.append(f"cross_attn_tokens_dropout must be a fraction in [0, 1), got {p!r}")
    elif p and "c" not in cfg.layout:
        found.append("cross_attn_tokens_dropout drops context tokens; the stack has no cross-attention "
                     "(cross_attend=True)")
    if cfg.reinject is not None:
        found += checks.flag(cfg.reinject.gate, "learned_reinject_input_gate")
        for name, why in (("reversible", "its backward recomputes the blocks from their outputs"),
                          ("hourglass", "its middle blocks run on a shortened sequence"),
                          ("early_exit", "an exited token's later keys are made without the blocks' inputs"),
                          ("residual_streams", "num_residual_streams > 1 gives each block a mix of streams")):
            value = getattr(cfg, name)
            if value > 1 if name == "residual_streams" else value:
                found.append(f"reinject_input cannot combine with {name}: {why}")
    return found + stack_order.problems(cfg) + value_residual.problems(cfg)


def _built(cfg: "LayersConfig") -> tuple[str, ...]:
    from .universal import unit

    return unit(cfg)


class LayerDrop:
    """Skips whole blocks of a training stack, block i with probability p[i] (drawn on the CPU generator). Not a
    module: it has no weights, and an eval stack (a fast decode step) runs as if it were absent."""

    def __init__(self, p: tuple[float, ...]):
        self.p = p

    def skips(self, block: "Block", x: Tensor, ctx: Context, record: "Intermediates", keep: bool) -> bool:
        """Whether block is skipped this time (the stack is training); a skipped self-attention block's XL memory
        is the input it would have read (its normalised x)."""
        p = self.p[block.index]
        if p == 0:
            return False
        if ctx.state is not None:
            raise ValueError("layer_dropout: a decode state in training mode would miss the keys of skipped "
                             "blocks; decode in eval mode (model.eval())")
        if torch.rand(()).item() >= p:
            return False
        if keep and block.kind == "a":
            record.mems.append(block.norm_in(x) if block.norm_in is not None else x)
        return True


class Reinject(nn.Module):
    """W x0 (no bias), gated by sigmoid(w . x0) with learned_reinject_input_gate: what every branch input adds."""

    def __init__(self, dim: int, options: ReinjectOptions):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, 1, bias=False) if options.gate else None

    def forward(self, x: Tensor) -> Tensor:
        inject = self.proj(x)
        return inject * self.gate(x).sigmoid() if self.gate is not None else inject


def drop_context(context: Tensor, mask: Tensor | None, p: float) -> tuple[Tensor, Tensor]:
    """context (b, m, d), mask (b, m) bool or None -> each row's kept tokens in their order, (b, w, d), and
    their mask (b, w): row r keeps a random ceil((1 - p) * valid_r) of its valid tokens (at least one),
    w = max(1, ceil((1 - p) * m))."""
    b, m = context.shape[:2]
    valid = mask if mask is not None else torch.ones(b, m, dtype=torch.bool, device=context.device)
    width = max(1, math.ceil((1 - p) * m))
    noise = torch.rand(b, m, device=context.device).masked_fill(~valid, 2.0)   # padding sorts last
    chosen = noise.argsort(dim=1)[:, :width]                                    # (b, w) random valid first
    counts = (valid.sum(1, keepdim=True) * (1 - p)).ceil().clamp(min=1)
    keep = torch.arange(width, device=context.device)[None] < counts            # the row's first counts of them
    keep = keep & valid.gather(1, chosen)
    order = chosen.masked_fill(~keep, m).argsort(dim=1)                         # kept ones by position, first
    chosen, keep = chosen.gather(1, order), keep.gather(1, order)
    return context.gather(1, chosen[..., None].expand(-1, -1, context.shape[-1])), keep


def attach(stack: "AttentionLayers") -> None:
    """The stack's policy pieces (built after its blocks): layer_drop, reinject, loop (stack_order.py), the
    attention blocks' value residuals; the decode state's layer count under an execution order."""
    from .attention import value_residual
    from . import stack_order

    cfg = stack.cfg
    p = cfg.layer_dropout if isinstance(cfg.layer_dropout, tuple) else (cfg.layer_dropout,) * len(stack.blocks)
    stack.layer_drop = LayerDrop(tuple(float(q) for q in p)) if any(p) else None
    stack.reinject = Reinject(cfg.dim, cfg.reinject) if cfg.reinject is not None else None
    stack.loop = stack_order.Loop(stack) if cfg.execute_order is not None or cfg.unet_skips else None
    if stack.loop is not None and cfg.execute_order is not None:
        stack.num_self_attn = len(stack.loop.slots)
    if cfg.value_residual is not None:
        value_residual.attach(stack)


def begin(stack: "AttentionLayers", x: Tensor, ctx: Context) -> Context:
    """The forward's context with the policies' parts: the reinjected input and the value residuals' holder in
    its memo; in training, the context tokens cross_attn_tokens_dropout keeps."""
    if stack.reinject is not None:
        ctx.memo[REINJECT] = stack.reinject(x)
    if stack.cfg.value_residual is not None:
        ctx.memo[VALUES] = {}
    p = stack.cfg.cross_attn_tokens_dropout
    if p and stack.training and ctx.context is not None:
        context, mask = drop_context(ctx.context, ctx.context_mask, p)
        ctx = dataclasses.replace(ctx, context=context, context_mask=mask)
    return ctx


def carry(memo: dict) -> dict:
    """A fresh memo for blocks that must not share per-layer masks (XL memory masks per application), keeping
    what the policies put there for the whole forward."""
    return {key: memo[key] for key in (REINJECT, VALUES) if key in memo}
