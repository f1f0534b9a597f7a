"""What a forward hands to the next segment (DESIGN.md "Memories are key sources"): the
Transformer-XL memories (arXiv:1901.02860) and the compressed memories (compressive.py), per
self-attention block, oldest first. Attention sees [compressed memory, memory, segment]: the two
memories join as one key source before the segment, positions continuing backwards.

A model built without a compressed memory takes and returns today's `mems` list (a `Memories`
record is accepted too); one built with `max_cmem_len > 0` returns a `Memories` record, and so does one
with Infini-attention blocks, whose compressive memory crosses forwards in it (infini_carry.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..stack import AttentionLayers, Intermediates
    from .compressive import CompressiveMemory


@dataclass
class Memories:
    """Per self-attention block: mems (b, m, dim) the XL memory, cmems (b, cm, dim) the compressed
    memory (None: none), and their masks (b, m) / (b, cm) bool, True = keep (None: all kept). infini: per
    attn_infini block the compressive memory {"M": (b, hk, d, dv), "z": (b, hk, d)} (infini_carry.py); mems
    is then [] for a model without an XL memory."""

    mems: list[Tensor]
    cmems: list[Tensor] | None = None
    mem_masks: list[Tensor] | None = None
    cmem_masks: list[Tensor] | None = None
    infini: list[dict[str, Tensor]] | None = None

    def joined(self) -> tuple[list[Tensor], list[Tensor] | None]:
        """Per block [compressed memory, memory] along positions (b, cm + m, dim), and its mask
        (None when neither part has one)."""
        if not self.cmems:
            return list(self.mems), self.mem_masks
        mems = [torch.cat((c, m), dim=1) for c, m in zip(self.cmems, self.mems)]
        if self.mem_masks is None and self.cmem_masks is None:
            return mems, None
        none = [None] * len(mems)
        masks = [torch.cat((kept(cm, c), kept(mm, m)), dim=1)
                 for c, m, cm, mm in zip(self.cmems, self.mems, self.cmem_masks or none, self.mem_masks or none)]
        return mems, masks


def kept(mask: Tensor | None, x: Tensor) -> Tensor:
    """mask, or all kept for the positions of x (b, n, dim)."""
    return mask if mask is not None else torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)


def _check(record: Memories, layers: int, compressed: bool) -> None:
    for name in ("mems", "cmems", "mem_masks", "cmem_masks"):
        part = getattr(record, name)
        if part is not None and (not isinstance(part, (list, tuple)) or len(part) != layers):
            raise ValueError(f"Memories.{name} must be a list of {layers} tensors (one per self-attention block)")
    if record.cmems and not compressed:
        raise ValueError("mems: a Memories record with cmems was given, but the model keeps no compressed "
                         "memory (build it with max_cmem_len > 0)")
    if record.cmem_masks is not None and not record.cmems:
        raise ValueError("Memories.cmem_masks was given without cmems")
    for i, (c, m) in enumerate(zip(record.cmems or [], record.mems)):
        if not isinstance(c, Tensor) or c.ndim != 3 or c.shape[0] != m.shape[0] or c.shape[2] != m.shape[2]:
            raise ValueError(f"Memories.cmems[{i}] must be a tensor ({m.shape[0]}, cmem_len, {m.shape[2]})")


def setup(owner: str, stack: "AttentionLayers", max_mem_len: int, shift_mem_down: int, num_memory_tokens: int | None,
          cmem: tuple) -> "CompressiveMemory | None":
    """A wrapper's memory keywords checked (bad values fail by name); its compressed memory module,
    from cmem = (max_cmem_len, cmem_ratio, cmem_fn, cmem_loss_weight), or None."""
    from .. import checks
    from .compressive import setup as compressive_setup

    if max_mem_len < 0 or shift_mem_down < 0:
        raise ValueError(f"{owner}: max_mem_len and shift_mem_down must be >= 0")
    if shift_mem_down and not max_mem_len:
        raise ValueError(f"{owner}: shift_mem_down={shift_mem_down} needs max_mem_len > 0")
    checks.memories(stack, max_mem_len, owner)
    if shift_mem_down >= max(1, stack.num_self_attn):
        raise ValueError(f"{owner}: shift_mem_down must be < the number of self-attention blocks "
                         f"({stack.num_self_attn}), got {shift_mem_down}")
    if num_memory_tokens and max_mem_len:
        raise ValueError(f"{owner}: num_memory_tokens and max_mem_len cannot be combined: memory "
                         "tokens would sit between the XL memory and the segment")
    return compressive_setup(owner, stack, max_mem_len, shift_mem_down, *cmem)


def span(wrapper: object) -> int:
    """The most memory positions before a segment: max_mem_len, and with a compressed memory up to
    c - 1 states waiting to complete a group plus max_cmem_len slots."""
    cmem = wrapper.compressive
    return wrapper.max_mem_len + (cmem.ratio - 1 + cmem.max_cmem_len if cmem is not None else 0)


def attended(wrapper: object, mems: list[Tensor] | Memories | None, mem_masks: list[Tensor] | Tensor | None
             ) -> tuple[list[Tensor] | None, list[Tensor] | Tensor | None]:
    """The per-block memories (and masks) the stack attends to: a `Memories` record's two parts
    joined, then routed by shift_mem_down (layer l reads the memory layer l + s wrote)."""
    if isinstance(mems, Memories):
        if mem_masks is not None:
            raise ValueError("mem_masks cannot be given with a Memories record: its masks travel inside it")
        if not wrapper.max_mem_len:         # an Infini memory alone (infini_carry.py)
            if mems.mems or mems.cmems or mems.mem_masks or mems.cmem_masks:
                raise ValueError("mems: the Memories record holds Transformer-XL memories, but this model keeps "
                                 "none (max_mem_len=0)")
            return None, None
        _check(mems, wrapper.attn_layers.num_self_attn, wrapper.compressive is not None)
        mems, mem_masks = mems.joined()
    elif mems is not None and not wrapper.max_mem_len:
        raise ValueError("mems: a list of Transformer-XL memories needs max_mem_len > 0; this model carries an "
                         "Infini memory in the Memories record its forward returns (record.mems)")
    if mems is not None and wrapper.shift_mem_down:
        s = wrapper.shift_mem_down
        mems = list(mems[s:]) + list(mems[:s])
        if isinstance(mem_masks, (list, tuple)):
            mem_masks = list(mem_masks[s:]) + list(mem_masks[:s])
    return mems, mem_masks


def update(wrapper: object, given: list[Tensor] | Memories | None, given_masks: list[Tensor] | Tensor | None,
           seen: list[Tensor] | None, record: "Intermediates", mask: Tensor | None,
           carried: dict | None = None) -> list[Tensor] | Memories:
    """The memories for the next segment, from those given (and their `mem_masks`), those attended
    (`seen`), the blocks' inputs and the segment's mask. Without a compressed memory: per block the
    last max_mem_len of [memory as attended, this segment's block input], detached (a list). With
    one: the `compressive` module's FIFO update (a `Memories` record). With Infini blocks' `carried`
    memories (infini_carry.py): a `Memories` record holding them too."""
    if carried is not None:
        from .infini_carry import next_memories

        return next_memories(wrapper, given, given_masks, seen, record, mask, carried)
    if wrapper.compressive is None:
        return [(torch.cat((seen[i], h), dim=1) if seen is not None else h)[:, -wrapper.max_mem_len:].detach()
                for i, h in enumerate(record.mems)]
    if given is not None and not isinstance(given, Memories):
        if isinstance(given_masks, Tensor):
            given_masks = [given_masks] * len(given)
        given = Memories(list(given), mem_masks=list(given_masks) if given_masks is not None else None)
    return wrapper.compressive.update(wrapper.attn_layers, given, record.mems, mask, record.losses)
