"""`AutoregressiveWrapper`: next-token loss, and generation as a thin loop over a decode state."""

from __future__ import annotations

import warnings
from contextlib import ExitStack
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks
from ..early_exit import next_token_loss
from ..losses import AuxLosses, with_aux
from ..attention import z_loss
from ..attention.knn_memory import read_only
from ..memory.kv_cache import DecodeState
from ..wrappers import TransformerWrapper
from . import forgetful
from .contrastive import amateur_wrappers, contrastive_steps, options
from .fast import fast_step
from .prompts import batch_prompts
from .restrict import check_restrict, state_len
from .sampling import Sampler


def left_padded_positions(mask: Tensor | None) -> Tensor | None:
    """Per-row positions that start at each row's first kept token: (b, n), or None for no mask."""
    if mask is None:
        return None
    return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def sample_steps(steps, sampler: Sampler, seq_len: int, eos_token: int | None, pad_value: int,
                 seen: Tensor | None, pad_to_length: bool) -> Iterator[Tensor]:
    """Drive a step generator (yields next-token logits (b, v), is sent each chosen token): yields
    tokens (b,); rows past `eos_token` get `pad_value`; stops at seq_len or when all rows ended."""
    logits = next(steps)
    b = logits.shape[0]
    done = torch.zeros(b, dtype=torch.bool, device=logits.device)
    produced = 0
    while True:
        token = sampler(logits, seen)
        if eos_token is not None:
            token = token.masked_fill(done, pad_value)
            done |= token == eos_token
        if seen is not None:
            seen.scatter_(1, token[:, None], True)
        produced += 1
        yield token
        if produced == seq_len or (eos_token is not None and bool(done.all())):
            break
        logits = steps.send(token)
    if pad_to_length:
        for _ in range(seq_len - produced):
            yield torch.full((b,), pad_value, dtype=torch.long, device=logits.device)


class AutoregressiveWrapper(nn.Module):
    """Wraps a `TransformerWrapper` with a causal stack.

    forward(x (b, n), mask=None, context=None, context_mask=None) -> mean next-token cross-entropy
    of predicting x[:, 1:] from x[:, :-1]. `mask` controls attention, `ignore_index` controls the
    loss: targets equal to ignore_index do not count (a warning says when a masked position's
    target still counts). `mask_prob` > 0: forgetful causal masking while training (`generate.forgetful`).
    """

    def __init__(self, net: TransformerWrapper, ignore_index: int = -100, pad_value: int = 0, mask_prob: float = 0.0,
                 add_attn_z_loss: bool = False):
        super().__init__()
        if not isinstance(net, TransformerWrapper):
            raise TypeError(f"AutoregressiveWrapper wraps a TransformerWrapper, got {type(net).__name__}")
        if not net.attn_layers.causal:
            raise ValueError("AutoregressiveWrapper needs a causal stack (a Decoder)")
        self.net = net
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self.mask_prob = forgetful.check(mask_prob, net.attn_layers)
        if not isinstance(add_attn_z_loss, bool):
            raise TypeError(f"AutoregressiveWrapper: add_attn_z_loss must be True or False, got {add_attn_z_loss!r}")
        if add_attn_z_loss:         # the attention z-loss joins the loss (attention/z_loss.py)
            z_loss.check("AutoregressiveWrapper", net.attn_layers)
            if net.attn_layers.early_exit is not None:
                raise ValueError("AutoregressiveWrapper: add_attn_z_loss cannot combine with exit_layers (the exits' "
                                 "loss runs its own forward); give the stack attn_z_loss_weight instead")
        self.add_attn_z_loss = add_attn_z_loss
        self.max_seq_len = net.max_seq_len
        self._compiled: dict[object, nn.Module] = {}   # backend -> compiled net; a dict keeps it out of state_dict

    def forward(self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None,
                context_mask: Tensor | None = None, return_losses: bool = False) -> Tensor | tuple[Tensor, AuxLosses]:
        """The next-token loss, plus the weighted auxiliary losses the blocks report (losses.py);
        with `return_losses`, (that loss, the `AuxLosses` record) for logging each term."""
        if x.ndim != 2 or x.shape[1] < 2:
            raise ValueError(f"x must have shape (batch, seq) with seq >= 2, got {tuple(x.shape)}")
        inp, target = x[:, :-1], x[:, 1:]
        if mask is not None:
            checks.bool_mask("mask", mask, tuple(x.shape), "(batch, seq)")
            counted = ~mask[:, 1:] & (target != self.ignore_index)
            if bool(counted.any()):
                warnings.warn("mask hides positions whose targets still count in the loss; set those "
                              f"targets to ignore_index={self.ignore_index} to leave them out", stacklevel=2)
            mask = mask[:, :-1]
        hidden = {}
        if self.mask_prob > 0 and self.training:
            hidden["attn_mask"] = forgetful.attn_mask(forgetful.hidden_keys(*inp.shape, self.mask_prob, inp.device))
        exited = next_token_loss(self.net, inp, target, self.ignore_index, mask=mask, context=context,
                                 context_mask=context_mask, **hidden)    # exit_layers (early_exit.py): the exits' weighted mean
        if exited is not None:
            return exited if return_losses else exited[0]
        logits, aux = z_loss.with_losses(self.net, self.add_attn_z_loss, inp, mask=mask, context=context,
                                         context_mask=context_mask, **hidden)
        loss = with_aux(F.cross_entropy(logits.transpose(1, 2), target, ignore_index=self.ignore_index), aux)
        return (loss, aux) if return_losses else loss

    @torch.no_grad()
    def generate(self, prompts: Tensor | list[Tensor], seq_len: int, eos_token: int | None = None,
                 temperature: float = 1.0, filter_logits_fn: Callable | str | list | None = None,
                 filter_kwargs: dict | list | None = None, cache_kv: bool = True,
                 mask: Tensor | None = None, context: Tensor | None = None,
                 context_mask: Tensor | None = None, repetition_penalty: float = 1.0,
                 state: DecodeState | None = None, generator: torch.Generator | None = None,
                 num_beams: int = 1, length_penalty: float = 1.0, compile: bool | str | Callable = False,
                 prompt_lens: Tensor | None = None, restrict_to_max_seq_len: bool | None = None,
                 amateur_model: nn.Module | list | tuple | None = None,
                 contrastive_decode_kwargs: dict | list | tuple | None = None) -> Tensor:
        """Sample `seq_len` tokens after `prompts` (b, n); returns (b, seq_len) ((seq_len,) for one
        (n,) prompt).

        Args:
            prompts: (b, n) token ids; with `mask` (b, n) bool, left-padded prompts of different
                lengths: each row's positions start at its first kept token, so a row generates
                exactly what its prompt alone would. Also a list of 1-D prompts of any lengths, or
                right-padded prompts with `prompt_lens` (b,) (both become left-padded with a mask).
            temperature: 0 is greedy.
            filter_logits_fn / filter_kwargs: one filter (`top_k`, `top_p`, `top_a`, `min_p`, as a
                callable or by name) or a list, applied in order after the repetition penalty.
            restrict_to_max_seq_len: True: the context at every step is exactly the last
                max_seq_len tokens; False: every token; None: see `state` below (`generate.restrict`).
            amateur_model / contrastive_decode_kwargs: contrastive decoding (`generate.contrastive`)
                against one amateur model or a list, with `alpha` and `beta` (one dict, or one each).
            eos_token: a row that produced it continues with `pad_value`.
            cache_kv: run each step on the new token only, against a preallocated decode state.
            state: a decode state to continue (see `new_state`); it holds every token fed so far.
                The last generated token is not in it yet, so a continuation passes that token
                (and any new text) as its `prompts`: two calls that carry the state equal one
                longer call. Without learned absolute positions a full state slides: the oldest
                positions (after memory tokens) leave the window.
            num_beams: > 1 runs beam search (`generate.beam.beam_search`) instead of sampling, with
                `length_penalty`; sampling arguments must then keep their defaults.
            compile: run the one-token decode steps through `torch.compile` (True: the default
                inductor backend; or a backend, by name such as "aot_eager" or as a callable). The
                prompt runs eagerly; the first call pays the compile time, later calls reuse it.
                Needs cache_kv=True.
        """
        if num_beams != 1:
            sampling = dict(temperature=(temperature, 1.0), filter_logits_fn=(filter_logits_fn, None),
                            repetition_penalty=(repetition_penalty, 1.0), state=(state, None),
                            cache_kv=(cache_kv, True), generator=(generator, None), compile=(compile, False),
                            amateur_model=(amateur_model, None),
                            contrastive_decode_kwargs=(contrastive_decode_kwargs, None))
            clash = [name for name, (value, default) in sampling.items() if value is not default and value != default]
            if clash:
                raise ValueError(f"num_beams={num_beams} runs beam search, which does not take {clash}")
            from .beam import beam_method

            return beam_method(self, prompts, seq_len, num_beams, False, eos_token, length_penalty=length_penalty,
                               mask=mask, context=context, context_mask=context_mask, prompt_lens=prompt_lens,
                               restrict_to_max_seq_len=restrict_to_max_seq_len)
        return torch.stack(list(self.stream(
            prompts, seq_len, eos_token=eos_token, temperature=temperature, filter_logits_fn=filter_logits_fn,
            filter_kwargs=filter_kwargs, cache_kv=cache_kv, mask=mask, context=context,
            context_mask=context_mask, repetition_penalty=repetition_penalty, state=state,
            generator=generator, pad_to_length=True, compile=compile, prompt_lens=prompt_lens,
            restrict_to_max_seq_len=restrict_to_max_seq_len, amateur_model=amateur_model,
            contrastive_decode_kwargs=contrastive_decode_kwargs)), dim=-1)

    def beam_search(self, prompts: Tensor, seq_len: int, beams: int = 4, return_beams_and_scores: bool = False,
                    eos_token: int | None = None, **kwargs) -> Tensor | tuple[Tensor, Tensor]:
        """x-transformers' beam search call on `generate.beam.beam_search`; see `beam.beam_method`."""
        from .beam import beam_method

        return beam_method(self, prompts, seq_len, beams, return_beams_and_scores, eos_token, **kwargs)

    @torch.no_grad()
    def stream(self, prompts: Tensor | list[Tensor], seq_len: int, eos_token: int | None = None,
               temperature: float = 1.0, filter_logits_fn: Callable | str | list | None = None,
               filter_kwargs: dict | list | None = None, cache_kv: bool = True, mask: Tensor | None = None,
               context: Tensor | None = None, context_mask: Tensor | None = None, repetition_penalty: float = 1.0,
               state: DecodeState | None = None, generator: torch.Generator | None = None,
               pad_to_length: bool = False, compile: bool | str | Callable = False,
               prompt_lens: Tensor | None = None, restrict_to_max_seq_len: bool | None = None,
               amateur_model: nn.Module | list | tuple | None = None,
               contrastive_decode_kwargs: dict | list | tuple | None = None) -> Iterator[Tensor]:
        """`generate`, one step at a time: yields each new (b,) token (a 0-d one for one (n,) prompt)
        as soon as it is chosen; stops early when every row has produced `eos_token` (unless pad_to_length)."""
        prompts, mask, single = batch_prompts(prompts, mask, prompt_lens, self.pad_value)
        checks.token_ids(prompts, self.net.num_tokens, "prompts")
        b, n = prompts.shape
        if not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        restrict = restrict_to_max_seq_len
        check_restrict(self, restrict, n, seq_len, cache_kv, state is not None)
        if mask is not None:
            checks.bool_mask("mask", mask, (b, n), "(batch, prompt_len)")
            if not bool(mask.any(dim=-1).all()):      # its first token would have no position to follow
                raise ValueError("mask leaves a prompt without any kept token")
        if self.net.bounded and n > self.max_seq_len and restrict is not True:
            raise ValueError(f"prompts have {n} tokens but the model's learned positions stop at "
                             f"max_seq_len={self.max_seq_len}")
        amateurs = amateur_wrappers(amateur_model, self) if amateur_model is not None else []
        if amateurs and (filter_logits_fn is not None or state is not None):
            raise ValueError("contrastive decoding (amateur_model) keeps the tokens its alpha finds plausible and "
                             "starts from the prompt: it takes no filter_logits_fn and no state")
        if not amateurs and contrastive_decode_kwargs is not None:
            raise ValueError("contrastive_decode_kwargs were given without an amateur_model")
        contrast = options(contrastive_decode_kwargs, len(amateurs)) if amateurs else []
        if state is not None and not cache_kv:
            raise ValueError("a decode state is only used with cache_kv=True")
        if compile is not False and not cache_kv:
            raise ValueError("compile compiles the cached decode step; it needs cache_kv=True")
        step_net = self.compiled_net(compile) if compile is not False else None
        sampler = Sampler(temperature, filter_logits_fn, filter_kwargs, repetition_penalty, generator)
        sampler.check(self.net.num_tokens)
        seen = None
        if repetition_penalty != 1.0:
            seen = torch.zeros(b, self.net.num_tokens, dtype=torch.bool, device=prompts.device)
            seen.scatter_(1, prompts, mask if mask is not None else True)

        models = [self, *amateurs]
        was_training = [model.net.training for model in models]
        try:
            with ExitStack() as stack:
                for model in models:
                    model.net.eval()
                    stack.enter_context(read_only(model.net))   # kNN memories are read, never written, here
                steps = self._steps(prompts, mask, seq_len, context, context_mask, state, step_net, cache_kv, restrict)
                if amateurs:
                    steps = contrastive_steps(steps, [amateur._steps(prompts, mask, seq_len, context, context_mask,
                                                                     cache_kv=cache_kv, restrict=restrict)
                                                      for amateur in amateurs], contrast)
                for token in sample_steps(steps, sampler, seq_len, eos_token, self.pad_value, seen, pad_to_length):
                    yield token[0] if single else token
        finally:
            for model, mode in zip(models, was_training):
                model.net.train(mode)

    def _steps(self, prompts: Tensor, mask: Tensor | None, seq_len: int, context: Tensor | None,
               context_mask: Tensor | None, state: DecodeState | None = None, step_net: nn.Module | None = None,
               cache_kv: bool = True, restrict: bool | None = None):
        """The step generator (`_cached` or `_recomputed`) for `cache_kv` and `restrict_to_max_seq_len`."""
        b, n = prompts.shape
        limit = self.max_seq_len
        if restrict is None:
            if cache_kv and (not self.net.bounded or n + seq_len <= limit or state is not None):
                return self._cached(prompts, mask, seq_len, context, context_mask, state, step_net)
            return self._recomputed(prompts, mask, context, context_mask, limit if self.net.bounded else None)
        check_restrict(self, restrict, n, seq_len, cache_kv, False)     # again for an amateur's own limits
        if not cache_kv:
            return self._recomputed(prompts, mask, context, context_mask, limit if restrict else None)
        if restrict:
            prompts, mask = prompts[:, -limit:], mask[:, -limit:] if mask is not None else None
        length = state_len(self, restrict, prompts.shape[1], seq_len)
        state = self.net.new_state(b, length) if length is not None else None
        return self._cached(prompts, mask, seq_len, context, context_mask, state, step_net, min_slide=1)

    def new_state(self, batch: int, max_len: int) -> DecodeState:
        return self.net.new_state(batch, max_len)

    def compiled_net(self, backend: bool | str | Callable = True) -> nn.Module:
        """`torch.compile(net)`, made once per backend (True: the default) and kept. It shares the
        net's parameters; a cached step through it traces one graph and recompiles at most once
        as the state fills (the fill becomes a symbolic size)."""
        if backend is False or not (isinstance(backend, (bool, str)) or callable(backend)):
            raise ValueError(f"compile must be True or a torch.compile backend (a name or a callable), got {backend!r}")
        name = "inductor" if backend is True else backend
        if name not in self._compiled:
            self._compiled[name] = torch.compile(self.net, backend=name)
        return self._compiled[name]

    def feed(self, x: Tensor, state: DecodeState, net: Callable | None = None, min_slide: int | None = None,
             **kwargs) -> Tensor:
        """Run new tokens x (b, n) against the state (through `net`, a callable like the model, when
        given); slide the window first when a relative-position model's state is full, by at least
        `min_slide` positions (default a quarter of it). A windowed model's state is a ring of its
        window (memory/window_state.py): it never fills."""
        room = state.max_len - state.length
        if x.shape[1] > room and not self.net.bounded:
            if self.net.attn_layers.window is not None:
                raise ValueError("a windowed model decodes on the ring state its new_state makes, not on a state "
                                 f"of {state.max_len} positions")
            keep = self.net.num_memory_tokens
            window = state.max_len - keep
            if x.shape[1] > window:
                raise ValueError(f"{x.shape[1]} new tokens do not fit a decode state of {window} positions")
            state.slide(max(x.shape[1] - room, window // 4 if min_slide is None else min_slide), keep=keep)
        return (net if net is not None else self.net)(x, state=state, **kwargs)

    def state_for(self, batch: int, prompt_len: int, seq_len: int) -> DecodeState:
        """A decode state for a prompt of prompt_len tokens and seq_len more: all of them, or for a
        model that slides (relative positions) at most max(prompt_len, max_seq_len), or for a
        windowed one a ring of its sinks and window alone (no rollback room)."""
        if self.net.attn_layers.window is not None:
            return self.net.new_state(batch, prompt_len + seq_len, history=0)
        length = prompt_len + seq_len
        if not self.net.bounded:
            length = min(length, max(prompt_len, self.max_seq_len))
        return self.net.new_state(batch, length)

    def _cached(self, prompts: Tensor, mask: Tensor | None, seq_len: int, context: Tensor | None,
                context_mask: Tensor | None, state: DecodeState | None, step_net: nn.Module | None = None,
                min_slide: int | None = None):
        """Yields next-token logits (b, v); is sent each chosen token. The one-token steps run
        through `step_net` (a compiled net) when given, else through the fast step
        (`generate.fast`) when it covers the model."""
        b, n = prompts.shape
        state = state if state is not None else self.state_for(b, n, seq_len)
        pos = left_padded_positions(mask) if state.length == 0 else None
        logits = self.feed(prompts, state, mask=mask, pos=pos, context=context, context_mask=context_mask,
                           min_slide=min_slide)[:, -1]
        if step_net is None:            # the same logits without the module tree's per-token costs
            step_net = fast_step(self.net)
        while True:
            token = yield logits
            logits = self.feed(token[:, None], state, step_net, min_slide, context=context,
                               context_mask=context_mask)[:, -1]

    def _recomputed(self, prompts: Tensor, mask: Tensor | None, context: Tensor | None,
                    context_mask: Tensor | None, limit: int | None):
        """Without a cache: every step runs the whole sequence, or its last `limit` tokens."""
        seq = prompts
        keep = mask if mask is not None else torch.ones_like(prompts, dtype=torch.bool)
        while True:
            window, window_keep = seq, keep
            if limit is not None:
                window, window_keep = seq[:, -limit:], keep[:, -limit:]
            logits = self.net(window, mask=window_keep, pos=left_padded_positions(window_keep),
                              context=context, context_mask=context_mask)[:, -1]
            token = yield logits
            seq = torch.cat((seq, token[:, None]), dim=1)
            keep = F.pad(keep, (0, 1), value=True)
