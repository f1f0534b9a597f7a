"""`XValAutoregressiveWrapper`: xVal's training loss (next-token cross-entropy plus the squared error of the
number head where the next token is [NUM], arXiv:2310.02989) and generation of tokens with their numbers."""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks
from ..losses import forward_with_losses, with_aux
from ..memory.kv_cache import DecodeState
from ..precision import upcast
from ..xval import XValTransformerWrapper
from .sampling import Sampler, top_k


class LossBreakdown(NamedTuple):
    """Per-target terms (b, n - 1): the cross-entropy and the (unweighted) squared error of the number head,
    0 where the target is not [NUM] or does not count."""

    cross_entropy_loss: Tensor
    numerical_mse_loss: Tensor


class GenerateReturn(NamedTuple):
    """Generated ids (b, seq_len), their numbers (b, seq_len; NaN where the id is not [NUM]), and that mask."""

    sampled_token_ids: Tensor
    sampled_numbers: Tensor
    is_number_mask: Tensor


class XValAutoregressiveWrapper(nn.Module):
    """Wraps an `XValTransformerWrapper` with a causal stack.

    forward(x (b, n), x_num (b, n), mask=None) -> the mean over counted targets t of
    CE(logits_t, x_{t+1}) + numerical_loss_weight * [x_{t+1} = NUM] (number_t - x_num_{t+1})^2, plus the
    weighted auxiliary losses; a target counts unless it is ignore_index or masked. `return_loss_breakdown`
    also gives the per-target `LossBreakdown`.
    """

    def __init__(self, net: XValTransformerWrapper, ignore_index: int = -100, pad_value: int = 0,
                 numerical_loss_weight: float = 1.0):
        super().__init__()
        if not isinstance(net, XValTransformerWrapper):
            raise TypeError(f"XValAutoregressiveWrapper wraps an XValTransformerWrapper, got {type(net).__name__}")
        if not net.attn_layers.causal:
            raise ValueError("XValAutoregressiveWrapper needs a causal stack (a Decoder)")
        if not checks.number(numerical_loss_weight) or numerical_loss_weight < 0:
            raise ValueError(f"numerical_loss_weight must be a number >= 0, got {numerical_loss_weight!r}")
        self.net = net
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self.numerical_loss_weight = float(numerical_loss_weight)
        self.max_seq_len = net.max_seq_len

    def forward(self, x: Tensor, x_num: Tensor, return_loss_breakdown: bool = False, mask: Tensor | None = None,
                context: Tensor | None = None, context_mask: Tensor | None = None
                ) -> Tensor | tuple[Tensor, LossBreakdown]:
        x = checks.tensor("x", x)
        if x.ndim != 2 or x.shape[1] < 2:
            raise ValueError(f"x must have shape (batch, seq) with seq >= 2, got {tuple(x.shape)}")
        x_num = self.net.check_numbers(x, x_num)
        inp, target = x[:, :-1], x[:, 1:]
        counted = target != self.ignore_index
        if mask is not None:              # (b, n): inputs and targets; (b, n - 1): both, aligned with the inputs
            mask = checks.tensor("mask", mask)
            if mask.shape == x.shape:
                checks.bool_mask("mask", mask, tuple(x.shape), "(batch, seq)")
                counted = counted & mask[:, 1:]
                mask = mask[:, :-1]
            else:
                checks.bool_mask("mask", mask, tuple(target.shape), "(batch, seq) or (batch, seq - 1)")
                counted = counted & mask
        (logits, numbers), aux = forward_with_losses(self.net, inp, x_num[:, :-1], mask=mask, context=context,
                                                     context_mask=context_mask)
        ce = F.cross_entropy(upcast(logits).transpose(1, 2), target, reduction="none", ignore_index=self.ignore_index)
        is_number = (target == self.net.numerical_token_id) & counted
        numbers = upcast(numbers)
        wanted = x_num[:, 1:].masked_fill(~is_number, 0.0).to(numbers.dtype)
        mse = (numbers - wanted).pow(2).masked_fill(~is_number, 0.0)
        loss = with_aux((ce + self.numerical_loss_weight * mse)[counted].mean(), aux)
        return (loss, LossBreakdown(ce, mse)) if return_loss_breakdown else loss

    @torch.no_grad()
    def generate(self, start_tokens: Tensor, start_numbers: Tensor, seq_len: int,
                 filter_logits_fn: Callable | str | list | None = top_k, filter_kwargs: dict | list | None = None,
                 temperature: float = 1.0, cache_kv: bool = True, context: Tensor | None = None,
                 context_mask: Tensor | None = None, generator: torch.Generator | None = None) -> GenerateReturn:
        """Sample seq_len tokens after start_tokens (b, n) with their numbers start_numbers (b, n): each step's
        number head output goes with its sampled token (and is fed back as that token's number), and is kept
        where the token is [NUM]. The context is the last max_seq_len positions, as x-transformers'; with cache_kv
        the steps run on a decode state while everything fits in max_seq_len (the same tokens and numbers).
        temperature 0 is greedy; the default filter is top_k (x-transformers')."""
        checks.token_ids(start_tokens, self.net.num_tokens, "start_tokens")
        start_numbers = self.net.check_numbers(start_tokens, start_numbers, "start_numbers")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        sampler = Sampler(temperature, filter_logits_fn, filter_kwargs, generator=generator)
        sampler.check(self.net.num_tokens)
        b, n = start_tokens.shape
        fits = n + seq_len - 1 <= self.max_seq_len
        was_training = self.net.training
        self.net.eval()
        try:
            steps = (self._cached(start_tokens, start_numbers, seq_len, context, context_mask) if cache_kv and fits
                     else self._recomputed(start_tokens, start_numbers, context, context_mask))
            tokens, numbers = [], []
            logits, number = next(steps)
            while True:
                tokens.append(sampler(logits))
                numbers.append(number)
                if len(tokens) == seq_len:
                    break
                logits, number = steps.send((tokens[-1], number))
        finally:
            self.net.train(was_training)
        out, nums = torch.stack(tokens, dim=1), torch.stack(numbers, dim=1)
        is_number = out == self.net.numerical_token_id
        return GenerateReturn(out, nums.masked_fill(~is_number, float("nan")), is_number)

    def _cached(self, tokens: Tensor, numbers: Tensor, seq_len: int, context: Tensor | None,
                context_mask: Tensor | None) -> Iterator[tuple[Tensor, Tensor]]:
        """Yields the next position's (logits (b, v), number (b,)); is sent the chosen (token, number)."""
        state: DecodeState = self.net.new_state(tokens.shape[0], tokens.shape[1] + seq_len)
        x, x_num = tokens, numbers
        while True:
            logits, nums = self.net(x, x_num, state=state, context=context, context_mask=context_mask)
            token, number = yield logits[:, -1], nums[:, -1]
            x, x_num = token[:, None], number[:, None]

    def _recomputed(self, tokens: Tensor, numbers: Tensor, context: Tensor | None,
                    context_mask: Tensor | None) -> Iterator[tuple[Tensor, Tensor]]:
        """As `_cached`, each step running the last max_seq_len positions again."""
        seq, seq_num = tokens, numbers
        limit = self.max_seq_len
        while True:
            logits, nums = self.net(seq[:, -limit:], seq_num[:, -limit:], context=context, context_mask=context_mask)
            token, number = yield logits[:, -1], nums[:, -1]
            seq = torch.cat((seq, token[:, None]), dim=1)
            seq_num = torch.cat((seq_num, number[:, None].to(seq_num.dtype)), dim=1)
