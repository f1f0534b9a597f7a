"""Per-layer learned absolute positions (Al-Rfou et al. 2019, arXiv:1808.04444): every self-attention
layer has its own table, and its rows at the tokens' positions are added to that layer's input.

The paper puts these tables in place of the sinusoidal timing signal of the input (section "Positional
Embeddings"), so the first layer's table is the model's input positions: a wrapper with
`abs_pos_per_layer=True` has no absolute positions of its own.

The tables are read at the stack's positions (`ctx.pos`): memory tokens first, a segment after its
Transformer-XL memories, a decode step after the cached positions, left-padded rows per row. They hold
`max_seq_len + num_memory_tokens + max_mem_len` rows (max_seq_len is randomized_pos's L when set).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from .. import checks
from ..interfaces import Context

if TYPE_CHECKING:
    from ..stack import AttentionLayers

KEYWORD = "abs_pos_per_layer"


class PerLayerPositions(nn.Module):
    """One (rows, dim) table per self-attention block; `forward(x, index, ctx)` adds block `index`'s
    rows at ctx.pos to x (b, n, dim) when that block is a self-attention block, else returns x."""

    def __init__(self, layout: tuple[str, ...], rows: int, dim: int):
        super().__init__()
        self.rows = rows
        self.table_of = {i: k for k, i in enumerate(i for i, kind in enumerate(layout) if kind == "a")}
        self.tables = nn.ModuleList(nn.Embedding(rows, dim) for _ in self.table_of)
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, x: Tensor, index: int, ctx: Context) -> Tensor:
        k = self.table_of.get(index)
        if k is None:
            return x
        if KEYWORD not in ctx.memo:              # once per forward, eagerly: every table has the same rows
            ctx.memo[KEYWORD] = True
            self.check(ctx.pos)
        return x + self.tables[k](ctx.pos).to(x.dtype)          # (b|1, n, dim) broadcast over rows

    def check(self, pos: Tensor) -> None:
        if checks.values_hidden():
            return
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0 or hi >= self.rows:
            raise ValueError(f"{KEYWORD}=True: position {lo if lo < 0 else hi} is outside the per-layer tables' "
                             f"[0, {self.rows}) (max_seq_len + num_memory_tokens + max_mem_len rows)")


def attach(stack: "AttentionLayers", on: object, owner: str, rows: int, conflicts: list[str]) -> None:
    """Give `stack` per-layer tables of `rows` rows when on is True (the wrapper keyword); refuse what
    cannot carry them by name: other absolute positions (`conflicts`, the keywords given), depth
    policies that do not run the blocks once in order, a stack with no self-attention block, a stack
    another wrapper already gave tables."""
    if not isinstance(on, bool):
        raise TypeError(f"{owner}: {KEYWORD} must be True or False, got {on!r}")
    if not on:
        return
    cfg = stack.cfg
    if any(a.position == "infused" for a in cfg.self_attention):
        conflicts = [*conflicts, "position_infused_attn"]
    if conflicts:
        raise ValueError(f"{owner}: {KEYWORD}=True gives every layer its own absolute positions, the first "
                         f"layer's in place of the input's; it cannot combine with {' / '.join(conflicts)}")
    policy = next((name for name, on in (("reversible", cfg.reversible), ("universal", cfg.universal),
                                         ("hourglass", cfg.hourglass is not None)) if on), None)
    if policy is not None:
        raise ValueError(f"{owner}: {KEYWORD}=True adds a table before each self-attention block of a plain "
                         f"stack; {policy} runs its blocks otherwise")
    if "a" not in stack.layout:
        raise ValueError(f"{owner}: {KEYWORD}=True needs self-attention blocks ('a' in the layout); the stack "
                         f"has {''.join(stack.layout)!r}")
    if stack.layer_pos is not None:
        raise ValueError(f"{owner}: attn_layers already carries per-layer positions from another wrapper")
    stack.layer_pos = PerLayerPositions(stack.layout, rows, stack.dim)
