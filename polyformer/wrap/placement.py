"""Extra tokens placed among a forward's text tokens by the sequence wrapper: landmark tokens after every block
(landmark.py) and memory tokens before every chunk (wrap/interspersed.py). The stack runs on the longer sequence;
the text's outputs are taken back from it (`remove`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from ..memory.kv_cache import DecodeState
    from ..stack import AttentionLayers


class Placement(nn.Module):
    """A placement of extra tokens by text position; subclasses give `next_text`."""

    def next_text(self, after: Tensor) -> Tensor:
        """The stack position (b, 1) after a decode state's last one -> the text position of the next token."""
        raise NotImplementedError

    def text_positions(self, b: int, n: int, pos: Tensor | None, state: "DecodeState | None",
                       stack: "AttentionLayers", device: torch.device) -> Tensor:
        """The text positions (b, n) of n new tokens: as given, after a decode state's, or 0 .. n - 1."""
        steps = torch.arange(n, device=device)[None]
        if pos is not None:
            return pos.expand(b, n)
        if state is not None and state.length:
            return (self.next_text(stack.next_positions(1, None, state, device)) + steps).expand(b, n)
        return steps.expand(b, n)


def place(h: Tensor, mask: Tensor | None, marks: Tensor, placed: Tensor, extras: Tensor, before: bool,
          global_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, Tensor]:
    """h (b, n, dim) with the k extras (k, dim) placed before (or after) each kept token that `marks` (b, n):
    the stack's input (b, w, dim), its mask (b, w) or None, positions (b, w), global mask (b, w) or None (extras
    are not global), and each token's slot (b, n). `placed` (b, n): the tokens' stack positions; an extra sits
    at the positions next to its token's. A row with fewer extras than another is filled at its end with masked
    slots holding the row's last position."""
    b, n, dim = h.shape
    k, device = extras.shape[0], h.device
    keep = mask if mask is not None else torch.ones(b, n, dtype=torch.bool, device=device)
    marks = keep & marks
    counts = marks.sum(-1)
    extra, even = torch.stack((counts.max(), (counts == counts.max()).all().long())).tolist() if n else (0, 1)
    width = n + k * extra
    earlier = marks.long().cumsum(-1) - (0 if before else marks.long())         # marked tokens before a token's slot
    slot = torch.arange(n, device=device) + k * earlier                           # (b, n)
    offsets = torch.arange(k, device=device) + (-k if before else 1)
    beside = torch.where(marks[..., None], slot[..., None] + offsets, width).flatten(1)   # (b, n k); column w: dropped
    filler = -k - 1                       # source: a token's index, -1 - e for extra e, or a filler
    source = torch.full((b, width + 1), filler, dtype=torch.long, device=device)
    source = source.scatter(1, slot, torch.arange(n, device=device).expand(b, n))
    source = source.scatter(1, beside, (-1 - torch.arange(k, device=device)).repeat(n).expand(b, -1))[:, :width]
    positions = torch.zeros(b, width + 1, dtype=torch.long, device=device).scatter(1, slot, placed.expand(b, n))
    positions = positions.scatter(1, beside, (placed.expand(b, n)[..., None] + offsets).flatten(1))[:, :width]
    positions = torch.where(source == filler, positions.cummax(-1).values, positions)
    tokens = h.gather(1, source.clamp(min=0)[..., None].expand(-1, -1, dim))
    out = torch.where((source >= 0)[..., None], tokens, extras.to(h.dtype)[(-1 - source).clamp(0, k - 1)])
    new_mask = None
    if mask is not None or not even:
        new_mask = torch.zeros(b, width + 1, dtype=torch.bool, device=device)
        new_mask = new_mask.scatter(1, slot, keep).scatter(1, beside, True)[:, :width]
    if global_mask is not None:
        global_mask = torch.zeros(b, width + 1, dtype=torch.bool, device=device).scatter(
            1, slot, global_mask.expand(b, n))[:, :width]
    return out, new_mask, positions, global_mask, slot


def remove(out: Tensor, slots: Tensor | None) -> Tensor:
    """The stack's output (b, w, dim) at the tokens' slots (b, n): (b, n, dim)."""
    if slots is None:
        return out
    return out.gather(1, slots[..., None].expand(-1, -1, out.shape[-1]))
