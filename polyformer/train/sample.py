"""Text from a trained model, as `polyformer generate` and the end of a training run make it: the
weights laid out for batch-1 decoding, the prompt encoded and cut to the model's window, the
command line's top-k / top-p flags as filters, and plain or speculative sampling."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..generate.decode import AutoregressiveWrapper
from ..generate.early_exit import ExitGeneration, generate as exit_generate
from ..generate.sampling import top_k, top_p
from ..generate.speculative import SpeculativeResult, speculative_generate
from ..layout import input_major
from ..quantize import quantize_int8


def prepare_for_sampling(model: nn.Module, int8: bool) -> nn.Module:
    """The weights as batch-1 decoding on a CPU reads them fastest (`load_run` builds on the CPU):
    int8 (`quantize_int8`, changes the numbers) or input-major float32 (`input_major`, the same
    values)."""
    return quantize_int8(model.eval()) if int8 else input_major(model)


def filters(k: int | None, p: float | None) -> dict[str, Any]:
    """`filter_logits_fn` / `filter_kwargs` for top-k and / or top-p (none when both are None); the
    sampler checks their values."""
    chosen = [(fn, {name: value}) for fn, name, value in ((top_k, "k", k), (top_p, "p", p)) if value is not None]
    if not chosen:
        return {}
    return {"filter_logits_fn": [fn for fn, _ in chosen], "filter_kwargs": [kw for _, kw in chosen]}


def prompt_ids(tokenizer: Any, prompt: str, model: nn.Module) -> Tensor:
    """(1, n) ids of `prompt` (token 0 for an empty one): its last `model.max_seq_len` tokens."""
    ids = tokenizer.encode(prompt) or [0]
    return torch.tensor([ids[-model.max_seq_len:]])


def sample(model: nn.Module, tokenizer: Any, prompt: str, n: int, temperature: float, k: int | None,
           p: float | None, seed: int) -> str:
    """`prompt` and `n` tokens sampled after it."""
    out = AutoregressiveWrapper(model).generate(prompt_ids(tokenizer, prompt, model), n, temperature=temperature,
                                                generator=torch.Generator().manual_seed(seed), **filters(k, p))
    return prompt + tokenizer.decode(out[0].tolist())


def speculative_sample(model: nn.Module, draft: nn.Module, tokenizer: Any, prompt: str, n: int, gamma: int,
                       temperature: float, k: int | None, p: float | None, seed: int) -> tuple[str, SpeculativeResult]:
    """`prompt` and `n` tokens from `model`, with `draft` proposing `gamma` at a time
    (`speculative_generate`: the target's own distribution; with temperature 0, its greedy text as
    long as the whole text fits the target's window - past it, `sample` slides its cache, so a
    longer request is refused)."""
    ids = prompt_ids(tokenizer, prompt, model)
    if ids.shape[1] + n > model.max_seq_len:
        raise ValueError(f"the prompt's {ids.shape[1]} tokens and {n} new ones exceed the target's window of "
                         f"{model.max_seq_len}; speculative decoding needs the whole text to fit it (ask for at "
                         f"most {model.max_seq_len - ids.shape[1]} new tokens)")
    result = speculative_generate(model, draft, ids, n, gamma=gamma, temperature=temperature,
                                  generator=torch.Generator().manual_seed(seed), **filters(k, p))
    return prompt + tokenizer.decode(result.tokens[0].tolist()), result


def early_exit_sample(model: nn.Module, tokenizer: Any, prompt: str, n: int, threshold: float, temperature: float,
                      k: int | None, p: float | None, seed: int) -> tuple[str, ExitGeneration]:
    """`prompt` and `n` tokens sampled with early exit at `threshold` (`generate.early_exit.generate`), and what
    it did (the layers each token used)."""
    result = exit_generate(model, prompt_ids(tokenizer, prompt, model), n, threshold=threshold, temperature=temperature,
                           generator=torch.Generator().manual_seed(seed), **filters(k, p))
    return prompt + tokenizer.decode(result.tokens[0].tolist()), result
