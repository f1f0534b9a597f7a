"""Vectors in, vectors out."""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from .. import checks
from ..keywords import checked_keywords
from ..memory.kv_cache import DecodeState
from ..stack import AttentionLayers
from . import cache as cache_mod
from . import inputs, outputs
from .outputs import WrapperRecord
from .sequence import SequenceWrapper, _stack


class ContinuousTransformerWrapper(SequenceWrapper):
    """Vectors in (b, n, dim_in), vectors out (b, n, dim_out); arguments as `TransformerWrapper`
    (`post_emb_norm` normalises the projected input plus absolute positions).

    allow_nonfinite: accept NaN / inf in the input instead of refusing it.
    probabilistic: the output is a Gaussian per position: (2, b, n, dim_out) holding the mean and the variance
        (the exponential of a predicted log-variance), as x-transformers gives it; needs dim_out.
    average_pool_embed: the output is the masked average over positions, (b, dim_out).

    forward takes, besides TransformerWrapper's stack arguments, `seq_start_pos`, `sum_embeds` (b, n, dim),
    `prepend_embeds` / `prepend_mask`, `cache` and `input_not_include_cache` as TransformerWrapper does.
    """

    @checked_keywords
    def __init__(self, *, max_seq_len: int, attn_layers: AttentionLayers, dim_in: int | None = None,
                 dim_out: int | None = None, emb_dropout: float = 0.0,
                 num_memory_tokens: int | None = None, use_abs_pos_emb: bool | None = None,
                 scaled_sinu_pos_emb: bool = False, max_mem_len: int = 0, shift_mem_down: int = 0,
                 allow_nonfinite: bool = False, post_emb_norm: bool = False, abs_pos_per_layer: bool = False,
                 randomized_pos: int | None = None, probabilistic: bool = False, average_pool_embed: bool = False):
        super().__init__()
        stack = _stack(attn_layers, "ContinuousTransformerWrapper")
        dim = stack.dim
        if not isinstance(probabilistic, bool):
            raise TypeError(f"ContinuousTransformerWrapper: probabilistic must be True or False, got {probabilistic!r}")
        if probabilistic and dim_out is None:
            raise ValueError("ContinuousTransformerWrapper: probabilistic=True predicts a mean and a variance of "
                             "dim_out features each; give dim_out")
        self.dim_in = dim_in or dim
        self.probabilistic = probabilistic
        self.average_pool_embed = average_pool_embed
        self.project_in = nn.Linear(dim_in, dim) if dim_in is not None else None
        self.project_out = (nn.Linear(stack.out_dim, dim_out * (2 if probabilistic else 1))
                            if dim_out is not None else None)
        self.allow_nonfinite = allow_nonfinite
        self._setup(attn_layers=stack, max_seq_len=max_seq_len, emb_dropout=emb_dropout,
                    num_memory_tokens=num_memory_tokens, use_abs_pos_emb=use_abs_pos_emb,
                    scaled_sinu_pos_emb=scaled_sinu_pos_emb, max_mem_len=max_mem_len,
                    shift_mem_down=shift_mem_down, post_emb_norm=post_emb_norm, abs_pos_per_layer=abs_pos_per_layer,
                    randomized_pos=randomized_pos)

    def head(self, x: Tensor) -> Tensor:
        if self.project_out is None:
            return x
        out = self.project_out(x)
        if not self.probabilistic:
            return out
        mean, log_var = rearrange(out, "... (d two) -> two ... d", two=2)
        return torch.stack((mean, log_var.exp()))

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, history: int = 1) -> DecodeState:
        if self.average_pool_embed:
            raise ValueError("ContinuousTransformerWrapper: a model built with average_pool_embed gives one output "
                             "per sequence, no per-position continuation to decode")
        return super().new_state(batch, max_len, dtype, device, history)

    def forward(self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None,
                context_mask: Tensor | None = None, mems: list[Tensor] | None = None,
                mem_masks: list[Tensor] | Tensor | None = None, return_embeddings: bool = False,
                return_mems: bool = False, return_attn: bool = False,
                return_intermediates: bool = False, pos: Tensor | None = None,
                state: DecodeState | None = None, prefix_len: Tensor | int | None = None,
                global_mask: Tensor | None = None, seq_start_pos: Tensor | None = None,
                sum_embeds: Tensor | None = None, prepend_embeds: Tensor | None = None,
                prepend_mask: Tensor | None = None, cache: WrapperRecord | None = None,
                input_not_include_cache: bool = False) -> Any:
        checks.floats("x", x, 3, "(batch, seq, dim_in)")
        if x.shape[-1] != self.dim_in:
            raise ValueError(f"x has feature size {x.shape[-1]}, expected dim_in={self.dim_in}")
        if not self.allow_nonfinite:
            checks.finite("x", x)
        given = dict(mask=mask, global_mask=global_mask, sum_embeds=sum_embeds)
        if cache_mod.excludes(cache, input_not_include_cache, False):
            x, pos, given = cache_mod.joined(cache, x, pos, given)     # the record's inputs, then x
            mask, global_mask, sum_embeds = given.values()
        b, n = x.shape[:2]
        mask, pos = inputs.left_padding(seq_start_pos, mask, pos, b, n, x.device)
        given["mask"] = mask
        if cache is not None:
            out, record = cache_mod.cached(
                self, x, pos, given, dict(context=context, context_mask=context_mask, return_embeddings=return_embeddings,
                                          return_attn=return_attn, prefix_len=prefix_len),
                dict(prepend_embeds=prepend_embeds, prepend_mask=prepend_mask), cache, state)
            return (out, record) if return_intermediates else out
        self._check_common(n, b, mask, mems, return_mems, return_attn, pos, state)
        h = inputs.summed(self.project_in(x) if self.project_in is not None else x, sum_embeds)
        front = inputs.front(None, prepend_embeds, prepend_mask, b, self.attn_layers.dim)
        need = return_mems or return_attn or return_intermediates
        out, record, new_mems = self._run(h, mask, context, context_mask, mems, mem_masks, need, return_attn,
                                          pos, state, prefix_len, global_mask, front=front)
        out = outputs.pool(out, 0, self.average_pool_embed, inputs.joined_mask(front, mask, b, n, x.device))
        result = self._finish(out, record, new_mems, return_embeddings, return_mems, return_attn,
                              return_intermediates)
        if return_intermediates:
            result, record = result
            record = outputs.WrapperRecord.of(record)
            record.cache_length = n if state is None else None
            record.inputs = (x, pos, given) if state is None else None
            return result, record
        return result
