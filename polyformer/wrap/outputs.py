"""What a sequence wrapper does after the stack: pooling (class tokens, a masked average), several output
heads, a mixture of softmaxes, the entropy of the logits, and the record a forward returns."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .. import checks
from ..stack import Intermediates


@dataclass
class WrapperRecord(Intermediates):
    """The stack's `Intermediates` plus what the wrapper adds.

    logit_entropies: the entropy of each position's output distribution (b, n) (a tuple with several
        heads), with `return_logit_entropies=True`.
    cache_length: how many inputs the record has seen; pass the record back as `cache=` with the inputs
        continued to run only the new ones (wrap/cache.py).
    decode: the decode state that holds them (made on first use of the record as a cache).
    inputs: (x, pos, per-position arguments) over those inputs, for input_not_include_cache (wrap/cache.py).
    attn_pooled_tokens: attn_pool's pooled tokens (b, k, dim_pooled) (wrap/pooling.py); logits: the logits an
        Encoder with attn_pool computed besides them.
    """

    logit_entropies: Tensor | tuple[Tensor, ...] | None = None
    cache_length: int | None = None
    decode: Any = None
    inputs: tuple | None = None
    attn_pooled_tokens: Tensor | None = None
    logits: Tensor | tuple[Tensor, ...] | None = None
    attn_z_loss: Tensor | None = None     # return_attn_z_loss=True: the weighted z-loss (attention/z_loss.py)

    @classmethod
    def of(cls, record: Intermediates) -> "WrapperRecord":
        if isinstance(record, cls):
            return record
        return cls(**{f.name: getattr(record, f.name) for f in fields(record)})


def check_heads(owner: str, num_output_heads: object, exclusive: dict[str, bool]) -> int:
    checks.count(num_output_heads, f"{owner}: num_output_heads")
    on = [name for name, value in exclusive.items() if value]
    if len(on) > 1:
        raise ValueError(f"{owner}: {' and '.join(on)} cannot be combined")
    return num_output_heads


class MixtureOfSoftmaxes(nn.Module):
    """Mixture of softmaxes (arXiv:1711.03953): P(w | h) = Σ_k π_k softmax(tanh(W_k h) Eᵀ)_w with
    π = softmax(W_π h); the output is log P (b, n, vocabulary)."""

    def __init__(self, dim: int, k: int):
        super().__init__()
        self.k = k
        self.to_components = nn.Linear(dim, k * dim, bias=False)
        self.to_prior = nn.Linear(dim, k, bias=False)

    def forward(self, x: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
        parts = torch.tanh(rearrange(self.to_components(x), "... (k d) -> ... k d", k=self.k))   # (b, n, k, dim)
        log_probs = F.log_softmax(project(parts).float(), dim=-1)                              # (b, n, k, v)
        log_prior = F.log_softmax(self.to_prior(x).float(), dim=-1)                           # (b, n, k)
        return torch.logsumexp(log_probs + log_prior[..., None], dim=-2).to(x.dtype)


def masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """x (b, n, d) averaged over the kept positions of mask (b, n) -> (b, d)."""
    if mask is None:
        return x.mean(dim=1)
    weights = mask.to(x.dtype)[..., None]
    return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


def pool(out: Tensor, cls: int, average: bool, mask: Tensor | None) -> Tensor:
    """The stack's output (b, p + n, dim) -> the class tokens' outputs ((b, dim) for one, (b, cls, dim)
    for several), the masked average of the positions after them (b, dim), or out as it is."""
    if cls:
        return out[:, 0] if cls == 1 else out[:, :cls]
    if average:
        return masked_mean(out, mask)
    return out


def entropies(logits: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    """H = -Σ p log p over the last axis (logits or log-probabilities), in float32, per position (and head)."""
    if isinstance(logits, tuple):
        return tuple(entropies(t) for t in logits)
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
