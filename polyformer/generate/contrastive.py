"""Contrastive decoding (Li et al. 2022, arXiv:2210.15097), in the logit form of O'Brien & Lewis 2023
(arXiv:2309.09117): a small "amateur" model's logits are subtracted from the expert's,

    (1 + beta) * expert - beta * amateur,

restricted to the tokens the expert itself finds plausible: probability >= alpha * its largest
probability (the rest get -inf). Each amateur decodes on its own decode state, fed the same tokens."""

from __future__ import annotations

import math
from typing import Generator, Iterator

from torch import Tensor, nn

OPTIONS = {"alpha": 0.1, "beta": 0.5}      # keywords of contrastive_decode_kwargs, with their defaults


def contrastive_logits(expert: Tensor, amateur: Tensor, alpha: float = 0.1, beta: float = 0.5) -> Tensor:
    """Next-token logits (b, v) of the expert and the amateur -> the contrasted logits (b, v), float32.

    A token's expert probability is below alpha times the largest exactly when its logit is below
    the largest logit + log(alpha), so the plausibility cut needs no softmax."""
    expert, amateur = expert.float(), amateur.float()
    implausible = expert < expert.amax(dim=-1, keepdim=True) + math.log(alpha)
    return ((1 + beta) * expert - beta * amateur).masked_fill(implausible, float("-inf"))


def options(kwargs: dict | list | tuple | None, amateurs: int) -> list[dict]:
    """`contrastive_decode_kwargs`: one dict, or one per amateur -> a full dict per amateur."""
    given = [{}] * amateurs if kwargs is None else [kwargs] * amateurs if isinstance(kwargs, dict) else list(kwargs)
    if len(given) != amateurs or not all(isinstance(kw, dict) for kw in given):
        raise ValueError(f"contrastive_decode_kwargs needs one dict, or one dict per amateur_model ({amateurs}), "
                         f"got {kwargs!r}")
    full = []
    for kw in given:
        unknown = sorted(set(kw) - set(OPTIONS))
        if unknown:
            raise TypeError(f"contrastive_decode_kwargs {unknown} are not options; it takes {sorted(OPTIONS)}")
        kw = {**OPTIONS, **kw}
        if not isinstance(kw["beta"], (int, float)) or not 0 <= kw["beta"] < math.inf:
            raise ValueError(f"contrastive_decode_kwargs beta must be a finite number >= 0, got {kw['beta']!r}")
        if not isinstance(kw["alpha"], (int, float)) or not 0 < kw["alpha"] <= 1:
            raise ValueError(f"contrastive_decode_kwargs alpha must be in (0, 1], got {kw['alpha']!r}")
        full.append(kw)
    return full


def amateur_wrappers(amateur_model: nn.Module | list | tuple, expert: nn.Module) -> list[nn.Module]:
    """`amateur_model`: one model or several, each an `AutoregressiveWrapper` or a `TransformerWrapper`
    with a causal stack and the expert's vocabulary -> their AutoregressiveWrappers."""
    from .decode import AutoregressiveWrapper

    models = list(amateur_model) if isinstance(amateur_model, (list, tuple)) else [amateur_model]
    if not models:
        raise ValueError("amateur_model is an empty list")
    wrapped = []
    for model in models:
        if not isinstance(model, AutoregressiveWrapper):
            try:
                model = AutoregressiveWrapper(model)
            except (TypeError, ValueError) as error:
                raise type(error)(f"amateur_model: {error}") from None
        if model.net.num_tokens != expert.net.num_tokens:
            raise ValueError(f"amateur_model has a vocabulary of {model.net.num_tokens} tokens, the model "
                             f"{expert.net.num_tokens}: contrastive decoding needs the same vocabulary")
        wrapped.append(model)
    return wrapped


def contrastive_steps(expert: Iterator[Tensor], amateurs: list[Generator], kwargs: list[dict]
                      ) -> Generator[Tensor, Tensor, None]:
    """Step generators (each yields next-token logits (b, v) and is sent the chosen tokens (b,)) of
    the expert and the amateurs -> one that yields the contrasted logits, each amateur applied in
    turn, and passes every chosen token on to all of them."""
    logits = next(expert)
    amateur_logits = [next(steps) for steps in amateurs]
    while True:
        for other, kw in zip(amateur_logits, kwargs):
            logits = contrastive_logits(logits, other, **kw)
        token = yield logits
        logits = expert.send(token)
        amateur_logits = [steps.send(token) for steps in amateurs]
