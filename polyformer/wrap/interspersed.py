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

from torch import Tensor

from .. import checks
from .placement import Placement, place

if TYPE_CHECKING:
    from ..stack import AttentionLayers


class Interspersed(Placement):
    """Where the memory tokens (k, dim) go among a forward's tokens; holds no weights (they are the wrapper's
    memory_tokens)."""

    def __init__(self, every: int, count: int):
        super().__init__()
        self.every, self.count = every, count

    def placed(self, text: Tensor) -> Tensor:
        """Stack positions of text positions."""
        return text + self.count * (text // self.every + 1)

    def next_text(self, after: Tensor) -> Tensor:
        last = after - 1                                        # a text token's
        chunk = (last - self.count) // (self.every + self.count)
        return last - self.count * (chunk + 1) + 1

    def insert(self, h: Tensor, mask: Tensor | None, text: Tensor, global_mask: Tensor | None, memory: Tensor
               ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, Tensor]:
        """h (b, n, dim) at text positions (b, n), memory (k, dim) -> the stack's input (b, w, dim), its mask
        (b, w) or None, positions (b, w), global mask (b, w) or None, and each token's slot (b, n)."""
        text = text.expand(*h.shape[:2])
        return place(h, mask, text % self.every == 0, self.placed(text), memory, True, global_mask)


def build(owner: str, every: object, num_memory_tokens: int | None, stack: "AttentionLayers",
          excluded: dict[str, object]) -> Interspersed | None:
    """The placement of memory_tokens_interspersed_every, or None; `excluded`: the wrapper options it cannot
    combine with, by name (a true value refuses)."""
    if every is None:
        return None
    checks.count(every, f"{owner}: memory_tokens_interspersed_every")
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


def room(spread: Interspersed | None, batch: int, max_len: int) -> int:
    """Positions a decode state needs for max_len tokens: the tokens, their memory tokens, and the slots that
    fill rows with fewer memory tokens in a step (per m steps at most min(batch, m) rows start a chunk)."""
    if spread is None:
        return max_len
    return max_len + spread.count * (max_len // spread.every + 2) * min(batch, spread.every)
