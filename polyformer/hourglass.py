"""Hourglass (Nawrot et al. 2021, arXiv:2110.13711): a depth policy of the layer stack that runs its middle
layers on a shortened sequence.

`hourglass=(k1, k2, ...)` splits the layers into 2L + 1 segments, in the order they run (the paper writes
(2@1, 2@3, 2@1) for hourglass=3, hourglass_depths=(2, 2, 2)):

    pre_1, pre_2, ..., pre_L, middle, post_L, ..., post_1

and level l, at 1 / (k1 ... kl) of the resolution, runs

    x = pre_l(x)
    s = pool(shift_right(x, k_l - 1))       groups of k_l after a shift by k_l - 1 (an Encoder: no shift)
    s = level l + 1 (s)                     the middle layers at the last level
    x = x + upsample(s)                     the residual from before the shortening
    x = post_l(x)

The shift makes shortened token g the pool of tokens g k - k + 1 ... g k, and a position t reads the group
that ends at the last multiple of k at or before t: nothing from its future. An Encoder pools the groups
g k ... g k + k - 1 instead. Pooling is linear (the k vectors concatenated, projected to dim: the paper's
best) or their mean (hourglass_pool="average"); upsampling is linear (each shortened vector projected to k
vectors) or a repeat (hourglass_upsample="repeat"). A factor of 1 shortens nothing: its level's layers
join the next one's as a plain stack (no pooling, no upsampling, no extra residual), so hourglass=1 is
the plain stack.

hourglass_depths gives the layers per segment (a layer is the layout's repeating unit, ('a', 'f') by
default); without it depth is split evenly into the 2L + 1 segments, the remainder to the middle (depth 6
and one factor: (2, 2, 2); depth 4: (1, 2, 1)).

Any length works: each row's groups are aligned so that its first kept token after the memory tokens
(its first text token, after left padding) sits at a multiple of k; the memory tokens sit right before it
and missing neighbours are zeros, as the shift's own. Padding is zeroed before pooling and a shortened
token is kept when the last token of its group is (an Encoder's: any of them), so padding is invisible
and a left-padded row computes what it computes alone. The shortened layers see positions 0, 1, ... from
the first group holding text or memory tokens. Decoding keeps a state per resolution
(memory/hourglass_state.py): a shortened token exists once its group is complete; until then a level's
new tokens read the last complete group, which the shift makes exactly what the full forward computes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .checks import whole
from .interfaces import Context
from .memory.hourglass_state import HourglassState, alignment, at, least, most, storage
from .memory.kv_cache import StateView

if TYPE_CHECKING:
    from .config import LayersConfig
    from .stack import AttentionLayers, Intermediates


@dataclass(frozen=True)
class HourglassOptions:
    factors: tuple[int, ...]                # shortening factors, outermost first
    depths: tuple[int, ...] | None = None   # layers per segment, 2 L + 1 in the order they run; None: even split
    pool: str = "linear"                    # "linear" or "average"
    upsample: str = "linear"                # "linear" or "repeat"


def keyword(arg: Any) -> HourglassOptions | None:
    """hourglass=k or (k1, k2, ...) -> the options (None: off)."""
    if arg is None:
        return None
    factors = tuple(arg) if isinstance(arg, (list, tuple)) else (arg,)
    return HourglassOptions(factors=factors)


def segments(cfg: "LayersConfig") -> tuple[int, ...]:
    """Layers per segment: pre_1 ... pre_L, middle, post_L ... post_1."""
    h = cfg.hourglass
    if h.depths is not None:
        return tuple(h.depths)
    parts = 2 * len(h.factors) + 1
    share, rest = divmod(cfg.depth, parts)
    return tuple(share + (rest if i == parts // 2 else 0) for i in range(parts))


def problems(cfg: "LayersConfig") -> list[str]:
    """What hourglass=... cannot be or combine with, naming the keywords."""
    h = cfg.hourglass
    if h is None:
        return []
    factors = h.factors
    if not factors or any(whole(k, "hourglass") for k in factors):
        return [f"hourglass must be a shortening factor >= 1 or a sequence of them (outermost first), got {factors!r}"]
    found = []
    if h.pool not in ("linear", "average"):
        found.append(f"hourglass_pool must be 'linear' or 'average', got {h.pool!r}")
    if h.upsample not in ("linear", "repeat"):
        found.append(f"hourglass_upsample must be 'linear' or 'repeat', got {h.upsample!r}")
    parts = 2 * len(factors) + 1
    if h.depths is not None:
        d = h.depths
        if len(d) != parts or any(whole(n, "hourglass_depths", low=0) for n in d):
            found.append(f"hourglass_depths needs {parts} layer counts >= 0 for hourglass={factors!r} (pre layers of "
                         f"each level, the middle, post layers of each level), got {d!r}")
        elif sum(d) != cfg.depth:
            found.append(f"hourglass_depths={d!r} counts {sum(d)} layers; depth is {cfg.depth}")
        elif d[len(factors)] < 1:
            found.append(f"hourglass_depths={d!r}: the middle, shortened segment needs at least one layer")
    layout, depth = cfg.layout, cfg.depth
    unit = len(layout) // depth
    if len(layout) % depth or layout != layout[:unit] * depth:
        found.append(f"hourglass splits the stack into layers of one repeating unit; {cfg.layout_keyword} makes the layout "
                     f"{''.join(layout)!r}, which is not {depth} of one")
    if cfg.reversible:
        found.append("hourglass cannot combine with reversible=True: the two streams cannot pass the shortening")
    if cfg.universal:
        found.append("hourglass cannot combine with universal=True: one unit's weights cannot run at two resolutions")
    shortens = any(k > 1 for k in factors)
    if shortens and any(c.name == "local_2d" for c in cfg.attention.pattern):
        found.append("attn_local_2d lays an image of fixed size over the positions; hourglass shortens the sequence "
                     "of its middle layers, which no padding makes that image")
    return found


@dataclass(frozen=True)
class Level:
    """One resolution: the stack's blocks it runs before and after the next level (block indices), and the
    factor that shortens to the next (None at the shortest)."""

    pre: tuple[int, ...]
    post: tuple[int, ...]
    factor: int | None


def plan(cfg: "LayersConfig") -> list[Level]:
    """The resolutions, longest first; a factor of 1 merges its level into the next."""
    depths, factors = segments(cfg), cfg.hourglass.factors
    unit = len(cfg.layout) // cfg.depth
    starts = [unit * sum(depths[:i]) for i in range(len(depths) + 1)]
    blocks = [list(range(starts[i], starts[i + 1])) for i in range(len(depths))]
    levels, pre, post, last = [], [], [], len(depths) - 1
    for i, k in enumerate(factors):
        pre, post = pre + blocks[i], blocks[last - i] + post
        if k > 1:
            levels.append(Level(tuple(pre), tuple(post), k))
            pre, post = [], []
    levels.append(Level(tuple(pre + blocks[len(factors)]), tuple(post), None))
    return levels


class Resample(nn.Module):
    """Shortening by `factor` (groups (b, g, k, dim) -> (b, g, dim)) and upsampling back ((b, g, dim) ->
    (b, g k, dim))."""

    def __init__(self, dim: int, factor: int, pool: str, upsample: str):
        super().__init__()
        self.factor = factor
        self.pool = nn.Linear(factor * dim, dim) if pool == "linear" else None
        self.up = nn.Linear(dim, factor * dim) if upsample == "linear" else None

    def shorten(self, groups: Tensor) -> Tensor:
        return groups.mean(2) if self.pool is None else self.pool(groups.flatten(2))

    def expand(self, s: Tensor) -> Tensor:
        if self.up is None:
            return s.repeat_interleave(self.factor, dim=1)
        return rearrange(self.up(s), "b g (k d) -> b (g k) d", k=self.factor)


class Hourglass(nn.Module):
    """The stack's blocks run level by level (`plan`), with a `Resample` between each level and the next."""

    def __init__(self, stack: "AttentionLayers"):
        super().__init__()
        cfg = stack.cfg
        self.levels = plan(cfg)
        self.causal = cfg.causal
        self.resample = nn.ModuleList(Resample(cfg.dim, lv.factor, cfg.hourglass.pool, cfg.hourglass.upsample)
                                      for lv in self.levels if lv.factor is not None)
        index = {b: n for n, b in enumerate(i for i, block in enumerate(stack.blocks) if block.kind == "a")}
        self.layers = [{index[b]: n for n, b in enumerate(i for i in lv.pre + lv.post if i in index)}
                       for lv in self.levels]                   # per level: stack's self-attention index -> own

    def new_state(self, stack: "AttentionLayers", batch: int, max_len: int, heads: tuple[int, int, int, int],
                  dtype: torch.dtype, device: torch.device | str, history: int) -> HourglassState:
        """A state per resolution; a shorter one keeps room for every group of the longer (and history
        enough to roll back what the longer's rollback of `history` positions reaches)."""
        sizes = [max_len]
        for lv in self.levels[:-1]:
            sizes.append(sizes[-1] // lv.factor + 2)
        attention = [b.branch for b in stack.blocks if b.kind == "a"]
        state = None
        for i in reversed(range(len(self.levels))):
            kinds = tuple(attention[layer].decode_kind for layer in self.layers[i])
            state = HourglassState(kinds, batch, sizes[i], heads, total=stack.num_self_attn,
                                   factor=self.levels[i].factor, dim=stack.dim, child=state, dtype=dtype,
                                   device=device, history=history + i)
        return state

    def forward(self, stack: "AttentionLayers", x: Tensor, ctx: Context, record: "Intermediates", keep: bool,
                prefix: int) -> Tensor:
        """x (b, n, dim) -> the stream after the last block, before the final norm; with `keep`, record.hiddens
        gets every block's input and record.mems every self-attention block's (at its level's length)."""
        if ctx.mems is not None:
            raise ValueError("mems: an hourglass stack (hourglass=...) takes no Transformer-XL memories")
        if ctx.prefix_span is not None or ctx.global_mask is not None:
            raise ValueError("prefix_len / global_mask mark positions of the full sequence; an hourglass stack "
                             "(hourglass=...) shortens it: not supported")
        if ctx.state is not None and not isinstance(ctx.state, HourglassState):
            raise ValueError("state: an hourglass stack (hourglass=...) decodes with the state its new_state makes "
                             f"(one per resolution), got a {type(ctx.state).__name__}")
        prefix = ctx.state.prefix if ctx.state is not None else prefix
        return self.level(stack, 0, x, ctx, record, keep, prefix)

    def level(self, stack: "AttentionLayers", i: int, x: Tensor, ctx: Context, record: "Intermediates",
              keep: bool, prefix: int) -> Tensor:
        """Level i on its input x (b, n, dim); ctx.state is the level's own state."""
        lv = self.levels[i]
        local = ctx if ctx.state is None else replace(ctx, state=StateView(ctx.state, self.layers[i].__getitem__))
        prev: dict[str, Tensor | None] = {"a": None, "c": None}     # residual scores stay at their resolution
        x = stack.run_blocks([stack.blocks[j] for j in lv.pre], x, local, record, keep, prev)
        if lv.factor is not None:
            x = x + self.shortened(stack, i, x, ctx, record, keep, prefix)
        return stack.run_blocks([stack.blocks[j] for j in lv.post], x, local, record, keep, prev)

    def shortened(self, stack: "AttentionLayers", i: int, x: Tensor, ctx: Context, record: "Intermediates",
                  keep: bool, prefix: int) -> Tensor:
        """What level i adds to its stream x (b, n, dim) after its pre layers: the next level on the pooled
        groups, upsampled to x's positions."""
        k, resample, state = self.levels[i].factor, self.resample[i], ctx.state
        n = x.shape[1]
        start = state.length if state is not None else 0
        total = start + n
        kept = state.mask[:, :total] if state is not None else ctx.mask      # (b, total) or None
        if kept is not None:
            x = x * kept[:, start:, None].to(x.dtype)
        if state is not None:
            state.feats[:, start:total] = x
            x = state.feats[:, :total]
        first, offset = alignment(kept, prefix, total, k)
        end = most((total - 1 + offset) // k + 1)                   # groups up to the last position's
        begin = 0
        if state is not None and start:                             # redo the groups some row has not completed
            begin = min(least((start - 1 + offset) // k + 1), state.child.length)
            if state.child.length > begin:
                state.child.rollback(state.child.length - begin)
        s = None
        if end > begin:
            groups, mask, pos = self.groups(x, kept, begin, end, first, offset, prefix, k)
            inner = replace(ctx, pos=pos, mask=mask, shift_mask=mask, state=state.child if state else None, memo={})
            if state is not None:
                state.child.begin(pos, mask)
            s = self.level(stack, i + 1, resample.shorten(groups), inner, record, keep, 0)
            if state is not None:
                state.child.commit()
                state.shorts[:, begin:end] = s
        if state is None and kept is None and not prefix:           # aligned to storage
            return resample.expand(s)[:, :n]
        where = at(start, total, first, offset, prefix, x.device)   # (b|1, n) aligned indices
        if state is None:
            return self.gather(resample.expand(s), where)
        lo, hi = least(where // k), most(where // k) + 1
        return self.gather(resample.expand(state.shorts[:, lo:hi]), where - lo * k)

    def groups(self, x: Tensor, kept: Tensor | None, begin: int, end: int, first: Tensor | int,
               offset: Tensor | int, prefix: int, k: int) -> tuple[Tensor, Tensor | None, Tensor]:
        """Groups begin ... end - 1 from x (b, total, dim): (b, g, k, dim) with zeros where no kept token is,
        their keep-mask (b, g) (None: all kept) and positions (b|1, g)."""
        shift = k - 1 if self.causal else 0
        b, total, g = x.shape[0], x.shape[1], end - begin
        slots = torch.arange(begin, end, device=x.device)
        if kept is None and not prefix and begin == 0:          # aligned to storage: the paper's shift and reshape
            groups = F.pad(x, (0, 0, shift, g * k - shift - total)).view(b, g, k, -1)
            return groups, None, slots[None]
        aligned = (slots[:, None] * k + torch.arange(k, device=x.device) - shift)[None]     # (1, g, k)
        src, valid = storage(aligned, first, offset, prefix, total)
        src = src.expand(b, g, k).reshape(b, g * k)
        rows = torch.arange(b, device=x.device)[:, None]
        groups = torch.where(valid.expand(b, g, k)[..., None], x[rows, src].view(b, g, k, -1), 0.0)
        member = valid.expand(b, g, k) if kept is None else valid & kept[rows, src].view(b, g, k)
        mask = member[..., -1] if self.causal else member.any(-1)
        start = first + offset - prefix                             # the first memory or text token's group
        base = -((-start) // k) if self.causal else start // k
        base = base[:, None] if isinstance(base, Tensor) else base
        return groups, mask, (slots[None] - base).clamp(min=0)

    @staticmethod
    def gather(up: Tensor, where: Tensor) -> Tensor:
        """Rows of up (b, m, dim) at where (b|1, n) -> (b, n, dim)."""
        b = up.shape[0]
        return up[torch.arange(b, device=up.device)[:, None], where.expand(b, -1)]
