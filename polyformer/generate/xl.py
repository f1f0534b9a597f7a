"""`XLAutoregressiveWrapper`: Transformer-XL training and generation over sequences longer than
`max_seq_len`, segment by segment, carrying memories (arXiv:1901.02860), compressed ones too when the
model keeps them (arXiv:1911.05507, memory/compressive.py)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks
from ..attention.knn_memory import read_only
from ..memory.infini_carry import carries
from ..memory.memories import Memories
from ..wrappers import TransformerWrapper
from .decode import sample_steps
from .sampling import Sampler


class XLAutoregressiveWrapper(nn.Module):
    """forward(x (b, N)) -> next-token loss over a sequence of any length, computed in segments of
    max_seq_len, each attending to the memories of the segments before it (gradients stop at a
    segment boundary, as in the paper), plus the mean over segments of the auxiliary losses the
    blocks report (a compressed memory's reconstruction loss, an MoE's balance loss).
    generate(prompts, seq_len) continues beyond max_seq_len."""

    def __init__(self, net: TransformerWrapper, ignore_index: int = -100, pad_value: int = 0):
        super().__init__()
        if not isinstance(net, TransformerWrapper) or not net.attn_layers.causal:
            raise TypeError("XLAutoregressiveWrapper wraps a TransformerWrapper with a Decoder")
        if not carries(net):
            raise ValueError("XLAutoregressiveWrapper needs a model built with max_mem_len > 0 (or attn_infini "
                             "blocks, not in a universal / hourglass stack)")
        self.net = net
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self.segment = net.max_seq_len

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        checks.token_ids(x, self.net.num_tokens)
        if x.shape[1] < 2:
            raise ValueError(f"x must have at least 2 tokens, got shape {tuple(x.shape)}")
        inp, target = x[:, :-1], x[:, 1:]
        if mask is not None:
            checks.bool_mask("mask", mask, tuple(x.shape), "(batch, seq)")
            mask = mask[:, :-1]
        total = (target != self.ignore_index).sum().clamp(min=1)
        loss, mems, mem_mask = x.new_zeros((), dtype=torch.float32), None, None
        aux, starts = x.new_zeros((), dtype=torch.float32), range(0, inp.shape[1], self.segment)
        for start in starts:
            seg = slice(start, start + self.segment)
            seg_mask = mask[:, seg] if mask is not None else None
            logits, record = self.net(inp[:, seg], mask=seg_mask, mems=mems, mem_masks=mem_mask,
                                      return_intermediates=True)
            mems = record.mems
            if record.losses:
                aux = aux + record.losses.total()
            if seg_mask is not None and not isinstance(mems, Memories):     # a Memories record keeps its masks
                mem_mask = seg_mask if mem_mask is None else torch.cat((mem_mask, seg_mask), 1)
                mem_mask = mem_mask[:, -mems[0].shape[1]:]
            part = F.cross_entropy(logits.transpose(1, 2), target[:, seg], ignore_index=self.ignore_index,
                                   reduction="sum")
            loss = loss + part
        return loss / total + aux / len(starts)

    @torch.no_grad()
    def generate(self, prompts: Tensor, seq_len: int, eos_token: int | None = None, temperature: float = 1.0,
                 filter_logits_fn: Callable | list | None = None, filter_kwargs: dict | list | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """(b, n) prompts -> (b, seq_len) tokens; the prompt may be longer than max_seq_len: its
        earlier segments become memories."""
        checks.token_ids(prompts, self.net.num_tokens, "prompts")
        if not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        sampler = Sampler(temperature, filter_logits_fn, filter_kwargs, 1.0, generator)
        sampler.check(self.net.num_tokens)
        was_training = self.net.training
        self.net.eval()
        try:
            tokens = list(sample_steps(self._steps(prompts), sampler, seq_len, eos_token, self.pad_value,
                                       None, pad_to_length=True))
        finally:
            self.net.train(was_training)
        return torch.stack(tokens, dim=1)

    def _steps(self, prompts: Tensor):
        """Yields next-token logits; the current segment is recomputed each step, and moves into
        the memories when it is full (only then are the next memories formed)."""
        size, n = self.segment, prompts.shape[1]
        mems = None
        full = (n - 1) // size                   # whole segments before the current one
        for i in range(full):
            _, mems = self.net(prompts[:, i * size:(i + 1) * size], mems=mems, return_mems=True)
        current = prompts[:, full * size:]
        while True:
            if current.shape[1] == size:
                logits, new_mems = self.net(current, mems=mems, return_mems=True)
            else:
                with read_only(self.net):      # a partial segment reads the kNN memory; the full one writes it
                    logits = self.net(current, mems=mems)
            token = yield logits[:, -1]
            if current.shape[1] == size:
                mems, current = new_mems, token[:, None]
            else:
                current = torch.cat((current, token[:, None]), dim=1)
