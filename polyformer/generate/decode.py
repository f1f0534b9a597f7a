"""`AutoregressiveWrapper`: next-token loss and sampling for a token decoder."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..wrappers import TransformerWrapper
from .sampling import sample, top_k


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
                 temperature: float = 1.0, filter_logits_fn: Callable[..., Tensor] | None = top_k,
                 filter_kwargs: dict | None = None, context: Tensor | None = None,
                 context_mask: Tensor | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Sample `seq_len` tokens after `prompts` (b, n); returns (b, seq_len). After `eos_token`
        a row is padded with `pad_value`."""
        if prompts.ndim != 2 or prompts.shape[1] == 0:
            raise ValueError(f"prompts must have shape (batch, prompt_len >= 1), got {tuple(prompts.shape)}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        was_training = self.net.training
        self.net.eval()
        out = prompts
        done = torch.zeros(prompts.shape[0], dtype=torch.bool, device=prompts.device)
        for _ in range(seq_len):
            window = out[:, -self.max_seq_len:] if self.net.bounded else out
            logits = self.net(window, context=context, context_mask=context_mask)[:, -1]
            if filter_logits_fn is not None:
                logits = filter_logits_fn(logits, **(filter_kwargs or {}))
            token = sample(logits, temperature, generator)
            if eos_token is not None:
                token = token.masked_fill(done, self.pad_value)
                done |= token == eos_token
            out = torch.cat((out, token[:, None]), dim=1)
            if eos_token is not None and bool(done.all()):
                break
        self.net.train(was_training)
        out = out[:, prompts.shape[1]:]
        if out.shape[1] < seq_len:
            out = F.pad(out, (0, seq_len - out.shape[1]), value=self.pad_value)
        return out
