"""Beam search over a cached decoder, with EOS handling and length normalisation (GNMT-style,
arXiv:1609.08144, in the plain `length ** alpha` form)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import checks
from ..wrappers import TransformerWrapper
from .decode import AutoregressiveWrapper, left_padded_positions
from .fast import fast_step
from .prompts import batch_prompts


@dataclass
class BeamResult:
    """tokens (b, seq_len): the best hypothesis per prompt, `pad_value` after its EOS.
    scores (b,): its normalised log-probability.
    beams (b, num_beams, seq_len), beam_scores (b, num_beams): the finished hypotheses, best first;
    slots no hypothesis reached hold `pad_value` and score -inf."""

    tokens: Tensor
    scores: Tensor
    beams: Tensor
    beam_scores: Tensor


def normalised(sum_logprob: float, length: int, length_penalty: float) -> float:
    """score = sum_logprob / length ** length_penalty."""
    return sum_logprob / length ** length_penalty


def best_possible(sum_logprob: Tensor, length: int, seq_len: int, length_penalty: float) -> Tensor:
    """Upper bound on the score of any hypothesis that extends a live beam of `length` tokens.

    Its log-probability sum can only fall (every term is <= 0) and its length lies in
    [length + 1, seq_len]; s / L ** alpha with s <= 0 is largest at L = seq_len for alpha > 0 and at
    L = length + 1 for alpha < 0. An exact bound, so stopping on it never changes the result.
    """
    longest = seq_len if length_penalty > 0 else length + 1
    return sum_logprob / longest ** length_penalty


class Hypotheses:
    """The best `num_beams` finished hypotheses of one prompt: (score, tokens (seq_len,))."""

    def __init__(self, num_beams: int):
        self.num_beams = num_beams
        self.items: list[tuple[float, Tensor]] = []

    def add(self, score: float, tokens: Tensor) -> None:
        self.items.append((score, tokens))
        self.items.sort(key=lambda item: -item[0])   # stable: an earlier hypothesis wins a tie
        del self.items[self.num_beams:]

    def settled(self, bound: float) -> bool:
        """Full, and no live beam can reach even the worst kept hypothesis."""
        return len(self.items) == self.num_beams and self.items[-1][0] >= bound


def _unwrap(net: nn.Module, pad_value: int | None) -> tuple[TransformerWrapper, int]:
    if isinstance(net, AutoregressiveWrapper):
        return net.net, net.pad_value if pad_value is None else pad_value
    if not isinstance(net, TransformerWrapper):
        raise TypeError(f"net must be a TransformerWrapper or an AutoregressiveWrapper, got {type(net).__name__}")
    if not net.attn_layers.causal:
        raise ValueError("beam search needs a causal stack (a Decoder)")
    return net, 0 if pad_value is None else pad_value


def _check(net: TransformerWrapper, prompts: Tensor, seq_len: int, num_beams: int, eos_token: int | None,
           length_penalty: float, mask: Tensor | None, pad_value: int) -> None:
    checks.token_ids(prompts, net.num_tokens, "prompts")
    b, n = prompts.shape
    for name, value in (("seq_len", seq_len), ("num_beams", num_beams)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if eos_token is not None and (not isinstance(eos_token, int) or not 0 <= eos_token < net.num_tokens):
        raise ValueError(f"eos_token must be a token id in [0, num_tokens={net.num_tokens}), got {eos_token!r}")
    if not isinstance(pad_value, int):
        raise ValueError(f"pad_value must be an integer token id, got {pad_value!r}")
    if not isinstance(length_penalty, (int, float)) or not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if mask is not None:
        checks.bool_mask("mask", mask, (b, n), "(batch, prompt_len)")
        if not bool(mask.any(dim=-1).all()):
            raise ValueError("mask leaves a prompt without any kept token")
    if net.bounded and n + seq_len - 1 > net.max_seq_len:
        raise ValueError(f"prompts ({n} tokens) + seq_len ({seq_len}) need {n + seq_len - 1} positions but the "
                         f"model's learned positions stop at max_seq_len={net.max_seq_len}")


@torch.no_grad()
def beam_search(net: nn.Module, prompts: Tensor, seq_len: int, num_beams: int, eos_token: int | None = None,
                length_penalty: float = 1.0, mask: Tensor | None = None, context: Tensor | None = None,
                context_mask: Tensor | None = None, pad_value: int | None = None) -> BeamResult:
    """The `num_beams` most likely continuations of each prompt, found by beam search on a decode state.

    A hypothesis of L generated tokens (its EOS included, nothing after it counted) scores
    sum(log p) / L ** length_penalty: 0 ranks by plain log-probability, > 0 favours longer ones.

    Each step scores every live beam x every token, keeps the 2 * num_beams best candidates, files
    those ending in `eos_token` among the first num_beams as finished hypotheses and continues with
    the num_beams best that do not end in it (so there are always num_beams live beams). A prompt is
    settled once it holds num_beams finished hypotheses that no live beam can still beat (exact
    bound, see `best_possible`); the search stops when every prompt is settled or after seq_len
    tokens, when the live beams become hypotheses of length seq_len. With num_beams=1 and
    length_penalty=0 (or no eos_token) this is greedy decoding.

    Args:
        net: a `TransformerWrapper` with a causal stack, or an `AutoregressiveWrapper` around one.
        prompts: (b, n) token ids, left-padded when `mask` is given.
        seq_len: most tokens to generate.
        num_beams: beams kept per prompt (>= 1).
        eos_token: id that ends a hypothesis; None: every hypothesis has seq_len tokens.
        length_penalty: the exponent alpha above.
        mask: (b, n) bool, True = keep: left padding; each row's positions start at its first token.
        context, context_mask: (b, m, dim_context), (b, m) for cross-attention.
        pad_value: fills a hypothesis after its EOS; default the AutoregressiveWrapper's, else 0.

    Returns:
        `BeamResult` (tokens (b, seq_len), scores (b,), beams (b, num_beams, seq_len), beam_scores).
    """
    net, pad_value = _unwrap(net, pad_value)
    _check(net, prompts, seq_len, num_beams, eos_token, length_penalty, mask, pad_value)
    was_training = net.training
    net.eval()
    try:
        return _search(net, prompts, seq_len, num_beams, eos_token, float(length_penalty), mask, context,
                       context_mask, pad_value)
    finally:
        net.train(was_training)


def _search(net: TransformerWrapper, prompts: Tensor, seq_len: int, k: int, eos_token: int | None,
            alpha: float, mask: Tensor | None, context: Tensor | None, context_mask: Tensor | None,
            pad_value: int) -> BeamResult:
    b, n = prompts.shape
    device = prompts.device
    state = net.new_state(b, n + seq_len - 1)      # the last generated token is never fed back
    step = fast_step(net) or net                   # one-token steps without the module tree
    logits = net(prompts, mask=mask, pos=left_padded_positions(mask), context=context,
                 context_mask=context_mask, state=state)[:, -1]
    rows = torch.arange(b, device=device).repeat_interleave(k)    # prompt once, then one row per beam
    state.reorder(rows)
    if context is not None:
        context = context.index_select(0, rows)
        context_mask = context_mask.index_select(0, rows) if context_mask is not None else None
    logprobs = logits.float().log_softmax(dim=-1).index_select(0, rows)     # float32 scores, (b*k, v)
    vocab = logprobs.shape[-1]

    live = torch.full((b, k), float("-inf"), device=device)
    live[:, 0] = 0.0              # the k copies of a prompt are one beam until the first step
    seqs = prompts.new_full((b, k, seq_len), pad_value)
    finished = [Hypotheses(k) for _ in range(b)]
    settled = [False] * b
    width = min(2 * k, k * vocab)
    for t in range(seq_len):
        candidates = (live[..., None] + logprobs.view(b, k, vocab)).view(b, k * vocab)
        values, flat = candidates.topk(width, dim=-1)                          # (b, width), best first
        parent, token = flat // vocab, flat % vocab
        ends = token == eos_token if eos_token is not None else torch.zeros_like(token, dtype=torch.bool)
        new = ends[:, :k] & values[:, :k].isfinite()
        for r, j in new.nonzero().tolist():
            if not settled[r]:
                hypothesis = seqs[r, parent[r, j]].clone()
                hypothesis[t] = eos_token
                finished[r].add(normalised(float(values[r, j]), t + 1, alpha), hypothesis)
        live, pick = values.masked_fill(ends, float("-inf")).topk(k, dim=-1)   # (b, k)
        parent, token = parent.gather(1, pick), token.gather(1, pick)
        seqs = seqs.gather(1, parent[..., None].expand(-1, -1, seq_len))
        seqs[:, :, t] = token
        if t == seq_len - 1:
            break
        bound = best_possible(live.amax(dim=-1), t + 1, seq_len, alpha).tolist()
        settled = [s or finished[r].settled(bound[r]) for r, s in enumerate(settled)]
        if all(settled):
            break
        state.reorder((torch.arange(b, device=device)[:, None] * k + parent).view(-1))
        logits = step(token.view(b * k, 1), context=context, context_mask=context_mask, state=state)[:, -1]
        logprobs = logits.float().log_softmax(dim=-1)

    for r in range(b):
        if settled[r]:
            continue
        for j in range(k):
            if math.isfinite(float(live[r, j])):
                finished[r].add(normalised(float(live[r, j]), seq_len, alpha), seqs[r, j].clone())

    beams = prompts.new_full((b, k, seq_len), pad_value)
    beam_scores = torch.full((b, k), float("-inf"), device=device)
    for r, hyps in enumerate(finished):
        for j, (score, tokens) in enumerate(hyps.items):
            beams[r, j], beam_scores[r, j] = tokens, score
    return BeamResult(tokens=beams[:, 0].clone(), scores=beam_scores[:, 0].clone(), beams=beams,
                      beam_scores=beam_scores)


def beam_method(wrapper: AutoregressiveWrapper, prompts: Tensor | list[Tensor], seq_len: int, beams: int = 4,
                return_beams_and_scores: bool = False, eos_token: int | None = None, temperature: float = 1.0,
                stochastic: bool = False, prompt_lens: Tensor | None = None, filter_logits_fn=None,
                restrict_to_max_seq_len: bool | None = None, filter_kwargs: dict | None = None,
                cache_kv: bool = True, length_penalty: float = 0.0, mask: Tensor | None = None,
                context: Tensor | None = None, context_mask: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """`AutoregressiveWrapper.beam_search`, x-transformers' call, on `beam_search` above.

    Returns the best hypothesis (b, seq_len) ((seq_len,) for one (n,) prompt), or with
    `return_beams_and_scores` (hypotheses (beams, b, seq_len), scores (beams, b)), best first. The
    default length_penalty 0 scores a hypothesis by its summed log-probability, as x-transformers does.
    Stochastic (Gumbel) beam search is not built: stochastic, temperature and the filters, which only
    it reads, must keep their defaults. It always decodes on a decode state (cache_kv=True) and keeps
    the whole sequence as context (restrict_to_max_seq_len=True is refused when that would drop any)."""
    sampling = dict(stochastic=(stochastic, False), temperature=(temperature, 1.0),
                    filter_logits_fn=(filter_logits_fn, None), filter_kwargs=(filter_kwargs or None, None),
                    cache_kv=(cache_kv, True))
    clash = [name for name, (value, default) in sampling.items() if value is not default and value != default]
    if clash:
        raise ValueError(f"beam_search is deterministic beam search on a decode state; it does not take {clash} "
                         "(stochastic beam search is not built)")
    prompts, mask, single = batch_prompts(prompts, mask, prompt_lens, wrapper.pad_value)
    n, limit = prompts.shape[1], wrapper.max_seq_len
    if restrict_to_max_seq_len is True and n + seq_len - 1 > limit:
        raise ValueError(f"restrict_to_max_seq_len=True: beam search keeps all {n + seq_len - 1} tokens as context, "
                         f"past max_seq_len={limit}; pass restrict_to_max_seq_len=False (relative positions) or "
                         "a shorter prompt / seq_len")
    result = beam_search(wrapper, prompts, seq_len, beams, eos_token=eos_token, length_penalty=length_penalty,
                         mask=mask, context=context, context_mask=context_mask)
    if not return_beams_and_scores:
        return result.tokens[0] if single else result.tokens
    hypotheses, scores = result.beams.transpose(0, 1), result.beam_scores.transpose(0, 1)
    return (hypotheses[:, 0], scores[:, 0]) if single else (hypotheses, scores)
