"""`return_gumbel_log_probs=True` (x-transformers 2.x, on the stack's and the token wrapper's forward): for every
attention block that picks keys (attn_hard, attn_gumbel_softmax: hard_attention.py), the log-probability of the
key each query picked under the softmax of its scores, log softmax(s)_{i, j*} with j* = the chosen key: (b, h, i)
per block, in the record's `gumbel_log_probs`. By the Gumbel-max trick a hard Gumbel draw picks key j with
probability softmax(s)_j, so these are the log-likelihoods a policy gradient (REINFORCE) over the picks needs;
they carry gradient to the scores. Masked keys are never picked; a query that may see no key gets 0."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..precision import upcast
from .hard_attention import GumbelSoftmax, HardMax
from .normalize import fill_masked
from .taps import recorded, tapped

if TYPE_CHECKING:
    from ..stack import AttentionLayers


def picking(stack: "AttentionLayers") -> list[nn.Module]:
    """The normalisers of the stack's blocks that pick keys, in block order."""
    return [m for m in stack.modules() if isinstance(m, (HardMax, GumbelSoftmax))]


def check(owner: str, stack: "AttentionLayers") -> list[nn.Module]:
    found = picking(stack)
    if not found:
        raise ValueError(f"{owner}: return_gumbel_log_probs gives the log-probability of the key a hard or "
                         "Gumbel-softmax attention block picked; this stack has none (attn_hard=True or "
                         "attn_gumbel_softmax=True)")
    return found


def log_prob_of_pick(scores: Tensor, mask: Tensor | None, weights: Tensor) -> Tensor:
    """log softmax(scores) at each row's largest weight (b, h, i); 0 for a row that may see no key."""
    s = upcast(scores)
    if s.shape[-1] == 0:                    # no key at all (an empty context): nothing picked
        return s.new_zeros(s.shape[:-1])
    log_probs = torch.log_softmax(fill_masked(s, mask), dim=-1)
    picked = log_probs.gather(-1, weights.argmax(dim=-1, keepdim=True)).squeeze(-1)
    if mask is None:
        return picked
    return picked.masked_fill(~mask.any(dim=-1).expand_as(picked), 0.0)


def returned(owner: nn.Module, stack: "AttentionLayers", args: dict[str, Any]) -> tuple[Any, Any]:
    """owner.forward(**args) with the picks' log-probabilities asked for: (output, its record with
    `gumbel_log_probs`, one (b, h, i) tensor per picking block)."""
    found: list[Tensor] = []

    def report(module: nn.Module, inputs: tuple[Tensor, Tensor | None], weights: Tensor) -> None:
        found.append(log_prob_of_pick(*inputs, weights))

    with tapped(check(type(owner).__name__, stack), report):
        out, record = owner.forward(**recorded(args, "return_gumbel_log_probs"))
    record.gumbel_log_probs = found
    return out, record
