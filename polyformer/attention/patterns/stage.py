"""The pattern stage: the configured pieces (a window, global tokens, sinks, random blocks, ...)
as one rule. It yields the dense keep-mask (the reference path; a count of configurations for a
mixture) and the parts the block-sparse kernel computes, disjoint across pieces."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ...config import Choice
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
          "local_2d": Local2d, "dilated": Dilated}
KEYWORD = {"global": "attn_global_tokens", "sinks": "attn_sink_tokens", "window": "attn_window",
           "random": "attn_random_blocks", "sparse_transformer": "attn_sparse", "blockwise": "attn_blockwise",
           "block_local": "attn_block_local", "local_2d": "attn_local_2d", "dilated": "attn_dilated"}
LOCAL = {"window", "global", "sinks", "random"}         # combine freely (Longformer, BigBird, StreamingLLM)


def problems(choices: tuple[Choice, ...], heads: int, causal: bool) -> list[str]:
    """What is wrong with a pattern configuration, naming the keywords."""
    names = [c.name for c in choices]
    out = []
    for c in choices:
        out += PIECES[c.name].check(c.options, heads, causal)
    alone = [n for n in names if n not in LOCAL]
    if len(alone) > 1 or (alone and set(names) - {alone[0], "global"}):
        others = [KEYWORD[n] for n in names if n != (alone[0] if alone else None) and n != "global"]
        out.append(f"{KEYWORD[alone[0]]} cannot combine with {' / '.join(others)}: choose one pattern "
                   "(global tokens combine with any)")
    if "dilated" in names and "global" in names:
        out.append("attn_dilated mixes its configurations by their softmax denominators; it cannot combine "
                   "with attn_global_tokens")
    if "sinks" in names and ("window" not in names or not causal):
        out.append("attn_sink_tokens keeps the first tokens beside a causal window: it needs attn_window on a "
                   "Decoder")
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
        if "global" not in named and "dilated" not in named:      # the forward's global_mask needs one
            named["global"] = Choice("pattern", "global", GlobalOptions(0))
        self.pieces = [PIECES[n].build(named[n].options, heads=heads, causal=causal, layer=layer,
                                       choices=choices) for n in PIECES if n in named]
        self.names = [n for n in PIECES if n in named]
        self.mixture = any(getattr(p, "mixture", False) for p in self.pieces)
        self.heads = heads
        self.causal = causal
        self.layer_key = layer if {"random", "sparse_transformer"} & set(named) else None
        window = [p for p in self.pieces if isinstance(p, Window)]
        self.decode = "window" if (causal and window and window[0].size is not None
                                   and set(named) <= {"window", "sinks", "global"}
                                   and named["global"].options.tokens == 0) else "keys"
        self.sinks = next((p.tokens for p in self.pieces if isinstance(p, Sinks)), 0)
        self.span = window[0].span() if window else None

    def bind(self, flags: Tensor | None, shift: int, nk: int, top: int) -> None:
        """Per-forward facts: the global_mask over keys, where the queries sit among the keys, the
        key count and the largest key position."""
        for p in self.pieces:
            if isinstance(p, RandomBlocks):
                p.bind(flags, shift, nk, top)
            elif hasattr(p, "bind"):
                p.bind(flags, shift, nk)

    def active(self) -> list:
        return [p for p in self.pieces
                if not (type(p) is Global and p.tokens == 0 and p.flags is None)]

    def counts(self, q_pos: Tensor, k_pos: Tensor, shift: int) -> Tensor:
        """(z, h, i, j) int: how many times the pattern shows key j to query i (0 or 1, except in a
        mixture). q_pos (z|1, i), k_pos (z|1, j)."""
        i, j = q_pos.shape[-1], k_pos.shape[-1]
        dev = q_pos.device
        pr = Pairs(qp=q_pos[:, None, None, :, None], kp=k_pos[:, None, None, None, :],
                   qi=torch.arange(i, device=dev).view(1, 1, 1, i, 1),
                   ki=torch.arange(j, device=dev).view(1, 1, 1, 1, j),
                   head=torch.arange(self.heads, device=dev).view(-1, 1, 1, 1))
        pieces = self.active()
        if self.mixture:
            return pieces[0].counts(pr).expand(-1, self.heads, -1, -1, -1)[:, :, 0]
        seen = None
        for p in pieces:
            on = p.sees(pr)
            seen = on if seen is None else seen | on
        return seen.expand(-1, self.heads, -1, -1, -1)[:, :, 0].to(torch.int32)

    def parts(self, geo: Geometry) -> list[Part]:
        parts: list[Part] = []
        earlier: list = []
        for p in self.active():
            for part in p.parts(geo):
                if earlier and not self.mixture:
                    part = replace(part, keep=lambda pr, k=part.keep, e=tuple(earlier): k(pr) & ~_any(e, pr))
                parts.append(part)
            earlier.append(p)
        return parts


def _any(pieces: tuple, pr: Pairs) -> Tensor:
    out = pieces[0].sees(pr)
    for p in pieces[1:]:
        out = out | p.sees(pr)
    return out
