"""Speculative decoding: a small draft model proposes `gamma` tokens one cached step at a time, the
target scores them all in one cached forward, and an accept / resample rule keeps a prefix so that
every row is distributed exactly as the target's own sampling (arXiv:2211.17192, arXiv:2302.01318)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from .. import checks
from ..wrappers import TransformerWrapper
from .decode import AutoregressiveWrapper, left_padded_positions
from .fast import fast_step
from .sampling import Sampler


@dataclass
class SpeculativeResult:
    """tokens (b, seq_len), rows past `eos_token` padded. acceptance_rate: draft tokens that entered
    the output / draft tokens proposed (nan when none were proposed). tokens_per_target_call:
    generated positions / target forwards, the prompt's included, so plain decoding scores 1.0."""

    tokens: Tensor
    acceptance_rate: float
    tokens_per_target_call: float
    target_calls: int
    draft_calls: int
    accepted: int
    proposed: int


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """(b, v) -> (b,) one token per row."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def accept_draft(p: Tensor, q: Tensor, x: Tensor, generator: torch.Generator | None) -> Tensor:
    """Keep draft token x (...,) drawn from q (..., v) with probability min(1, p(x) / q(x)); with
    one-hot (greedy) p and q this is x == argmax p. Returns (...,) bool."""
    p_x = p.gather(-1, x[..., None]).squeeze(-1)
    q_x = q.gather(-1, x[..., None]).squeeze(-1)
    u = torch.rand(x.shape, generator=generator, device=x.device)
    return u * q_x < p_x                                # u < p/q, and q(x) > 0 since x was drawn from q


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)): where to draw after a rejection (p where p <= q everywhere)."""
    r = (p - q).clamp(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


class CachedModel:
    """One model's decode state during speculation: `unseen` are committed tokens its cache has not
    taken yet, `fed` the speculative tokens it holds beyond the committed ones."""

    def __init__(self, net: TransformerWrapper, prompts: Tensor, mask: Tensor | None, max_len: int, history: int):
        self.net = net
        self.fast = fast_step(net)            # one-token steps (the draft's) without the module tree
        # recurrent layers keep the summaries of the last `history` positions: a round's rejects roll back
        self.state = net.new_state(prompts.shape[0], max_len, history=history)
        self.last = net(prompts, mask=mask, pos=left_padded_positions(mask), state=self.state)[:, -1:]
        self.unseen = prompts[:, :0]
        self.fed = 0
        self.calls = 1

    def run(self, tokens: Tensor | None = None) -> Tensor:
        """Take `tokens` (b, m) after everything committed; logits (b, m + 1, v), where [:, j]
        predicts the token after the first j of them."""
        tokens = self.unseen[:, :0] if tokens is None else tokens
        x = torch.cat((self.unseen, tokens), dim=1)
        if x.shape[1] == 0:
            return self.last
        out = (self.fast if self.fast is not None and x.shape[1] == 1 else self.net)(x, state=self.state)
        self.calls += 1
        u = self.unseen.shape[1]
        logits = torch.cat((self.last, out), dim=1) if u == 0 else out[:, u - 1:]
        self.unseen, self.fed, self.last = x[:, :0], self.fed + tokens.shape[1], out[:, -1:]
        return logits

    def commit(self, tokens: Tensor) -> None:
        """The round committed tokens (b, n + 1): n draft tokens shared by every row, then one token
        per row. Drop the rejected positions; the rest waits for the next `run`."""
        keep = min(self.fed, tokens.shape[1] - 1)
        self.state.rollback(self.fed - keep)
        self.unseen = torch.cat((self.unseen, tokens[:, keep:]), dim=1)
        self.fed = 0


def propose(draft: CachedModel, k: int, sampler: Sampler) -> tuple[Tensor, Tensor]:
    """k draft tokens (b, k), one cached step each, with the distributions they came from (b, k, v)."""
    if k == 0:
        b, v = draft.last.shape[0], draft.last.shape[-1]
        return draft.unseen.new_zeros(b, 0), draft.last.new_zeros(b, 0, v)
    logits = draft.run()[:, -1]
    xs, qs = [], []
    for i in range(k):
        qs.append(sampler.probs(logits))
        xs.append(draw(qs[-1], sampler.generator))
        if i < k - 1:
            logits = draft.run(xs[-1][:, None])[:, -1]
    return torch.stack(xs, dim=1), torch.stack(qs, dim=1)


def verify(p: Tensor, q: Tensor, x: Tensor, done: Tensor, generator: torch.Generator | None
           ) -> tuple[Tensor, Tensor]:
    """Target distributions p (b, k + 1, v) against drafts x (b, k) from q (b, k, v).

    All rows share one cache length, so the round keeps n = the fewest leading accepted drafts over
    the rows still running, then one token per row: its accepted draft x[:, n] where it accepted
    past n, a draw from norm(max(0, p - q)) where it rejected x[:, n], a bonus draw from p[:, k] when
    n == k. Each token is then distributed as the target given the row's prefix, and stopping
    early only truncates. Returns tokens (b, n + 1) and each row's drafts among them (b,).
    """
    k = x.shape[1]
    if k == 0:
        return draw(p[:, 0], generator)[:, None], torch.zeros_like(done, dtype=torch.long)
    ok = accept_draft(p[:, :k], q, x, generator)                 # (b, k)
    run = ok.long().cumprod(dim=1).sum(dim=1)                    # (b,) leading accepted drafts
    n = int(run.masked_fill(done, k).min())
    if n < k:
        last = torch.where(run > n, x[:, n], draw(residual(p[:, n], q[:, n]), generator))
    else:
        last = draw(p[:, k], generator)
    return torch.cat((x[:, :n], last[:, None]), dim=1), n + (run > n).long()


def _unwrap(model: object, name: str) -> TransformerWrapper:
    net = model.net if isinstance(model, AutoregressiveWrapper) else model
    if not isinstance(net, TransformerWrapper):
        raise TypeError(f"{name} must be a TransformerWrapper or AutoregressiveWrapper, got {type(model).__name__}")
    if not net.attn_layers.causal:
        raise ValueError(f"{name} needs a causal stack (a Decoder)")
    if "c" in net.attn_layers.layout:
        raise ValueError(f"{name} has cross-attention blocks; speculative_generate takes no context")
    if net.landmarks is not None or net.interspersed is not None:
        raise ValueError(f"{name} places tokens of its own between the text's (landmark_block / "
                         "memory_tokens_interspersed_every): a rollback of rejected tokens cannot count them")
    return net


def _check_positions(net: TransformerWrapper, name: str, n: int, seq_len: int) -> None:
    if not net.bounded:
        return
    if n > net.max_seq_len:
        raise ValueError(f"prompts have {n} tokens but the {name}'s learned positions stop at "
                         f"max_seq_len={net.max_seq_len}")
    if n + seq_len - 1 > net.max_seq_len:
        raise ValueError(f"seq_len={seq_len} after {n} prompt tokens needs {n + seq_len - 1} positions but the "
                         f"{name}'s learned positions stop at max_seq_len={net.max_seq_len}")


@torch.no_grad()
def speculative_generate(target: nn.Module, draft: nn.Module, prompts: Tensor, seq_len: int, gamma: int = 4,
                         temperature: float = 1.0, filter_logits_fn: Callable | list | None = None,
                         filter_kwargs: dict | list | None = None, eos_token: int | None = None,
                         mask: Tensor | None = None, generator: torch.Generator | None = None
                         ) -> SpeculativeResult:
    """Sample `seq_len` tokens after `prompts` from `target`, with `draft` proposing `gamma` at a time.

    Greedy (temperature 0) returns exactly the target's greedy output; sampling leaves the target's
    distribution (after the same filters and temperature) unchanged. The target sees the whole
    context: past `max_seq_len` (possible without learned positions) `generate` slides a window over
    its cache instead, so there the two part.

    Args:
        target, draft: `TransformerWrapper`s (or `AutoregressiveWrapper`s) with causal stacks and
            the same `num_tokens`.
        prompts: (b, n) token ids; mask: (b, n) bool for left-padded prompts, as in `generate`.
        seq_len: tokens to generate per row; gamma: draft tokens proposed per target forward.
        temperature, filter_logits_fn, filter_kwargs: as in `AutoregressiveWrapper.generate`.
        eos_token: a row that produced it continues with the target's `pad_value` (0 for a bare
            `TransformerWrapper`).

    Returns a `SpeculativeResult` with tokens (b, seq_len) and the acceptance and call counts.
    """
    target_net, draft_net = _unwrap(target, "target"), _unwrap(draft, "draft")
    if draft_net.num_tokens != target_net.num_tokens:
        raise ValueError(f"draft has num_tokens={draft_net.num_tokens} but target has "
                         f"num_tokens={target_net.num_tokens}: they must share one vocabulary")
    checks.token_ids(prompts, target_net.num_tokens, "prompts")
    b, n = prompts.shape
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
    if mask is not None:
        checks.bool_mask("mask", mask, (b, n), "(batch, prompt_len)")
        if not bool(mask.any(dim=-1).all()):
            raise ValueError("mask leaves a prompt without any kept token")
    for net, name in ((target_net, "target"), (draft_net, "draft")):
        _check_positions(net, name, n, seq_len)
    sampler = Sampler(temperature, filter_logits_fn, filter_kwargs, generator=generator)
    sampler.check(target_net.num_tokens)
    pad_value = target.pad_value if isinstance(target, AutoregressiveWrapper) else 0

    modes = [(net, net.training) for net in (target_net, draft_net)]
    for net, _ in modes:
        net.eval()
    try:
        target_run = CachedModel(target_net, prompts, mask, n + seq_len, history=gamma + 1)
        draft_run = CachedModel(draft_net, prompts, mask, n + seq_len, history=gamma + 1)
        out = prompts.new_full((b, seq_len), pad_value)
        done = torch.zeros(b, dtype=torch.bool, device=prompts.device)
        t = accepted = proposed = 0
        while t < seq_len and not (eos_token is not None and bool(done.all())):
            k = min(gamma, seq_len - t - 1)            # a round adds at most k + 1 tokens
            x, q = propose(draft_run, k, sampler)
            p = sampler.probs(target_run.run(x))  # (b, k + 1, v): one target forward
            tokens, kept = verify(p, q, x, done, generator)
            target_run.commit(tokens)
            draft_run.commit(tokens)
            proposed += k * int((~done).sum())
            accepted += int(kept[~done].sum())
            for token in tokens.unbind(dim=1):
                if eos_token is not None:
                    token = token.masked_fill(done, pad_value)
                    done |= token == eos_token
                out[:, t] = token
                t += 1
    finally:
        for net, mode in modes:
            net.train(mode)
    return SpeculativeResult(tokens=out, acceptance_rate=accepted / proposed if proposed else math.nan,
                             tokens_per_target_call=t / target_run.calls, target_calls=target_run.calls,
                             draft_calls=draft_run.calls, accepted=accepted, proposed=proposed)
