"""Generation with early exit (CALM, arXiv:2207.07061; the policy is `polyformer/early_exit.py`): the prompt
runs the whole stack, then every new token stops at its first confident exit layer, the skipped layers'
keys / values of its position computed from the exited state, and the step's logits are the shared head's
at that layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .. import checks
from ..early_exit import EarlyExit
from ..interfaces import Context
from ..memory.kv_cache import DecodeState
from ..precision import upcast
from ..wrappers import TransformerWrapper
from . import plan
from .decode import AutoregressiveWrapper, left_padded_positions, sample_steps
from .exit_rows import ExitRows
from .fast import FastStep
from .sampling import Sampler


@dataclass
class ExitGeneration:
    """tokens (b, seq_len); layers (b, seq_len): how many layers ran for the step whose logits chose each token
    (the first token's come from the prompt, which runs every layer); depth: the stack's layers."""

    tokens: Tensor
    layers: Tensor
    depth: int

    @property
    def mean_layers(self) -> float:
        """Layers run per generated token, on average (tokens after eos_token, which ran none, left out)."""
        ran = self.layers[self.layers > 0]
        return float(ran.float().mean()) if ran.numel() else float("nan")


class ExitStep(FastStep):
    """The fast one-token step (fast.py) under the exit policy at `threshold`; `layers` (b, 1): where each row
    stopped on the last call. Over the default plan's rows (`exit_rows.ExitRows`: one call per block, the
    confidence on the row buffer, the skipped layers' keys / values through the plan's products) when the
    step has one, else the tuned blocks layer by layer with a skipped layer's keys / values written from the
    exit state. Threshold 1 runs the plain step: no confidence is above 1. Equal to the module path
    (`EarlyExit.decoding`) up to the fast step's float rounding; when every row exits at one layer with
    softmax_margin, the step's logits are the ones its confidence computed."""

    def __init__(self, net: TransformerWrapper, exits: EarlyExit, threshold: float):
        super().__init__(net, tuned=True)
        self.exits, self.threshold, self.block_modules = exits, threshold, tuple(net.attn_layers.blocks)
        self.walk_rows = ExitRows(self.rows, exits, plan.layout_for(net)) if self.rows is not None else None
        self.exit_norm, self.exit_head = self.final_norm, self.head
        if self.final_norm is not None:
            self.final_norm = lambda h: h if self.exited is not None else self.exit_norm(h)
        self.head = self._head
        self.exited: Tensor | None = None       # this step's logits, made by its confidence
        self.layers: Tensor | None = None

    def _head(self, f: Tensor) -> Tensor:
        logits, self.exited = self.exited, None
        return logits if logits is not None else self.exit_head(f)

    def run(self, h: Tensor, pos: Tensor, state: DecodeState, keep: Tensor | None, bias: Tensor | None,
            masks: Callable) -> Tensor:
        exits, stack = self.exits, self.net.attn_layers
        self.exited = None
        if self.threshold >= 1:
            self.layers = torch.full((h.shape[0], 1), exits.depth, dtype=torch.long, device=h.device)
            return super().run(h, pos, state, keep, bias, masks)
        if self.walk_rows is not None and self.rows.takes(h):
            made: list[Tensor] = []

            def confidence(x: Tensor, before: Tensor, layer: int) -> list[float]:
                if exits.measure != "softmax_margin":
                    return exits.confidence(stack, x, before, layer, self.exit_head).tolist()
                made.append(self.exit_head(self.exit_norm(x) if self.exit_norm is not None else x))
                return [p1 - p2 for p1, p2 in upcast(made[-1]).softmax(-1).topk(2, dim=-1).values.tolist()]

            h, self.layers, at = self.walk_rows(h, pos, state, keep, bias, confidence, self.threshold)
            if at is not None and made:
                self.exited = made[-1][:, None]
            return h
        prev = [None]

        def block_out(block: Any, x: Tensor) -> Tensor:
            x, scores = block(x, pos, state, masks, prev[0])
            if block.attention:
                prev[0] = scores
            return x

        def skip(layer: int, x: Tensor) -> None:
            blocks = self.block_modules[layer * exits.unit: (layer + 1) * exits.unit]
            exits.propagate(blocks, x, Context(pos=pos, causal=True, state=state))

        h, self.layers = exits.walk(h, self.blocks, block_out, skip,
                                    lambda x, before, layer: exits.confidence(stack, x, before, layer, self.exit_head),
                                    self.threshold)
        return h


def policy(net: TransformerWrapper) -> EarlyExit:
    """The early-exit policy of a TransformerWrapper's stack; refused by name when it has none."""
    found = getattr(net.attn_layers, "early_exit", None)
    if not isinstance(found, EarlyExit):
        raise ValueError("early-exit generation needs a model built with exit_layers (on its Decoder)")
    return found


@torch.no_grad()
def generate(model: nn.Module, prompts: Tensor, seq_len: int, threshold: float | None = None,
             temperature: float = 0.0, filter_logits_fn: Callable | list | None = None,
             filter_kwargs: dict | list | None = None, eos_token: int | None = None, mask: Tensor | None = None,
             context: Tensor | None = None, context_mask: Tensor | None = None,
             generator: torch.Generator | None = None, pad_value: int = 0) -> ExitGeneration:
    """`seq_len` tokens after `prompts` (b, n) with early exit, cached through a decode state.

    Args:
        model: a TransformerWrapper with exit_layers on its Decoder, or an AutoregressiveWrapper of one.
        threshold: a token exits where its confidence (exit_confidence) is above it; None: exit_threshold.
            1 never exits: the tokens and logits are the full model's.
        temperature, filter_logits_fn, filter_kwargs, eos_token, mask, context, context_mask, generator:
            as `AutoregressiveWrapper.generate` (temperature 0: greedy, the default here).
    """
    net = model.net if isinstance(model, AutoregressiveWrapper) else model
    if not isinstance(net, TransformerWrapper):
        raise TypeError(f"model must be a TransformerWrapper or an AutoregressiveWrapper, got {type(model).__name__}")
    exits = policy(net)
    checks.token_ids(prompts, net.num_tokens, "prompts")
    b, n = prompts.shape
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if net.bounded and n + seq_len > net.max_seq_len:
        raise ValueError(f"prompts of {n} tokens and {seq_len} new ones exceed max_seq_len={net.max_seq_len}")
    if mask is not None:
        checks.bool_mask("mask", mask, (b, n), "(batch, prompt_len)")
    sampler = Sampler(temperature, filter_logits_fn, filter_kwargs, 1.0, generator)
    sampler.check(net.num_tokens)
    threshold = exits.checked(threshold)         # the threshold and the classifier, before any compute
    used: list[Tensor] = []

    def steps():
        state = net.new_state(b, n + seq_len)
        logits = net(prompts, mask=mask, pos=left_padded_positions(mask), state=state, context=context,
                     context_mask=context_mask)[:, -1]
        used.append(torch.full((b,), exits.depth, dtype=torch.long, device=prompts.device))
        fast = ExitStep(net, exits, threshold) if FastStep.unsupported(net) is None else None
        while True:
            token = yield logits
            if fast is not None:
                logits = fast(token[:, None], state=state, context=context, context_mask=context_mask)[:, -1]
                used.append(fast.layers[:, -1])
                continue
            with exits.decoding(net.head, threshold) as run:
                logits = net(token[:, None], state=state, context=context, context_mask=context_mask)[:, -1]
            used.append(run.layers[:, -1])

    was_training = net.training
    net.eval()
    try:
        tokens = torch.stack(list(sample_steps(steps(), sampler, seq_len, eos_token, pad_value, None, True)), dim=1)
    finally:
        net.train(was_training)
    layers = torch.stack(used[:seq_len], dim=1)     # rows past eos_token: 0
    layers = torch.nn.functional.pad(layers, (0, seq_len - layers.shape[1]))
    return ExitGeneration(tokens, layers, exits.depth)
