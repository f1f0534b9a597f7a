"""Prompts as generation takes them: a (b, n) batch, one (n,) prompt, a list of (n_i,) prompts of
different lengths, or a right-padded batch with `prompt_lens` (x-transformers' forms). All become one
left-padded (b, n) batch with a keep-mask, which the decoders already take."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def left_aligned(prompts: Tensor, lens: Tensor, pad_value: int) -> tuple[Tensor, Tensor]:
    """Right-padded prompts (b, n) holding lens (b,) tokens each -> (the same tokens moved to the
    right end with `pad_value` before them (b, n), keep-mask (b, n))."""
    n = prompts.shape[1]
    source = torch.arange(n, device=prompts.device) + lens[:, None] - n       # (b, n): where each slot reads
    keep = source >= 0
    moved = prompts.gather(1, source.clamp(min=0)).masked_fill(~keep, pad_value)
    return moved, keep


def batch_prompts(prompts: Tensor | list[Tensor] | tuple[Tensor, ...], mask: Tensor | None,
                  prompt_lens: Tensor | None, pad_value: int) -> tuple[Tensor, Tensor | None, bool]:
    """-> (prompts (b, n), mask (b, n) or None, whether the caller gave one unbatched (n,) prompt).

    A list of 1-D prompts, or `prompt_lens` (b,) with right-padded prompts, becomes a left-padded
    batch and its mask (None when no row is padded)."""
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is an empty list")
        if mask is not None or prompt_lens is not None:
            raise ValueError("prompts given as a list carry their own lengths; do not pass mask or prompt_lens")
        for i, p in enumerate(prompts):
            if not isinstance(p, Tensor) or p.ndim != 1 or p.numel() == 0:
                got = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
                raise ValueError(f"prompts[{i}] must be a non-empty 1-D tensor of token ids, got {got}")
        n = max(p.shape[0] for p in prompts)
        lens = torch.tensor([p.shape[0] for p in prompts], device=prompts[0].device)
        prompts = torch.stack([F.pad(p.to(prompts[0].device), (0, n - p.shape[0]), value=pad_value) for p in prompts])
        prompt_lens = lens
    if not isinstance(prompts, Tensor):
        raise TypeError(f"prompts must be a tensor of token ids or a list of them, got {type(prompts).__name__}")
    single = prompts.ndim == 1
    if single:
        prompts = prompts[None]
        mask = mask[None] if isinstance(mask, Tensor) and mask.ndim == 1 else mask
    if prompt_lens is None:
        return prompts, mask, single
    if mask is not None:
        raise ValueError("pass mask (left padding) or prompt_lens (right padding), not both")
    b, n = prompts.shape
    lens = torch.as_tensor(prompt_lens, device=prompts.device).reshape(-1)
    if lens.shape != (b,) or lens.dtype.is_floating_point or bool((lens < 1).any()) or bool((lens > n).any()):
        raise ValueError(f"prompt_lens must hold {b} integer lengths in [1, {n}], got {prompt_lens!r}")
    if bool((lens == n).all()):
        return prompts, None, single
    moved, keep = left_aligned(prompts, lens.long(), pad_value)
    return moved, keep, single
