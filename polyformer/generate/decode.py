"""`AutoregressiveWrapper`: next-token loss and sampling for a token decoder."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks
from ..wrappers import TransformerWrapper
from .sampling import sample


class AutoregressiveWrapper(nn.Module):
    """Wraps a `TransformerWrapper` with a causal stack.

    forward(x (b, n), mask=None, context=None, context_mask=None) -> mean next-token cross-entropy
    of predicting x[:, 1:] from x[:, :-1]; targets equal to `ignore_index` do not count.
    """

    def __init__(self, net: TransformerWrapper, ignore_index: int = -100, pad_value: int = 0):
        super().__init__()
        if not isinstance(net, TransformerWrapper):
            raise TypeError(f"AutoregressiveWrapper wraps a TransformerWrapper, got {type(net).__name__}")
        if not net.attn_layers.causal:
            raise ValueError("AutoregressiveWrapper needs a causal stack (a Decoder)")
        self.net = net
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self.max_seq_len = net.max_seq_len

    def forward(self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None,
                context_mask: Tensor | None = None) -> Tensor:
        if x.ndim != 2 or x.shape[1] < 2:
            raise ValueError(f"x must have shape (batch, seq) with seq >= 2, got {tuple(x.shape)}")
        inp, target = x[:, :-1], x[:, 1:]
        if mask is not None:
            mask = mask[:, :-1]
        logits = self.net(inp, mask=mask, context=context, context_mask=context_mask)
        return F.cross_entropy(logits.transpose(1, 2), target, ignore_index=self.ignore_index)

    @torch.no_grad()
    def generate(self, prompts: Tensor, seq_len: int, eos_token: int | None = None,
                 temperature: float = 1.0, filter_logits_fn: Callable[..., Tensor] | None = None,
                 filter_kwargs: dict | None = None, cache_kv: bool = True, mask: Tensor | None = None,
                 context: Tensor | None = None, context_mask: Tensor | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Sample `seq_len` tokens after `prompts` (b, n); returns (b, seq_len).

        mask: (b, n) bool for left-padded prompts of different lengths; each row's positions then
        start at its first kept token, so a row generates what its prompt alone would.
        temperature 0 is greedy. filter_logits_fn(logits, **filter_kwargs), e.g. `top_k`, `top_p`.
        After `eos_token` a row continues with `pad_value`. With cache_kv (the default) every step
        runs only the new token against a preallocated decode state.
        """
        checks.token_ids(prompts, self.net.num_tokens, "prompts")
        b, n = prompts.shape
        if not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if mask is not None:
            checks.bool_mask("mask", mask, (b, n), "(batch, prompt_len)")
        if self.net.bounded and n > self.max_seq_len:
            raise ValueError(f"prompts have {n} tokens but the model's learned positions stop at "
                             f"max_seq_len={self.max_seq_len}")
        kwargs = filter_kwargs or {}
        if kwargs and filter_logits_fn is None:
            raise ValueError("filter_kwargs were given without a filter_logits_fn to receive them")
        if filter_logits_fn is not None:      # refuse bad filter arguments before any compute
            filter_logits_fn(torch.zeros(1, self.net.num_tokens), **kwargs)

        def pick(logits: Tensor) -> Tensor:
            if filter_logits_fn is not None:
                logits = filter_logits_fn(logits, **kwargs)
            return sample(logits, temperature, generator)

        was_training = self.net.training
        self.net.eval()
        try:
            fits = not self.net.bounded or n + seq_len <= self.max_seq_len
            if cache_kv and fits:
                tokens = self._cached(prompts, mask, seq_len, pick, eos_token, context, context_mask)
            else:
                tokens = self._recomputed(prompts, mask, seq_len, pick, eos_token, context, context_mask)
        finally:
            self.net.train(was_training)
        return tokens

    def _finish_step(self, token: Tensor, done: Tensor, eos_token: int | None) -> Tensor:
        if eos_token is not None:
            token = token.masked_fill(done, self.pad_value)
            done |= token == eos_token
        return token

    def _cached(self, prompts: Tensor, mask: Tensor | None, seq_len: int, pick: Callable[[Tensor], Tensor],
                eos_token: int | None, context: Tensor | None, context_mask: Tensor | None) -> Tensor:
        b, n = prompts.shape
        state = self.net.new_state(b, n + seq_len)
        logits = self.net(prompts, mask=mask, pos=left_padded_positions(mask), context=context,
                          context_mask=context_mask, state=state)[:, -1]
        out = prompts.new_full((b, seq_len), self.pad_value)
        done = torch.zeros(b, dtype=torch.bool, device=prompts.device)
        for t in range(seq_len):
            out[:, t] = self._finish_step(pick(logits), done, eos_token)
            if t == seq_len - 1 or (eos_token is not None and bool(done.all())):
                break
            logits = self.net(out[:, t: t + 1], context=context, context_mask=context_mask, state=state)[:, -1]
        return out

    def _recomputed(self, prompts: Tensor, mask: Tensor | None, seq_len: int, pick: Callable[[Tensor], Tensor],
                    eos_token: int | None, context: Tensor | None, context_mask: Tensor | None) -> Tensor:
        b, n = prompts.shape
        seq = prompts
        keep = mask if mask is not None else torch.ones_like(prompts, dtype=torch.bool)
        done = torch.zeros(b, dtype=torch.bool, device=prompts.device)
        for _ in range(seq_len):
            window, window_keep = seq, keep
            if self.net.bounded:       # learned positions: the last max_seq_len tokens
                window, window_keep = seq[:, -self.max_seq_len:], keep[:, -self.max_seq_len:]
            logits = self.net(window, mask=window_keep, pos=left_padded_positions(window_keep),
                              context=context, context_mask=context_mask)[:, -1]
            token = self._finish_step(pick(logits), done, eos_token)
            seq = torch.cat((seq, token[:, None]), dim=1)
            keep = F.pad(keep, (0, 1), value=True)
            if eos_token is not None and bool(done.all()):
                break
        out = seq[:, n:]
        return F.pad(out, (0, seq_len - out.shape[1]), value=self.pad_value)


def left_padded_positions(mask: Tensor | None) -> Tensor | None:
    """Per-row positions that start at each row's first kept token: (b, n) or None for no mask."""
    if mask is None:
        return None
    return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
