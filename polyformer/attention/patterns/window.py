"""Sliding windows, dilated or not (Image Transformer local 1D, arXiv:1802.05751; Longformer,
arXiv:2004.05150; Mistral): causal `0 <= i - j = k d < w d`, bidirectional `|i - j| = k d <= (w // 2) d`,
with the dilation d one for all heads or one per head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ... import checks
from ...interfaces import Caps
from .layout import Geometry, Pairs, Part, residue_blocks, rule, valid

GROUP = 128     # queries per group: a group of Q queries reads Q + w - 1 keys (128 measured fastest at w = 256)


@dataclass(frozen=True)
class WindowOptions:
    size: int | None                    # w keys (causal) or w // 2 each side; None: unbounded
    dilation: int | tuple[int, ...] = 1     # one, or one per head


def dilations(opts: WindowOptions, heads: int) -> tuple[int, ...]:
    d = opts.dilation
    return tuple(d) if isinstance(d, tuple) else (d,) * heads


class Window:
    options = WindowOptions
    caps = Caps(exact=True, decode="window")

    def __init__(self, opts: WindowOptions, heads: int, causal: bool):
        self.size = opts.size
        self.causal = causal
        self.dilation = dilations(opts, heads)
        self._d = torch.tensor(self.dilation)

    @classmethod
    def build(cls, opts: WindowOptions, *, heads: int, causal: bool, layer: int = 0,
              choices: tuple = ()) -> "Window":
        return cls(opts, heads, causal)

    @staticmethod
    def check(opts: WindowOptions, heads: int, causal: bool) -> list[str]:
        if opts.size is not None and (wrong := checks.whole(opts.size, "attn_window")):
            return wrong
        if not causal and opts.size is not None and opts.size < 2:
            return [f"attn_window on a bidirectional stack sees w // 2 keys each side: it must be >= 2, got {opts.size}"]
        d = dilations(opts, heads)
        if len(d) != heads or any(not isinstance(x, int) or x < 1 for x in d):
            return [f"attn_window_dilation must be an integer >= 1 or one per head ({heads}), got {opts.dilation!r}"]
        return []

    def span(self) -> int | None:
        """How far back (in positions) a causal query can see: w d."""
        return None if self.size is None else self.size * max(self.dilation)

    def sees(self, pr: Pairs, geo: Geometry) -> Tensor:
        delta = pr.qp - pr.kp
        if max(self.dilation) == 1:
            d = 1
            on = torch.ones((), dtype=torch.bool, device=delta.device)
        else:
            d = self._d.to(pr.head.device)[pr.head]
            on = delta % d == 0
        if self.causal:
            on = on & (delta >= 0)
            return on if self.size is None else on & (delta < self.size * d)
        return on if self.size is None else on & (delta.abs() <= (self.size // 2) * d)

    def parts(self, geo: Geometry) -> list[Part]:
        parts = []
        for d in sorted(set(self.dilation)):
            heads = tuple(h for h, x in enumerate(self.dilation) if x == d)
            q = residue_blocks(geo.nq, d, min(GROUP, max(16, self.size or GROUP)), geo.device)   # (G, Q)
            first = q[:, :1] + geo.shift
            if self.size is None:           # every key of the residue class
                count = -(-geo.nk // d)
                start = first % d
            else:
                reach = self.size - 1 if self.causal else self.size // 2
                count = q.shape[1] + reach + (0 if self.causal else self.size // 2)
                start = first - reach * d
            keys = valid(start + d * torch.arange(count, device=geo.device), geo.nk)
            band = geo.shift - reach if d == 1 and self.size is not None else None
            parts.append(Part(q[None, None], keys[None, None], rule(self.sees, geo),
                              heads if len(heads) < geo.heads else None, band))
        return parts
