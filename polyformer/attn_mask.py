"""x-transformers' `attn_mask`: an explicit boolean (query, key) mask over a forward's positions that every
self-attention block adds to its own pattern (causal, padding), e.g. a block-diagonal mask for packed
sequences. Cross-attention ignores it (its keys are the context, masked by `context_mask`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention.attention import Attention

if TYPE_CHECKING:
    from .stack import AttentionLayers


def _refusal(stack: "AttentionLayers") -> str | None:
    """Why this stack cannot take an attn_mask, or None."""
    if stack.hourglass is not None:
        return "an hourglass stack attends at other resolutions"
    for block in stack.blocks:
        if block.kind != "a":
            continue
        branch = block.branch
        if not isinstance(branch, Attention):
            return f"a mixer ({type(branch).__name__}) has no (query, key) scores to mask"
        if branch.direct:
            return f"the attention kernel {branch.cfg_kernel!r} computes no (query, key) scores to mask"
        if branch.pattern is not None:
            return "an attention pattern (attn_window, attn_sparse, ...) builds its own mask"
    return None


def prepare(stack: "AttentionLayers", attn_mask: object, x: Tensor, prefix: int, mems: object,
            state: object) -> Tensor:
    """attn_mask (i, j), (h, i, j) or (b, h, i, j) bool, True = may attend, over the n text positions of x
    (b, prefix + n, dim) -> (b|1, h|1, prefix + n, prefix + n): the `prefix` memory tokens see and are
    seen by every position (the causal pattern still applies on top)."""
    if not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be a bool tensor (True = may attend), got "
                        f"{getattr(attn_mask, 'dtype', type(attn_mask).__name__)}")
    if mems is not None or state is not None:
        raise ValueError("attn_mask covers one forward's own positions: it cannot combine with mems or a decode state")
    why = _refusal(stack)
    if why is not None:
        raise ValueError(f"attn_mask cannot be used here: {why}")
    b, n = x.shape[0], x.shape[1] - prefix
    heads = stack.cfg.attention.heads
    if attn_mask.ndim not in (2, 3, 4) or tuple(attn_mask.shape[-2:]) != (n, n):
        raise ValueError(f"attn_mask must have shape (i, j), (heads, i, j) or (batch, heads, i, j) with i = j = {n}, "
                         f"got {tuple(attn_mask.shape)}")
    mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
    if mask.shape[0] not in (1, b) or mask.shape[1] not in (1, heads):
        raise ValueError(f"attn_mask's batch axis must be 1 or {b} and its heads axis 1 or {heads}, "
                         f"got {tuple(attn_mask.shape)}")
    if prefix:
        mask = F.pad(mask, (prefix, 0, prefix, 0), value=True)
    return mask.to(x.device)

