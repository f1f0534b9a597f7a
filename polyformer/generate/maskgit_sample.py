"""MaskGIT's iterative decoding (arXiv:2202.04200, section 3.2): all positions start as [mask]; each
iteration predicts every masked token, then re-masks the least confident ones (or those a token critic
flags, arXiv:2209.04439) down to ceil(γ(r)·n) at r = (step + 1) / steps, until none is left."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .sampling import top_k

if TYPE_CHECKING:
    from .maskgit import NonAutoregressiveWrapper


def masked_count(schedule, r: float, n: int) -> int:
    """ceil(γ(r)·n), read with a little slack so that γ(1) = cos(π/2) ~ 6e-17 gives 0."""
    return min(n, max(0, math.ceil(float(schedule(torch.tensor(r, dtype=torch.float64))) * n - 1e-6)))


def keep_top_fraction(logits: Tensor, thres: float | None) -> Tensor:
    """x-transformers' top-k by `filter_thres`: keep the ceil((1 - thres)·V) largest logits, the rest -inf."""
    if thres is None:
        return logits
    return top_k(logits, k=max(1, math.ceil((1 - thres) * logits.shape[-1])))


def iterative_decode(model: "NonAutoregressiveWrapper", b: int, n: int, start_temperature: float,
                     filter_thres: float | None, noise_level_scale: float) -> Tensor:
    from .maskgit import gumbel_noise, gumbel_sample

    if filter_thres is not None and not 0 <= filter_thres < 1:
        raise ValueError(f"filter_thres must be in [0, 1) or None, got {filter_thres!r}")
    device = next(model.net.parameters()).device
    seq = torch.full((b, n), model.mask_id, dtype=torch.long, device=device)
    masked = torch.ones(b, n, dtype=torch.bool, device=device)
    cond = model.null_embed.expand(b, n, -1) if model.self_cond else None
    for step in range(model.steps):
        extra = {"sum_embeds": model.to_self_cond(cond)} if cond is not None else {}
        embeds = model.net(seq, return_embeddings=True, **extra)
        logits = model.net.head(embeds).float()
        logits[..., model.mask_id] = float("-inf")                  # [mask] is never a prediction
        if cond is not None:
            cond = embeds
        anneal = (model.steps - 1 - step) / model.steps             # the temperature falls to 0 at the end
        logits = keep_top_fraction(logits, filter_thres)
        sampled = gumbel_sample(logits, max(start_temperature * anneal, 1e-3))
        seq = torch.where(masked, sampled, seq)
        count = masked_count(model.schedule, (step + 1) / model.steps, n)
        if model.token_critic is not None:
            scores = model.token_critic(seq)[..., 0].float()
            scores = scores + noise_level_scale * anneal * gumbel_noise(scores)
        else:                                                       # -log p(sampled token): low confidence first
            scores = -logits.log_softmax(-1).gather(-1, sampled[..., None])[..., 0]
        if not model.can_mask_prev_unmasked:
            scores = scores.masked_fill(~masked, float("-inf"))
            count = min(count, int(masked.sum(-1).min()))
        masked = torch.zeros_like(masked).scatter(1, scores.topk(count, dim=-1).indices, True)
        seq = seq.masked_fill(masked, model.mask_id)
    return seq
