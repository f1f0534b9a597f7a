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

from .wrap.placement import Placement, place

if TYPE_CHECKING:
    from .memory.kv_cache import DecodeState
    from .stack import AttentionLayers


class Landmarks(Placement):
    """The learned landmark embedding (dim,) and where a forward's tokens and landmarks go."""

    def __init__(self, dim: int, block: int):
        super().__init__()
        self.block = block
        self.embedding = nn.Parameter(torch.randn(dim) * 0.02)

    def next_text(self, after: Tensor) -> Tensor:
        return after - after // (self.block + 1)                # `after` is never a landmark's position

    def insert(self, h: Tensor, mask: Tensor | None, pos: Tensor | None, state: "DecodeState | None",
               stack: "AttentionLayers") -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """h (b, n, dim) with the landmarks placed: (h (b, m, dim), mask (b, m) or None, positions (b, m),
        each token's slot (b, n))."""
        size = self.block
        text = self.text_positions(*h.shape[:2], pos, state, stack, h.device)
        out, mask, positions, _, slot = place(h, mask, text % size == size - 1, text + text // size,
                                              self.embedding[None], False)
        return out, mask, positions, slot


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


def room(landmarks: Landmarks | None, batch: int, max_len: int) -> int:
    """Positions a decode state needs for max_len tokens: the tokens, their landmarks, and the slots that fill
    rows with fewer landmarks in a step (rows end blocks at different steps: at most one row per step)."""
    if landmarks is None:
        return max_len
    return max_len + (max_len // landmarks.block + 1) * min(batch, landmarks.block)
