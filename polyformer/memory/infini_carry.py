"""Infini-attention's compressive memory across forward calls (Munkhdalai et al. 2024, arXiv:2404.07143): the
paper reads a long input segment by segment with the memory carried along, and so do a model's forwards.

A forward's end closes its last segment (its keys join the memory); the next forward's positions restart, as
an XL forward's do, its first token starting a segment. Two forwards equal one over both when the first one's
length is a multiple of attn_infini_segment and positions cannot tell them apart: a model without positions,
or `pos` given to continue the count (with rotary positions the memory holds keys rotated at their positions
inside their forward). The carried memory is detached, so gradients stop at the forward boundary, as for
Transformer-XL memories. It travels in the `Memories` record (memories.py), `infini`: per attn_infini block,
in order, {"M": (b, hk, d, dv), "z": (b, hk, d)} (float32, or the model's wider dtype), beside any XL /
compressed memory; its size does not grow with the forwards. A stack that applies its blocks more than once
or at several lengths (universal, hourglass) keeps it inside a forward."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..attention.attention import Attention
from ..attention.kernels import infini_core as core
from ..attention.kernels.infini import Infini
from . import memories
from .memories import Memories

if TYPE_CHECKING:
    from ..stack import AttentionLayers, Intermediates
    from .kv_cache import DecodeState

Memory = dict[str, Tensor]      # "M" (b, hk, d, dv), "z" (b, hk, d)


class Carry:
    """One Infini block's memory during one forward, seen by its kernel as a decode state's `Recurrent`: the
    kernel reads `summary` (the memory the forward starts from; None: empty) and writes its summary after the
    forward's last position. A recomputation (gradient checkpointing, reversible) reads the same start."""

    wanted = 0                  # no summaries per position: a forward is not rolled back

    def __init__(self, summary: Memory | None):
        self.summary = summary
        self.final: core.Summary | None = None

    def write(self, final: core.Summary, trailing: core.Summary | None) -> None:
        self.final = final


def blocks(stack: "AttentionLayers") -> list[Attention]:
    """The stack's self-attention blocks on Infini-attention whose memory crosses forwards, in order."""
    if stack.universal is not None or stack.hourglass is not None:
        return []
    return [b.branch for b in stack.blocks
            if b.kind == "a" and isinstance(b.branch, Attention) and isinstance(b.branch.kernel, Infini)]


def carries(wrapper: object) -> bool:
    """Whether a wrapper's forwards hand memories to the next: an XL memory (max_mem_len) or an Infini one."""
    return bool(wrapper.max_mem_len) or bool(blocks(wrapper.attn_layers))


def check(given: object, attention: list[Attention], batch: int) -> None:
    """A record's Infini memory fits these blocks and `batch` rows; else a ValueError naming the part."""
    if not isinstance(given, (list, tuple)) or len(given) != len(attention):
        raise ValueError(f"Memories.infini must be a list of {len(attention)} memories, one per attn_infini block, "
                         f"got {len(given) if isinstance(given, (list, tuple)) else type(given).__name__} "
                         "(a record from another model?)")
    for i, (memory, attn) in enumerate(zip(given, attention)):
        hk, d, _, dv = attn.decode_dims
        shapes = {"M": (batch, hk, d, dv), "z": (batch, hk, d)}
        if not isinstance(memory, dict) or set(memory) != set(shapes):
            raise ValueError(f"Memories.infini[{i}] must be a dict of 'M' and 'z', got {memory!r:.80}")
        for name, shape in shapes.items():
            x = memory[name]
            if not isinstance(x, Tensor) or not x.is_floating_point() or tuple(x.shape) != shape:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"Memories.infini[{i}][{name!r}] must be a float tensor of shape {shape} (batch, "
                                 f"kv heads, ...), got {got}: a record from another model shape or batch")


def begin(wrapper: object, mems: object, need_record: bool, batch: int) -> dict[int, Carry] | None:
    """The forward's carriers by self-attention block (`Context.carried`), starting from the Infini memory of
    the `Memories` record `mems` (empty for a list or None); None when the model keeps no Infini memory or
    the forward neither takes one nor returns one (`need_record`: it returns memories or intermediates)."""
    if not need_record and not isinstance(mems, Memories):
        return None
    attention = blocks(wrapper.attn_layers)
    given = mems.infini if isinstance(mems, Memories) else None
    if given is not None and not attention:
        raise ValueError("mems: the Memories record holds an Infini memory (Memories.infini), but this model keeps "
                         "none across forwards (no attn_infini block, or a universal / hourglass stack)")
    if isinstance(mems, Memories) and given is None and attention:
        raise ValueError(f"mems: this model's {len(attention)} attn_infini block(s) carry their memory in "
                         "Memories.infini, and the record has none (a record from another model?)")
    if not attention or (given is None and not need_record):
        return None
    if given is not None:
        check(given, attention, batch)
    return {a.layer: Carry(None if given is None else dict(given[i])) for i, a in enumerate(attention)}


def collect(wrapper: object, carried: dict[int, Carry]) -> list[Memory]:
    """Each Infini block's memory after the forward, its last segment closed, detached."""
    out = []
    for attn in blocks(wrapper.attn_layers):
        carry = carried[attn.layer]
        if carry.final is None:
            raise RuntimeError(f"self-attention block {attn.layer} (attn_infini) did not run in this forward")
        out.append({name: x.detach() for name, x in core.closed(carry.final, attn.kernel.delta).items()})
    return out


def next_memories(wrapper: object, given: object, given_masks: object, seen: list[Tensor] | None,
                  record: "Intermediates", mask: Tensor | None, carried: dict[int, Carry]) -> Memories:
    """The next forward's `Memories`: the XL / compressed part as memories.update makes it (with its masks),
    and the Infini memory."""
    infini = collect(wrapper, carried)
    if not wrapper.max_mem_len:
        return Memories([], infini=infini)
    xl = memories.update(wrapper, given, given_masks, seen, record, mask)
    if isinstance(xl, Memories):
        return replace(xl, infini=infini)
    _, seen_masks = memories.attended(wrapper, given, given_masks)
    if mask is None and seen_masks is None:
        return Memories(xl, infini=infini)
    if isinstance(seen_masks, Tensor):
        seen_masks = [seen_masks] * len(xl)
    masks = []
    for i, h in enumerate(record.mems):         # as memories.update joins [memory as attended, block input]
        parts = [memories.kept(mask, h)]
        if seen is not None:
            parts.insert(0, memories.kept(seen_masks[i] if seen_masks is not None else None, seen[i]))
        masks.append(torch.cat(parts, dim=1)[:, -wrapper.max_mem_len:])
    return Memories(xl, mem_masks=masks, infini=infini)


def resume(wrapper: object, state: "DecodeState", mems: Memories) -> None:
    """Start an empty decode state from the Infini memory of the record a forward returned: cached generation
    then continues it as a next forward would (positions from 0)."""
    attention = blocks(wrapper.attn_layers)
    if not isinstance(mems, Memories) or mems.infini is None:
        raise ValueError(f"resume: mems must be a Memories record with an Infini memory, got {type(mems).__name__}")
    if mems.mems or mems.cmems:
        raise ValueError("resume: a decode state cannot hold the record's Transformer-XL / compressed memories")
    if state.length:
        raise ValueError(f"resume: the decode state must be empty, it holds {state.length} positions")
    check(mems.infini, attention, state.batch)
    for attn, memory in zip(attention, mems.infini):
        state.recurrent(attn.layer).restore([dict(memory)])
