"""The pattern stage: the configured pieces (a window, global tokens, sinks, random blocks, ...)
as one rule. It yields the dense keep-mask (the reference path; a count of configurations for a
mixture) and the parts the block-sparse kernel computes, disjoint across pieces."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ...config import Choice
from ...interfaces import KV
from .bigbird_blocks import BigBirdBlocks
from .blocks import BlockLocal, Blockwise, Local2d
from .globals import Global, GlobalOptions, Sinks
from .layout import Geometry, Pairs, Part
from .longnet import Dilated
from .random_blocks import RandomBlocks
from .sparse_transformer import SparseTransformer
from .window import Window

# in the order pieces take their share: earlier pieces' keys are left out of later ones
PIECES = {"global": Global, "sinks": Sinks, "window": Window, "random": RandomBlocks,
          "sparse_transformer": SparseTransformer, "blockwise": Blockwise, "block_local": BlockLocal,
          "local_2d": Local2d, "dilated": Dilated, "bigbird_blocks": BigBirdBlocks}
LOCAL = {"window", "global", "sinks", "random"}         # combine freely (Longformer, BigBird, StreamingLLM)


def keyword(name: str) -> str:
    """The public keyword that switches piece `name` on: the keyword table's first row writing its
    options (`attn_window` for "window", `attn_global_tokens` for "global", ...)."""
    from ...keywords import writing

    return writing(f"attention.pattern.{name}", below=True)[0]


def takes_global_mask(choices: tuple[Choice, ...]) -> bool:
    """Whether a forward's global_mask applies: any pattern but the mixtures (LongNet, BigBird's blocks)."""
    return bool(choices) and all(c.name not in ("dilated", "bigbird_blocks") for c in choices)


def problems(choices: tuple[Choice, ...], heads: int, causal: bool) -> list[str]:
    """What is wrong with a pattern configuration, naming the keywords."""
    names = [c.name for c in choices]
    out = []
    for c in choices:
        caps = PIECES[c.name].caps           # declared: what each piece can run in
        if causal and not caps.causal:
            out.append(f"{keyword(c.name)} lets queries see later keys: it cannot be causal (causal=True, a "
                       "Decoder); use it on an Encoder")
        if not causal and not caps.bidirectional:
            out.append(f"{keyword(c.name)} needs a causal stack (a Decoder)")
        out += PIECES[c.name].check(c.options, heads, causal)
    alone = [n for n in names if n not in LOCAL]
    if len(alone) > 1 or (alone and set(names) - {alone[0], "global"}):
        others = [keyword(n) for n in names if n != (alone[0] if alone else None) and n != "global"]
        out.append(f"{keyword(alone[0])} cannot combine with {' / '.join(others)}: choose one pattern "
                   "(global tokens combine with any)")
    if "dilated" in names and "global" in names:
        out.append("attn_dilated mixes its configurations by their softmax denominators; it cannot combine "
                   "with attn_global_tokens")
    if "bigbird_blocks" in names and "global" in names:
        out.append("attn_bigbird_blocks has its own global blocks (the first and the last); it cannot combine "
                   "with attn_global_tokens")
    if "sinks" in names and "window" not in names:
        out.append("attn_sink_tokens keeps the first tokens beside a window: it needs attn_window")
    return out


def own_projections(choices: tuple[Choice, ...]) -> int | None:
    """The global token count when global rows take their own projections (Longformer), else None."""
    for c in choices:
        if c.name == "global" and c.options.projections:
            return c.options.tokens
    return None


class PatternStage:
    """Which keys each query sees. Built per attention block: random blocks depend on the layer,
    and 'alternate' Sparse Transformer layers on its parity."""

    def __init__(self, choices: tuple[Choice, ...], heads: int, causal: bool, layer: int):
        named = {c.name: c for c in choices}
        if "global" not in named and takes_global_mask(choices):   # the forward's global_mask needs one
            named["global"] = Choice("pattern", "global", GlobalOptions(0))
        self.pieces = [PIECES[n].build(named[n].options, heads=heads, causal=causal, layer=layer,
                                       choices=choices) for n in PIECES if n in named]
        self.names = [n for n in PIECES if n in named]
        self.mixture = any(getattr(p, "mixture", False) for p in self.pieces)
        self.heads = heads
        self.causal = causal
        # blocks of one pattern share its block-sparse parts in a forward (per-layer patterns differ: attn_per_layer)
        self.layer_key = (repr(choices), heads, layer if {"random", "sparse_transformer"} & set(named) else None)
        window = [p for p in self.pieces if isinstance(p, Window)]
        self.sinks = next((p.tokens for p in self.pieces if isinstance(p, Sinks)), 0)
        self.span = window[0].span() if window else None
        # what a decode state keeps, from the pieces' declared caps (the implicit, empty global piece aside)
        shown = [p for p in self.pieces if not (type(p) is Global and p.tokens == 0)]
        self.decode = ("window" if causal and self.span is not None and all(p.caps.decode == "window" for p in shown)
                       else "keys")

    def geometry(self, q_pos: Tensor, k_pos: Tensor, k_mask: Tensor | None, flags: Tensor | None) -> Geometry:
        return Geometry.of(q_pos, k_pos, k_mask, self.causal, self.heads, flags)

    def active(self, geo: Geometry) -> list:
        """The pieces that show anything in this forward (global tokens only with some to show)."""
        return [p for p in self.pieces if not isinstance(p, Global) or p.active(geo)]

    def visible(self, counts: Tensor, kv: KV) -> Tensor:
        """(z, h, i, free + j) bool from `counts`: the keys each query may see: shown by the pattern and
        not padding; kv's `free` leading keys (persistent memory) by every query."""
        keep = counts > 0
        if kv.mask is not None:
            keep = keep & kv.mask[:, None, None, :]
        return F.pad(keep, (kv.free, 0), value=True) if kv.free else keep

    def counts(self, geo: Geometry) -> Tensor:
        """(z, h, i, j) int: how many times the pattern shows key j to query i (0 or 1, except in a
        mixture), read from positions alone."""
        i, j, dev = geo.nq, geo.nk, geo.device
        pr = Pairs(qp=geo.q_pos[:, None, None, :, None], kp=geo.k_pos[:, None, None, None, :],
                   qi=torch.arange(i, device=dev).view(1, 1, 1, i, 1),
                   ki=torch.arange(j, device=dev).view(1, 1, 1, 1, j),
                   head=torch.arange(self.heads, device=dev).view(-1, 1, 1, 1))
        pieces = self.active(geo)
        if self.mixture:
            return pieces[0].counts(pr, geo).expand(-1, self.heads, -1, -1, -1)[:, :, 0]
        return _any(pieces, pr, geo).expand(-1, self.heads, -1, -1, -1)[:, :, 0].to(torch.int32)

    def parts(self, geo: Geometry) -> list[Part]:
        """The block-sparse kernel's parts (the geometry must be one run: `geo.run`)."""
        parts: list[Part] = []
        earlier: list = []
        for p in self.active(geo):
            for part in p.parts(geo):
                if earlier and not self.mixture:
                    part = replace(part, keep=lambda pr, k=part.keep, e=tuple(earlier): k(pr) & ~_any(e, pr, geo))
                parts.append(part)
            earlier.append(p)
        return parts


def _any(pieces: list | tuple, pr: Pairs, geo: Geometry) -> Tensor:
    out = pieces[0].sees(pr, geo)
    for p in pieces[1:]:
        out = out | p.sees(pr, geo)
    return out
