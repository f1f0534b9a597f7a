"""Memory tokens interspersed (x-transformers' memory_tokens_interspersed_every = m): the wrapper's k memory
tokens (num_memory_tokens, arXiv:2006.11527) go before every m-th token of a row's text, before text
positions 0, m, 2m, ..., not once at the front; theirs pads the text to a multiple of m and puts the tokens
before each chunk, the same sequence. Decoder only: a chunk's memory tokens see the chunks before it.

Positions: the token at text position p sits at stack position p + k (p // m + 1), the memory tokens of its
chunk (p % m = 0) at the k positions before it. Absolute position embeddings go to the text at its text
positions, none to the memory tokens. Rows place memory tokens by their own text positions: a left-padded row
(per-row `pos`) gets them where the row alone would, padding (mask False) starts no chunk, and a row with
fewer memory tokens in a call than another is filled at its end with masked slots holding its last position.
A decode state holds the memory tokens too (`room`); the text position of a state's next token comes from
its last position (always a text token's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from ..memory.kv_cache import DecodeState
    from ..stack import AttentionLayers


class Interspersed(nn.Module):
    """Where the memory tokens (k, dim) go among a forward's tokens; holds no weights (they are the wrapper's
    memory_tokens)."""

    def __init__(self, every: int, count: int):
        super().__init__()
        self.every, self.count = every, count

    def placed(self, text: Tensor) -> Tensor:
        """Stack positions of text positions."""
        return text + self.count * (text // self.every + 1)

    def text_positions(self, b: int, n: int, pos: Tensor | None, state: "DecodeState | None",
                       stack: "AttentionLayers", device: torch.device) -> Tensor:
        """The text positions (b, n) of n new tokens: as given, after a decode state's, or 0 .. n - 1."""
        steps = torch.arange(n, device=device)[None]
        if pos is not None:
            return pos.expand(b, n)
        if state is not None and state.length:
            last = stack.next_positions(1, None, state, device) - 1        # (b, 1): a text token's
            chunk = (last - self.count) // (self.every + self.count)
            return (last - self.count * (chunk + 1) + 1 + steps).expand(b, n)
        return steps.expand(b, n)

    def insert(self, h: Tensor, mask: Tensor | None, text: Tensor, global_mask: Tensor | None, memory: Tensor
               ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, Tensor]:
        """h (b, n, dim) at text positions (b, n), memory (k, dim) -> the stack's input (b, w, dim), its mask
        (b, w) or None, positions (b, w), global mask (b, w) or None, and each token's slot (b, n)."""
        b, n, dim = h.shape
        k, device = self.count, h.device
        keep = mask if mask is not None else torch.ones(b, n, dtype=torch.bool, device=device)
        text = text.expand(b, n)
        starts = keep & (text % self.every == 0)                          # k memory tokens go before these
        counts = starts.sum(-1)
        extra, even = torch.stack((counts.max(), (counts == counts.max()).all().long())).tolist() if n else (0, 1)
        width = n + k * extra
        slot = torch.arange(n, device=device) + k * starts.long().cumsum(-1)             # (b, n)
        offsets = torch.arange(k, device=device) - k
        before = torch.where(starts[..., None], slot[..., None] + offsets, width).flatten(1)   # (b, n k)
        placed = self.placed(text)
        source = torch.full((b, width + 1), -k - 1, dtype=torch.long, device=device)   # -k - 1: a filler
        source = source.scatter(1, slot, torch.arange(n, device=device).expand(b, n))
        source = source.scatter(1, before, (-1 - torch.arange(k, device=device)).repeat(n).expand(b, -1))[:, :width]
        positions = torch.zeros(b, width + 1, dtype=torch.long, device=device).scatter(1, slot, placed)
        positions = positions.scatter(1, before, (placed[..., None] + offsets).flatten(1))[:, :width]
        last = placed.max(-1, keepdim=True).values if n else positions[:, :0]
        positions = torch.where(source == -k - 1, last, positions)
        tokens = h.gather(1, source.clamp(min=0)[..., None].expand(-1, -1, dim))
        memories = memory.to(h.dtype)[(-1 - source).clamp(0, k - 1)]
        out = torch.where((source >= 0)[..., None], tokens, memories)
        new_mask = None
        if mask is not None or not even:
            new_mask = torch.zeros(b, width + 1, dtype=torch.bool, device=device)
            new_mask = new_mask.scatter(1, slot, keep).scatter(1, before, True)[:, :width]
        if global_mask is not None:
            global_mask = torch.zeros(b, width + 1, dtype=torch.bool, device=device).scatter(
                1, slot, global_mask.expand(b, n))[:, :width]
        return out, new_mask, positions, global_mask, slot


def build(owner: str, every: object, num_memory_tokens: int | None, stack: "AttentionLayers",
          excluded: dict[str, object]) -> Interspersed | None:
    """The placement of memory_tokens_interspersed_every, or None; `excluded`: the wrapper options it cannot
    combine with, by name (a true value refuses)."""
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{owner}: memory_tokens_interspersed_every must be a positive integer, got {every!r}")
    if not num_memory_tokens:
        raise ValueError(f"{owner}: memory_tokens_interspersed_every={every} places memory tokens; give "
                         "num_memory_tokens > 0")
    if not stack.causal:
        raise ValueError(f"{owner}: memory_tokens_interspersed_every needs a causal stack (a Decoder), as in "
                         "x-transformers: in an Encoder every memory token would see every chunk")
    if any(getattr(block, "shift", None) is not None for block in stack.blocks):
        raise ValueError(f"{owner}: memory_tokens_interspersed_every cannot combine with shift_tokens: decoding a "
                         "batch whose rows start chunks at different steps puts masked filler slots between a "
                         "row's tokens, and token shift reads the slot before")
    for name, value in excluded.items():
        if value:
            raise ValueError(f"{owner}: memory_tokens_interspersed_every cannot combine with {name}={value!r}: "
                             "memory tokens are placed by text position from the first token")
    return Interspersed(every, num_memory_tokens)


def remove(out: Tensor, slots: Tensor | None) -> Tensor:
    """The stack's output (b, w, dim) at the tokens' slots (b, n): (b, n, dim)."""
    if slots is None:
        return out
    return out.gather(1, slots[..., None].expand(-1, -1, out.shape[-1]))


def room(spread: Interspersed | None, batch: int, max_len: int) -> int:
    """Positions a decode state needs for max_len tokens: the tokens, their memory tokens, and the slots that
    fill rows with fewer memory tokens in a step (per m steps at most min(batch, m) rows start a chunk)."""
    if spread is None:
        return max_len
    return max_len + spread.count * (max_len // spread.every + 2) * min(batch, spread.every)
