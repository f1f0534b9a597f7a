"""`NonAutoregressiveWrapper`: MaskGIT (arXiv:2202.04200). Training masks ceil(γ(t)·n) tokens of each
sequence, t ~ U(0, 1), and predicts them all at once; generation starts from all [mask] and over `steps`
iterations keeps the most confident predictions, re-masking the rest down to γ's count. Optional: BERT's
80/10/10 corruption of the chosen tokens, MDLM's loss weight (arXiv:2406.07524), self-conditioning on the
previous prediction's embeddings, and a token critic that says which tokens to re-mask (arXiv:2209.04439)."""

from __future__ import annotations

import inspect
import math
import random
from collections import namedtuple
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks
from ..attention.kernels.sortnet import gumbel
from ..wrappers import TransformerWrapper
from .maskgit_sample import iterative_decode

Losses = namedtuple("Losses", ["loss", "generator_loss", "critic_loss"])


def linear_schedule(t: Tensor) -> Tensor:
    return 1 - t


def cosine_schedule(t: Tensor) -> Tensor:
    """MaskGIT's choice: γ(t) = cos(πt / 2)."""
    return torch.cos(t * math.pi / 2)


SCHEDULES = {"linear": linear_schedule, "cosine": cosine_schedule}


def mdlm_weight(schedule: Callable[[Tensor], Tensor], t: Tensor) -> Tensor:
    """-γ'(t) / γ(t) (b,): MDLM's continuous-time weight written for γ, the masked fraction (decreasing)."""
    slope, value = torch.func.vmap(torch.func.grad_and_value(schedule))(t)
    return -slope / value.clamp(min=torch.finfo(value.dtype).tiny)


class SelfCritic(nn.Module):
    """A token critic on the generator's own embeddings: one logit per token (high: re-mask it)."""

    def __init__(self, net: TransformerWrapper):
        super().__init__()
        self.net = net
        self.to_logits = nn.Linear(net.attn_layers.out_dim, 1)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.to_logits(self.net(x, mask=mask, return_embeddings=True))


def _fraction(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"NonAutoregressiveWrapper: {name} must be in [0, 1], got {value!r}")
    return float(value)


class NonAutoregressiveWrapper(nn.Module):
    """Wraps a bidirectional `TransformerWrapper` (an Encoder stack) for masked iterative decoding.

    Args:
        mask_id: the [mask] token id (< num_tokens; generation never samples it).
        steps: generation iterations.
        schedule: "linear" (1 - t), "cosine" (cos(πt/2)) or a callable γ on tensors: the masked fraction at t.
        no_replace_prob / random_token_prob: of the tokens chosen for the loss, these fractions keep their
            token / get a uniformly drawn other token (not mask_id) instead of mask_id (BERT's 80/10/10).
        use_simple_mdlm_loss_weight: the loss is Σ_rows w(t) Σ_chosen CE / tokens with w = -γ'(t)/γ(t)
            (MDLM's ELBO); otherwise the mean CE over the chosen tokens (MaskGIT).
        self_cond / self_cond_train_prob: feed the previous prediction's embeddings back through `sum_embeds`.
        can_mask_prev_unmasked: generation may re-mask tokens an earlier iteration kept.
        token_critic: a TransformerWrapper with logits_dim=1 scoring each token of a filled-in sequence
            (high: likely wrong); or self_token_critic=True for a linear critic on the generator's embeddings.
        critic_loss_weight: the critic's BCE joins the loss with this weight.
    forward(x (b, n), mask=None) -> Losses(loss, generator_loss, critic_loss).
    """

    def __init__(self, net: TransformerWrapper, *, mask_id: int, steps: int = 18, self_cond: bool = False,
                 self_cond_train_prob: float = 0.75, no_replace_prob: float = 0.15, random_token_prob: float = 0.1,
                 schedule: str | Callable[[Tensor], Tensor] = "linear", can_mask_prev_unmasked: bool = False,
                 token_critic: TransformerWrapper | None = None, self_token_critic: bool = False,
                 critic_loss_weight: float = 1.0, use_simple_mdlm_loss_weight: bool = True):
        super().__init__()
        if not isinstance(net, TransformerWrapper):
            raise TypeError(f"NonAutoregressiveWrapper wraps a TransformerWrapper, got {type(net).__name__}")
        if net.attn_layers.causal:
            raise ValueError("NonAutoregressiveWrapper needs a bidirectional stack (an Encoder): every token is "
                             "predicted from both sides")
        if isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < net.num_tokens:
            raise ValueError(f"NonAutoregressiveWrapper: mask_id must be a token id in [0, {net.num_tokens}), "
                             f"got {mask_id!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"NonAutoregressiveWrapper: steps must be a positive integer, got {steps!r}")
        if callable(schedule):
            self.schedule = schedule
        elif schedule in SCHEDULES:
            self.schedule = SCHEDULES[schedule]
        else:
            raise ValueError(f"NonAutoregressiveWrapper: schedule must be 'linear', 'cosine' or a callable, "
                             f"got {schedule!r}")
        self.no_replace_prob = _fraction("no_replace_prob", no_replace_prob)
        self.random_token_prob = _fraction("random_token_prob", random_token_prob)
        self.self_cond_train_prob = _fraction("self_cond_train_prob", self_cond_train_prob)
        if self.no_replace_prob + self.random_token_prob > 1:
            raise ValueError("NonAutoregressiveWrapper: no_replace_prob + random_token_prob must be at most 1, got "
                             f"{self.no_replace_prob} + {self.random_token_prob}")
        if self.random_token_prob > 0 and net.num_tokens < 2:
            raise ValueError("NonAutoregressiveWrapper: random_token_prob > 0 needs a token other than mask_id")
        self.net, self.mask_id, self.steps = net, mask_id, steps
        self.num_tokens, self.max_seq_len = net.num_tokens, net.max_seq_len
        self.mdlm = bool(use_simple_mdlm_loss_weight)
        self.can_mask_prev_unmasked = bool(can_mask_prev_unmasked)
        self.self_cond = bool(self_cond)
        if self.self_cond:
            if "sum_embeds" not in inspect.signature(net.forward).parameters:
                raise ValueError("NonAutoregressiveWrapper: self_cond=True needs TransformerWrapper.forward(sum_embeds=)")
            dim = net.attn_layers.out_dim
            self.null_embed = nn.Parameter(torch.randn(dim) * 0.02)
            self.to_self_cond = nn.Linear(dim, net.attn_layers.dim, bias=False)
        if self_token_critic and token_critic is not None:
            raise ValueError("NonAutoregressiveWrapper: give token_critic or self_token_critic=True, not both")
        if token_critic is not None:
            width = getattr(token_critic, "to_logits", None)
            if not isinstance(token_critic, TransformerWrapper) or width is None or width.out_features != 1:
                raise ValueError("NonAutoregressiveWrapper: token_critic must be a TransformerWrapper with logits_dim=1")
        self.token_critic = SelfCritic(net) if self_token_critic else token_critic
        self.critic_loss_weight = float(critic_loss_weight)

    def choose(self, x: Tensor, mask: Tensor | None = None,
               t: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(the corrupted input (b, n), the chosen tokens (b, n) bool, t (b,)): per row ceil(γ(t)·n) of its
        kept tokens (at least one), corrupted 80/10/10."""
        b, n = x.shape
        kept = mask if mask is not None else torch.ones_like(x, dtype=torch.bool)
        t = torch.rand(b, device=x.device) if t is None else t
        count = (self.schedule(t) * kept.sum(-1)).ceil().clamp(min=1)          # (b,)
        rank = torch.rand(b, n, device=x.device).masked_fill(~kept, 2.0).argsort(-1).argsort(-1)
        chosen = (rank < count[:, None]) & kept
        u = torch.rand(b, n, device=x.device)
        to_random = chosen & (u >= self.no_replace_prob) & (u < self.no_replace_prob + self.random_token_prob)
        to_mask = chosen & (u >= self.no_replace_prob + self.random_token_prob)
        other = torch.randint(0, self.num_tokens - 1, (b, n), device=x.device)
        other = other + (other >= self.mask_id).long()                          # any token but mask_id
        inp = torch.where(to_random, other, x).masked_fill(to_mask, self.mask_id)
        return inp, chosen, t

    def generator_loss(self, logits: Tensor, x: Tensor, chosen: Tensor, t: Tensor, mask: Tensor | None = None
                       ) -> Tensor:
        ce = F.cross_entropy(logits.transpose(1, 2).float(), x, reduction="none")      # (b, n)
        if not self.mdlm:
            return ce[chosen].mean()
        weight = mdlm_weight(self.schedule, t.float())
        tokens = mask.sum() if mask is not None else x.numel()
        return (weight[:, None] * ce * chosen).sum() / tokens

    def forward(self, x: Tensor, mask: Tensor | None = None, only_train_generator: bool = False,
                only_train_critic: bool = False, generator_sample_temperature: float | None = None) -> Losses:
        checks.token_ids(x, self.num_tokens, "x")
        if mask is not None:
            checks.bool_mask("mask", mask, tuple(x.shape), "(batch, seq)")
        if only_train_critic and self.token_critic is None:
            raise ValueError("only_train_critic=True needs a token critic")
        inp, chosen, t = self.choose(x, mask)
        extra = {}
        if self.self_cond:
            cond = self.null_embed.expand(*x.shape, -1)
            if random.random() < self.self_cond_train_prob:
                with torch.no_grad():
                    cond = self.net(inp, mask=mask, return_embeddings=True)
            extra["sum_embeds"] = self.to_self_cond(cond)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not only_train_critic):
            logits = self.net(inp, mask=mask, **extra)
        loss = self.generator_loss(logits, x, chosen, t, mask)
        if self.token_critic is None or only_train_generator:
            return Losses(loss, loss, None)
        temperature = random.random() if generator_sample_temperature is None else generator_sample_temperature
        sampled = gumbel_sample(logits.detach(), temperature)
        filled = torch.where(chosen, sampled, x)
        critic_logits = self.token_critic(filled, mask=mask)[..., 0]
        kept = mask if mask is not None else torch.ones_like(chosen)
        critic_loss = F.binary_cross_entropy_with_logits(critic_logits[kept].float(), (filled != x)[kept].float())
        if only_train_critic:
            return Losses(critic_loss, None, critic_loss)
        return Losses(loss + self.critic_loss_weight * critic_loss, loss, critic_loss)

    @torch.no_grad()
    def generate(self, batch_size: int | None = None, start_temperature: float = 1.0, filter_thres: float | None = 0.7,
                 noise_level_scale: float = 1.0, seq_len: int | None = None) -> Tensor:
        """Sample (batch_size, seq_len) tokens ((seq_len,) without batch_size); seq_len defaults to
        max_seq_len. See `generate.maskgit_sample.iterative_decode`."""
        was_training = self.training
        self.eval()
        try:
            seq = iterative_decode(self, 1 if batch_size is None else batch_size, seq_len or self.max_seq_len,
                                   start_temperature, filter_thres, noise_level_scale)
        finally:
            self.train(was_training)
        return seq[0] if batch_size is None else seq


def gumbel_sample(logits: Tensor, temperature: float) -> Tensor:
    """argmax(logits / τ + Gumbel noise) (b, n): a sample at temperature τ (greedy as τ -> 0)."""
    return (logits.float() / max(temperature, 1e-10) + gumbel_noise(logits)).argmax(-1)


def gumbel_noise(like: Tensor) -> Tensor:
    """Standard Gumbel draws in float32, of like's shape."""
    return gumbel(like.shape, like.float())
