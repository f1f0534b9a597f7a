"""The landmark tokens of Landmark attention (arXiv:2305.16300, `attention/kernels/landmark.py`), placed by the
sequence wrapper: after every `landmark_block` = L tokens of a row's text comes one learned landmark
embedding (a token of its own, not of the vocabulary). The stack runs on the longer sequence; the landmarks'
outputs are dropped again, so the logits line up with the user's tokens.

Positions: the token at text position p sits at position p + p // L of the stack, the landmark after text
position p (p % L = L - 1) at the next one, so the kernel tells landmarks and blocks apart by position
alone (position P is block P // (L + 1)'s landmark when P % (L + 1) = L). Rows place their landmarks
after their own text: a left-padded row (per-row `pos`) gets its landmarks where the row alone would, and a
row with fewer landmarks than another in the same call is filled at its end with masked slots. Padding
(mask False) ends no block. A decode state holds the landmarks too: `room` is what a state needs for
max_len tokens. `max_seq_len` of learned positions counts the landmarks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .memory.kv_cache import DecodeState
    from .stack import AttentionLayers


class Landmarks(nn.Module):
    """The learned landmark embedding (dim,) and where a forward's tokens and landmarks go."""

    def __init__(self, dim: int, block: int):
        super().__init__()
        self.block = block
        self.embedding = nn.Parameter(torch.randn(dim) * 0.02)

    def text_positions(self, b: int, n: int, pos: Tensor | None, state: "DecodeState | None",
                       stack: "AttentionLayers", device: torch.device) -> Tensor:
        """The text positions (b, n) of n new tokens: as given, after a decode state's, or 0 .. n - 1."""
        steps = torch.arange(n, device=device)[None]
        if pos is not None:
            return pos.expand(b, n)
        if state is not None and state.length:
            after = stack.next_positions(1, None, state, device)       # (b, 1): never a landmark's position
            return (after - after // (self.block + 1) + steps).expand(b, n)
        return steps.expand(b, n)

    def insert(self, h: Tensor, mask: Tensor | None, pos: Tensor | None, state: "DecodeState | None",
               stack: "AttentionLayers") -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """h (b, n, dim) with the landmarks placed: (h (b, m, dim), mask (b, m) or None, positions (b, m),
        each token's slot (b, n))."""
        b, n, dim = h.shape
        size, device = self.block, h.device
        text = self.text_positions(b, n, pos, state, stack, device)
        keep = mask if mask is not None else torch.ones(b, n, dtype=torch.bool, device=device)
        ends = keep & (text % size == size - 1)                      # a landmark follows these tokens
        counts = ends.sum(-1)
        extra, even = torch.stack((counts.max(), (counts == counts.max()).all().long())).tolist() if n else (0, 1)
        width = n + extra
        slot = torch.arange(n, device=device) + ends.cumsum(-1) - ends.long()     # (b, n)
        after = torch.where(ends, slot + 1, width)                   # column `width` is dropped
        placed = text + text // size
        source = torch.full((b, width + 1), -2, dtype=torch.long, device=device)
        source = source.scatter(1, slot, torch.arange(n, device=device).expand(b, n)).scatter(1, after, -1)
        positions = torch.zeros(b, width + 1, dtype=torch.long, device=device)
        positions = positions.scatter(1, slot, placed).scatter(1, after, placed + 1)[:, :width]
        positions = positions.cummax(-1).values                      # fillers at a row's end: its last position
        source = source[:, :width]
        gathered = h.gather(1, source.clamp(min=0)[..., None].expand(-1, -1, dim))
        out = torch.where((source >= 0)[..., None], gathered, self.embedding.to(h.dtype))
        new_mask = None
        if mask is not None or not even:
            new_mask = torch.zeros(b, width + 1, dtype=torch.bool, device=device)
            new_mask = new_mask.scatter(1, slot, keep).scatter(1, after, True)[:, :width]
        return out, new_mask, positions, slot


def attach(stack: "AttentionLayers", owner: str, num_memory_tokens: int | None, max_mem_len: int) -> Landmarks | None:
    """The wrapper's landmarks when its stack runs Landmark attention (landmark_block), else None."""
    cfgs = [stack.cfg.attention, *(stack.cfg.attention_layers or ())]
    blocks = {c.kernel.options.block for c in cfgs if c.kernel.name == "landmark"}
    if not blocks:
        return None
    if len(blocks) > 1:
        raise ValueError(f"{owner}: every landmark_block of one stack must be the same (one landmark per block), "
                         f"got {sorted(blocks)}")
    for name, on in (("num_memory_tokens", num_memory_tokens), ("max_mem_len", max_mem_len)):
        if on:
            raise ValueError(f"{owner}: landmark_block cannot combine with {name}={on}: landmarks are placed by "
                             "position from the first token")
    return Landmarks(stack.dim, blocks.pop())


def insert(landmarks: Landmarks | None, h: Tensor, mask: Tensor | None, pos: Tensor | None,
           state: "DecodeState | None", stack: "AttentionLayers"
           ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """(h, mask, pos, token slots) of the stack's input: the landmarks placed, or all as given (slots None)."""
    if landmarks is None:
        return h, mask, pos, None
    return landmarks.insert(h, mask, pos, state, stack)


def remove(out: Tensor, slots: Tensor | None) -> Tensor:
    """The stack's output (b, m, dim) at the tokens' slots (b, n): (b, n, dim)."""
    if slots is None:
        return out
    return out.gather(1, slots[..., None].expand(-1, -1, out.shape[-1]))


def room(landmarks: Landmarks | None, batch: int, max_len: int) -> int:
    """Positions a decode state needs for max_len tokens: the tokens, their landmarks, and the slots that fill
    rows with fewer landmarks in a step (rows end blocks at different steps: at most one row per step)."""
    if landmarks is None:
        return max_len
    return max_len + (max_len // landmarks.block + 1) * min(batch, landmarks.block)
