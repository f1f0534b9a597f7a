"""The base of the sequence wrappers: embed -> absolute positions -> post-embedding norm -> dropout ->
memory tokens -> stack -> head, with XL memories."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks, landmark
from ..embedding import AxialPositions, LearnedPositions, MemoryTokens
from ..memory import infini_carry, memories
from ..memory.kv_cache import DecodeState
from ..position import wrapper_positions
from ..registry import NORM
from ..stack import AttentionLayers, Intermediates
from . import interspersed as spread
from . import inputs, placement


def _stack(attn_layers: object, owner: str) -> AttentionLayers:
    if not isinstance(attn_layers, AttentionLayers):
        raise TypeError(f"{owner}: attn_layers must be an Encoder, Decoder or AttentionLayers, "
                        f"got {type(attn_layers).__name__}")
    return attn_layers


class SequenceWrapper(nn.Module):
    """embed -> absolute positions -> post-embedding norm -> dropout -> memory tokens -> stack -> head,
    with XL memories.

    Subclasses supply `embed(x)` (b, n, dim) and `head(x)`.
    """

    def _setup(self, *, attn_layers: AttentionLayers, max_seq_len: int, emb_dropout: float,
               num_memory_tokens: int | None, use_abs_pos_emb: bool | None, scaled_sinu_pos_emb: bool,
               max_mem_len: int, shift_mem_down: int, post_emb_norm: bool = False,
               post_emb_proj: bool = False, axial_pos_emb: object = None, axial_pos_emb_dims: object = None,
               abs_pos_per_layer: object = False, randomized_pos: object = None, cmem: tuple = (0,),
               interspersed_every: object = None) -> None:
        owner = type(self).__name__
        self.attn_layers = _stack(attn_layers, owner)
        dim = self.attn_layers.dim
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"{owner}: max_seq_len must be a positive integer, got {max_seq_len!r}")
        if not 0 <= emb_dropout < 1:
            raise ValueError(f"{owner}: emb_dropout must be in [0, 1), got {emb_dropout}")
        self.max_mem_len = max_mem_len
        self.shift_mem_down = shift_mem_down        # checked with the compressed memory's keywords (memory/memories.py)
        self.compressive = memories.setup(owner, self.attn_layers, max_mem_len, shift_mem_down, num_memory_tokens,
                                          cmem)
        self.randomized_pos = randomized_pos        # max_seq_len becomes its L (position/randomized.py)
        self.pos_emb, self.max_seq_len = wrapper_positions.setup(
            self.attn_layers, owner, max_seq_len, use_abs_pos_emb, scaled_sinu_pos_emb, axial_pos_emb,
            axial_pos_emb_dims, abs_pos_per_layer, randomized_pos, memories.span(self), num_memory_tokens or 0)
        self.post_emb_norm = None
        if post_emb_norm:                 # the stack's own norm and eps (BERT: LayerNorm, eps 1e-12)
            cfg = self.attn_layers.cfg
            if NORM[cfg.norm].build is None:
                raise ValueError(f"{owner}: post_emb_norm=True uses the stack's norm, and use_rezero=True "
                                 "leaves the stack without one")
            self.post_emb_norm = NORM[cfg.norm].build(dim, cfg.norm_eps)
        if not isinstance(post_emb_proj, bool):
            raise TypeError(f"{owner}: post_emb_proj must be True or False, got {post_emb_proj!r}")
        self.post_emb_proj = nn.Linear(dim, dim) if post_emb_proj else None
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.memory_tokens = MemoryTokens(num_memory_tokens, dim) if num_memory_tokens else None
        self.landmarks = landmark.attach(self.attn_layers, owner, num_memory_tokens, max_mem_len)
        self.interspersed = spread.build(owner, interspersed_every, num_memory_tokens, self.attn_layers,
                                         {"abs_pos_per_layer": abs_pos_per_layer})   # XL memories: memories.setup

    @property
    def bounded(self) -> bool:
        """Whether sequences are limited to max_seq_len (learned, axial or per-layer absolute positions)."""
        return isinstance(self.pos_emb, (LearnedPositions, AxialPositions)) or self.attn_layers.layer_pos is not None

    def _check_common(self, n: int, b: int, mask: Tensor | None, mems: list[Tensor] | None,
                      return_mems: bool, return_attn: bool, pos: Tensor | None,
                      state: DecodeState | None) -> None:
        if mask is not None:
            checks.bool_mask("mask", mask, (b, n), "(batch, seq)")
        if pos is not None:
            pos = checks.tensor("pos", pos)
            if pos.ndim != 2 or pos.shape[1] != n or pos.shape[0] not in (1, b) or pos.dtype.is_floating_point:
                raise ValueError(f"pos must be integer positions of shape (batch or 1, {n}), got "
                                 f"{tuple(pos.shape)} {pos.dtype}")
        if mems is not None and not isinstance(mems, (list, tuple, memories.Memories)):
            raise ValueError("mems must be a list of tensors (one per self-attention block), got "
                             f"{type(mems).__name__}")
        if (mems is not None or return_mems) and not infini_carry.carries(self):
            raise ValueError(f"{type(self).__name__}: mems / return_mems need a model built with max_mem_len > 0 "
                             "(or attn_infini blocks, not in a universal / hourglass stack)")
        if return_mems and return_attn:
            raise ValueError("return_mems and return_attn cannot both be set: use return_intermediates=True")
        if state is not None and (mems is not None or return_mems):
            raise ValueError("state cannot be combined with mems / return_mems")

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, history: int = 1) -> DecodeState:
        """A decode state (KV cache) with room for max_len tokens of `batch` sequences; blocks with a
        recurrent summary keep it after each of the last `history` positions (for rollback)."""
        max_len = landmark.room(self.landmarks, batch, max_len)      # with room for the landmarks (landmark.py)
        max_len = spread.room(self.interspersed, batch, max_len)     # and interspersed memory tokens
        return self.attn_layers.new_state(batch, max_len + self.num_memory_tokens, dtype, device, history)

    @property
    def num_memory_tokens(self) -> int:
        return self.memory_tokens.tokens.shape[0] if self.memory_tokens is not None else 0

    def add_positions(self, h: Tensor, tok_pos: Tensor, emb_frac_gradient: float = 1.0) -> Tensor:
        """Embeddings h (b, n, dim) at token positions tok_pos (b|1, n): plus the absolute
        positions, then the post-embedding norm, projection, the gradient fraction and dropout."""
        if self.pos_emb is not None:
            h = h + self.pos_emb(tok_pos).to(h.dtype)
        if self.post_emb_norm is not None:
            h = self.post_emb_norm(h)
        if self.post_emb_proj is not None:
            h = self.post_emb_proj(h)
        return self.emb_dropout(inputs.shrink_gradient(h, emb_frac_gradient))

    def _run(self, h: Tensor, mask: Tensor | None, context: Tensor | None, context_mask: Tensor | None,
             mems: list[Tensor] | None, mem_masks: list[Tensor] | Tensor | None, need_record: bool,
             return_attn: bool, pos: Tensor | None = None, state: DecodeState | None = None,
             prefix_len: Tensor | int | None = None, global_mask: Tensor | None = None,
             knn_clear: Tensor | None = None, attn_mask: Tensor | None = None, front: inputs.Front | None = None
             ) -> tuple[Tensor, Intermediates | None, list[Tensor] | memories.Memories | None]:
        seen, seen_masks = memories.attended(self, mems, mem_masks)     # [compressed, XL] memory, shift_mem_down
        carried = infini_carry.begin(self, mems, need_record and state is None, h.shape[0])   # Infini memories
        h, mask, pos, slots = landmark.insert(self.landmarks, h, mask, pos, state, self.attn_layers)
        if self.interspersed is not None:         # memory tokens every m tokens (wrap/interspersed.py)
            pos = self.interspersed.text_positions(*h.shape[:2], pos, state, self.attn_layers, h.device)
        tok_pos = wrapper_positions.token_positions(self, h, pos, state)
        h = self.add_positions(h, tok_pos)
        if front is not None:             # class tokens, prepended embeddings (wrap/inputs.py)
            h, mask, tok_pos = inputs.fronted(front, h, mask, tok_pos)
            self._check_front(state, slots)
            global_mask = F.pad(global_mask, (front.h.shape[1], 0), value=False) if global_mask is not None else None
        stack_pos = tok_pos + self.num_memory_tokens + (seen[0].shape[1] if seen else 0)
        prefix = self.memory_tokens is not None and self.interspersed is None and (state is None or state.length == 0)
        spots = None
        if self.interspersed is not None:
            if global_mask is not None:
                checks.bool_mask("global_mask", global_mask, tuple(h.shape[:2]), "(batch, seq)")
            h, mask, stack_pos, global_mask, spots = self.interspersed.insert(h, mask, tok_pos, global_mask,
                                                                            self.memory_tokens.tokens)
        if prefix:
            if global_mask is not None:
                checks.bool_mask("global_mask", global_mask, tuple(h.shape[:2]), "(batch, seq)")
                global_mask = F.pad(global_mask, (self.num_memory_tokens, 0), value=False)
            h, mask = self.memory_tokens(h, mask)
            first = torch.arange(self.num_memory_tokens, device=h.device)[None]
            stack_pos = torch.cat((first.expand(stack_pos.shape[0], -1), stack_pos), dim=1)
        out = self.attn_layers(h, mask=mask, context=context, context_mask=context_mask, mems=seen,
                               mem_masks=seen_masks, pos=stack_pos, state=state,
                               prefix=self.num_memory_tokens if prefix else 0, prefix_len=prefix_len,
                               global_mask=global_mask, return_attn=return_attn,
                               return_intermediates=need_record, knn_clear=knn_clear, carried=carried,
                               attn_mask=attn_mask)
        record = None
        if need_record:
            out, record = out
        if prefix:
            out = out[:, self.num_memory_tokens:]
        new_mems = None
        if (self.max_mem_len or carried is not None) and record is not None:
            new_mems = memories.update(self, mems, mem_masks, seen, record, mask, carried)
        return placement.remove(placement.remove(out, spots), slots), record, new_mems

    def _check_front(self, state: DecodeState | None, slots: object) -> None:
        """Front embeddings take no absolute position (the text's are added before them, from 0, as
        x-transformers adds them), so they do not count against max_seq_len."""
        if state is not None and state.length:
            raise ValueError("prepend_embeds and class tokens (use_cls_token) go in front of a decode state's first step, "
                             "not a later one")
        if slots is not None:
            raise ValueError("prepend_embeds and class tokens (use_cls_token) cannot be combined with landmark attention")
        if self.interspersed is not None:
            raise ValueError("prepend_embeds and class tokens (use_cls_token) cannot be combined with "
                             "memory_tokens_interspersed_every")

    def _finish(self, out: Tensor, record: Intermediates | None, new_mems: list[Tensor] | None,
                return_embeddings: bool, return_mems: bool, return_attn: bool,
                return_intermediates: bool) -> Any:
        result = out if return_embeddings else self.head(out)
        if return_intermediates:
            record.mems = new_mems if new_mems is not None else record.mems
            return result, record
        if return_mems:
            return result, new_mems
        if return_attn:
            return result, record.attn
        return result
