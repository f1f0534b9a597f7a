"""`DPO`: direct preference optimisation (arXiv:2305.18290, eq. 7). With π the policy being trained and
π_ref a frozen copy of it taken at construction,

    loss = -log σ(β [(log π(y_w|x) - log π_ref(y_w|x)) - (log π(y_l|x) - log π_ref(y_l|x))]),

averaged over the batch, where y_w / y_l are the preferred / unpreferred responses to the prompt x."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import checks
from .wrappers import TransformerWrapper


def response_log_prob(net: nn.Module, seq: Tensor, counted: Tensor, reduction: str) -> Tensor:
    """Σ (or mean) over counted tokens t >= 1 of log p(seq_t | seq_<t): (b,). counted (b, n) bool marks the
    response's tokens (the first token is never counted: nothing predicts it)."""
    logits = net(seq[:, :-1])
    log_p = logits.float().log_softmax(-1).gather(-1, seq[:, 1:, None])[..., 0]        # (b, n - 1)
    counted = counted[:, 1:]
    total = torch.where(counted, log_p, 0.0).sum(-1)
    return total if reduction == "sum" else total / counted.sum(-1).clamp(min=1)


class DPO(nn.Module):
    """Wraps a causal `TransformerWrapper` (or an `AutoregressiveWrapper`'s net) as the policy.

    Args:
        beta: β, how far the policy may move from the reference.
        pad_id: tokens equal to it do not count (when no sequence mask is given).
        reduction: "sum" (the paper: a response's log-likelihood) or "mean" (per response token, as
            x-transformers' DPO computes it).
    forward(preferred_seq (b, n), unpreferred_seq (b, n), *, prompt_mask (b, n) bool, True on the prompt,
    preferred_seq_mask / unpreferred_seq_mask (b, n) bool, True = a real token) -> the scalar loss. Each row
    is prompt then response, right-padded; the response's tokens are those outside the prompt that are kept.
    `parameters()` yields the policy's parameters only (the reference is frozen).
    """

    def __init__(self, model: nn.Module, *, beta: float = 0.1, pad_id: int | None = None, reduction: str = "sum"):
        super().__init__()
        net = getattr(model, "net", model)
        if not isinstance(net, TransformerWrapper):
            raise TypeError(f"DPO's model must be a TransformerWrapper (or wrap one as .net), got {type(model).__name__}")
        if not net.attn_layers.causal:
            raise ValueError("DPO needs a causal model (a Decoder): it scores each response token from what precedes it")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
            raise ValueError(f"DPO: beta must be a positive number, got {beta!r}")
        if reduction not in ("sum", "mean"):
            raise ValueError(f"DPO: reduction must be 'sum' or 'mean', got {reduction!r}")
        if pad_id is not None and (isinstance(pad_id, bool) or not isinstance(pad_id, int)):
            raise TypeError(f"DPO: pad_id must be a token id or None, got {pad_id!r}")
        self.policy_model = net
        self.ref_model = copy.deepcopy(net).eval()
        self.ref_model.requires_grad_(False)
        self.beta, self.pad_id, self.reduction = float(beta), pad_id, reduction

    def parameters(self, recurse: bool = True):
        return self.policy_model.parameters(recurse)

    def train(self, mode: bool = True) -> "DPO":
        super().train(mode)
        self.ref_model.eval()                   # the reference stays deterministic (no dropout)
        return self

    def _counted(self, seq: Tensor, seq_mask: Tensor | None, prompt_mask: Tensor, name: str) -> Tensor:
        checks.token_ids(seq, self.policy_model.num_tokens, name)
        if seq_mask is None:
            seq_mask = seq != self.pad_id if self.pad_id is not None else torch.ones_like(seq, dtype=torch.bool)
        else:
            checks.bool_mask(f"{name}_mask", seq_mask, tuple(seq.shape), "(batch, seq)")
        return seq_mask & ~prompt_mask

    def forward(self, preferred_seq: Tensor, unpreferred_seq: Tensor, *, prompt_mask: Tensor,
                preferred_seq_mask: Tensor | None = None, unpreferred_seq_mask: Tensor | None = None) -> Tensor:
        if preferred_seq.ndim != 2 or preferred_seq.shape != unpreferred_seq.shape or preferred_seq.shape[1] < 2:
            raise ValueError(f"preferred_seq and unpreferred_seq must have one shape (batch, seq >= 2), got "
                             f"{tuple(preferred_seq.shape)} and {tuple(unpreferred_seq.shape)}")
        checks.bool_mask("prompt_mask", prompt_mask, tuple(preferred_seq.shape), "(batch, seq)")
        seqs = (preferred_seq, unpreferred_seq)
        counted = (self._counted(preferred_seq, preferred_seq_mask, prompt_mask, "preferred_seq"),
                   self._counted(unpreferred_seq, unpreferred_seq_mask, prompt_mask, "unpreferred_seq"))
        with torch.no_grad():
            ref_w, ref_l = (response_log_prob(self.ref_model, s, c, self.reduction) for s, c in zip(seqs, counted))
        pol_w, pol_l = (response_log_prob(self.policy_model, s, c, self.reduction) for s, c in zip(seqs, counted))
        margin = (pol_w - ref_w) - (pol_l - ref_l)
        return -F.logsigmoid(self.beta * margin).mean()
