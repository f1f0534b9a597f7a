"""Training objectives: what loss a batch gives. Each is a small object with the same four methods
(`Objective`); the randomness one draws (MLM masks, prefix lengths, synthetic tasks) comes from its
own generator, drawn for the global batch so that ranks agree, and saved with `state_dict`."""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..encoder_decoder import XTransformer
from ..early_exit import next_token_loss
from ..losses import AuxLosses, forward_with_losses, with_aux
from ..wrappers import TransformerWrapper
from .batches import checked_rank, integer_at_least


class Objective(Protocol):
    def check(self, model: nn.Module) -> None:
        """Raise ValueError / TypeError when the model cannot be trained with this objective."""

    def loss(self, model: nn.Module, batch: Tensor) -> Tensor:
        """A scalar loss for this rank's rows of a batch (b, seq_len + 1), the model's weighted
        auxiliary losses included; the call's `AuxLosses` are left in `self.aux` for the logs."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _wrapper(model: nn.Module, objective: str, causal: bool) -> TransformerWrapper:
    if not isinstance(model, TransformerWrapper):
        raise TypeError(f"{objective} trains a TransformerWrapper, got {type(model).__name__}")
    if model.attn_layers.causal != causal:
        need = "a causal stack (a Decoder)" if causal else "a bidirectional stack (an Encoder)"
        raise ValueError(f"{objective} needs {need}")
    return model



def _summed_ce(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    return F.cross_entropy(logits.transpose(1, 2), target, ignore_index=ignore_index, reduction="sum")


class _Drawn:
    """Owns a generator; draws for the global batch (local rows x world_size) and keeps rows
    rank::world_size, like `Batches`."""

    def __init__(self, generator: torch.Generator | None, rank: int, world_size: int):
        self.aux = AuxLosses()
        self.world_size = integer_at_least("world_size", world_size)
        self.rank = checked_rank(rank, world_size)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)

    def _mine(self, x: Tensor) -> Tensor:
        return x[self.rank::self.world_size]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


class LanguageModeling:
    """Next-token cross-entropy over rows (b, n + 1): predict x[:, 1:] from x[:, :-1], as
    `AutoregressiveWrapper` does, for a causal `TransformerWrapper`."""

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index
        self.aux = AuxLosses()

    def check(self, model: nn.Module) -> None:
        _wrapper(model, "language modeling", causal=True)

    def loss(self, model: nn.Module, batch: Tensor) -> Tensor:
        exited = next_token_loss(model, batch[:, :-1], batch[:, 1:], self.ignore_index)   # exit_layers (early_exit.py)
        if exited is not None:
            loss, self.aux = exited
            return loss
        logits, self.aux = forward_with_losses(model, batch[:, :-1])
        return with_aux(F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], ignore_index=self.ignore_index),
                        self.aux)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class MaskedLanguageModeling(_Drawn):
    """BERT's masked LM (arXiv:1810.04805) for an `Encoder` `TransformerWrapper`: `prob` of the
    positions are chosen; of those 80% become mask_id, 10% a random token in [0, num_tokens), 10%
    stay; the loss counts the chosen positions only.

    Args:
        mask_id: the mask token (e.g. `ByteTokenizer(specials=("<mask>",)).token_id("<mask>")`).
        num_tokens: random replacements are drawn from [0, num_tokens): the ordinary vocabulary,
            without special tokens (`tokenizer.ordinary_vocab_size`, 256 for bytes).
        prob, mask_frac, random_frac: the fractions above; keep_frac = 1 - mask_frac - random_frac.

    `loss` reads the first n tokens of each (b, n + 1) row, so the model sees the same lengths as
    under the next-token objectives.
    """

    def __init__(self, mask_id: int, num_tokens: int, prob: float = 0.15, generator: torch.Generator | None = None,
                 mask_frac: float = 0.8, random_frac: float = 0.1, rank: int = 0, world_size: int = 1,
                 ignore_index: int = -100):
        super().__init__(generator, rank, world_size)
        self.mask_id = integer_at_least("mask_id", mask_id, minimum=0)
        self.num_tokens = integer_at_least("num_tokens", num_tokens)
        if not 0 < prob < 1:
            raise ValueError(f"prob must be in (0, 1), got {prob}")
        if mask_frac < 0 or random_frac < 0 or mask_frac + random_frac > 1:
            raise ValueError(f"mask_frac ({mask_frac}) and random_frac ({random_frac}) must be >= 0 and sum to <= 1")
        self.prob, self.mask_frac, self.random_frac = prob, mask_frac, random_frac
        self.ignore_index = ignore_index

    def check(self, model: nn.Module) -> None:
        model = _wrapper(model, "masked language modeling", causal=False)
        if model.num_tokens <= max(self.mask_id, self.num_tokens - 1):
            raise ValueError(f"the model's num_tokens ({model.num_tokens}) must exceed mask_id ({self.mask_id}) "
                             f"and cover the random tokens [0, {self.num_tokens})")

    def _draw(self, x: Tensor) -> tuple[Tensor, Tensor, int]:
        """(input, target, chosen positions in the global batch); target is ignore_index where not chosen."""
        g = self.generator
        shape = (x.shape[0] * self.world_size, x.shape[1])
        chosen = torch.rand(shape, generator=g) < self.prob
        action = torch.rand(shape, generator=g)
        random_tokens = torch.randint(0, self.num_tokens, shape, generator=g)
        total = int(chosen.sum())
        chosen, action, random_tokens = (self._mine(t).to(x.device) for t in (chosen, action, random_tokens))
        to_mask = chosen & (action < self.mask_frac)
        to_random = chosen & (action >= self.mask_frac) & (action < self.mask_frac + self.random_frac)
        inp = x.masked_fill(to_mask, self.mask_id)
        inp = torch.where(to_random, random_tokens, inp)
        target = x.masked_fill(~chosen, self.ignore_index)
        return inp, target, total

    def mask(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (b, n) -> (corrupted input, target): target holds x at the chosen positions and
        ignore_index elsewhere."""
        inp, target, _ = self._draw(x)
        return inp, target

    def loss(self, model: nn.Module, batch: Tensor) -> Tensor:
        inp, target, total = self._draw(batch[:, :-1])
        # sum / (global count / world_size): the ranks' mean is the global mean over chosen tokens
        logits, self.aux = forward_with_losses(model, inp)
        return with_aux(_summed_ce(logits, target, self.ignore_index) * self.world_size / max(total, 1), self.aux)


class PrefixLanguageModeling(_Drawn):
    """Prefix LM (arXiv:1910.10683): row b draws a prefix length p in [min_prefix, max_prefix];
    its first p tokens attend to each other bidirectionally, causal after, and the loss counts only
    tokens after the prefix (token p onward, the first predicted from the prefix alone). Calls the
    model with `prefix_len` (b,)."""

    def __init__(self, min_prefix: int, max_prefix: int, generator: torch.Generator | None = None,
                 rank: int = 0, world_size: int = 1, ignore_index: int = -100):
        super().__init__(generator, rank, world_size)
        self.min_prefix = integer_at_least("min_prefix", min_prefix, minimum=0)
        self.max_prefix = integer_at_least("max_prefix", max_prefix, minimum=0)
        if max_prefix < min_prefix:
            raise ValueError(f"max_prefix ({max_prefix}) must be >= min_prefix ({min_prefix})")
        self.ignore_index = ignore_index

    def check(self, model: nn.Module) -> None:
        model = _wrapper(model, "prefix language modeling", causal=True)
        if "prefix_len" not in inspect.signature(model.forward).parameters:
            raise TypeError(f"prefix language modeling needs a model whose forward takes prefix_len; "
                            f"{type(model).__name__}.forward does not")

    def prefix_lengths(self, b: int, n: int) -> tuple[Tensor, int]:
        """This rank's prefix lengths (b,) and the number of counted targets in the global batch."""
        if self.max_prefix > n:
            raise ValueError(f"max_prefix ({self.max_prefix}) exceeds the model's input length n={n}")
        p = torch.randint(self.min_prefix, self.max_prefix + 1, (b * self.world_size,), generator=self.generator)
        total = int((n - (p - 1).clamp(min=0)).sum())
        return self._mine(p), total

    def loss(self, model: nn.Module, batch: Tensor) -> Tensor:
        inp, target = batch[:, :-1], batch[:, 1:]
        b, n = inp.shape
        p, total = self.prefix_lengths(b, n)
        p = p.to(batch.device)
        # position t predicts token t + 1; inside the prefix (t + 1 < p) that token was visible
        counted = torch.arange(n, device=batch.device)[None] >= (p[:, None] - 1)
        target = target.masked_fill(~counted, self.ignore_index)
        logits, self.aux = forward_with_losses(model, inp, prefix_len=p)
        return with_aux(_summed_ce(logits, target, self.ignore_index) * self.world_size / max(total, 1), self.aux)


SEQ2SEQ_KINDS = ("copy", "reverse", "sort")


class Seq2SeqTask(_Drawn):
    """Synthetic sequence-to-sequence data that needs no download: src is `length` random tokens in
    [0, num_tokens); tgt is BOS (= num_tokens) followed by src copied, reversed or sorted.
    Both sides use vocab_size = num_tokens + 1 ids. `sample(batch_size)` draws a global batch and
    returns this rank's rows."""

    def __init__(self, kind: str, num_tokens: int, length: int, generator: torch.Generator | None = None,
                 rank: int = 0, world_size: int = 1):
        super().__init__(generator, rank, world_size)
        if kind not in SEQ2SEQ_KINDS:
            raise ValueError(f"unknown seq2seq task {kind!r}; expected one of {list(SEQ2SEQ_KINDS)}")
        self.kind = kind
        self.num_tokens = integer_at_least("num_tokens", num_tokens, minimum=2)
        self.length = integer_at_least("length", length)

    @property
    def bos(self) -> int:
        return self.num_tokens

    @property
    def vocab_size(self) -> int:
        return self.num_tokens + 1

    def targets(self, src: Tensor) -> Tensor:
        """src (b, length) -> tgt (b, length + 1): BOS, then the answer."""
        if self.kind == "copy":
            answer = src
        elif self.kind == "reverse":
            answer = src.flip(-1)
        else:
            answer = src.sort(dim=-1).values
        bos = torch.full((src.shape[0], 1), self.bos, dtype=src.dtype, device=src.device)
        return torch.cat((bos, answer), dim=1)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """(src (b, length), tgt (b, length + 1)) for this rank, b = batch_size // world_size;
        from `generator` if given (e.g. for evaluation), else the task's own."""
        integer_at_least("batch_size", batch_size)
        if batch_size % self.world_size:
            raise ValueError(f"batch_size ({batch_size}) must be a multiple of world_size ({self.world_size})")
        g = generator if generator is not None else self.generator
        src = self._mine(torch.randint(0, self.num_tokens, (batch_size, self.length), generator=g))
        return src, self.targets(src)


class Seq2Seq:
    """The `XTransformer` loss on (src, tgt): the decoder's next-token cross-entropy on tgt.
    A batch is (src, tgt), or src alone with tgt from the task."""

    def __init__(self, task: Seq2SeqTask):
        self.task = task
        self.aux = AuxLosses()

    def check(self, model: nn.Module) -> None:
        if not isinstance(model, XTransformer):
            raise TypeError(f"seq2seq trains an XTransformer, got {type(model).__name__}")
        enc, dec = model.encoder.num_tokens, model.decoder.net.num_tokens
        if enc < self.task.num_tokens or dec < self.task.vocab_size:
            raise ValueError(f"the {self.task.kind!r} task needs enc_num_tokens >= {self.task.num_tokens} and "
                             f"dec_num_tokens >= {self.task.vocab_size} (BOS included), got {enc} and {dec}")

    def loss(self, model: nn.Module, batch: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        src, tgt = batch if isinstance(batch, (tuple, list)) else (batch, self.task.targets(batch))
        loss, self.aux = model(src, tgt, return_losses=True)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@torch.no_grad()
def token_accuracy(model: XTransformer, task: Seq2SeqTask, n: int = 256, seed: int = 0,
                   batch_size: int = 256) -> float:
    """The fraction of answer tokens right when the model decodes greedily from BOS, over n fresh
    sources drawn with `seed` (the task's own generator is not touched)."""
    g = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    right = 0
    device = next(model.parameters()).device
    try:
        for start in range(0, n, batch_size):
            size = min(batch_size, n - start)
            src = torch.randint(0, task.num_tokens, (size, task.length), generator=g).to(device)
            bos = torch.full((size, 1), task.bos, dtype=torch.long, device=device)
            out = model.generate(src, bos, task.length, temperature=0.0)
            right += int((out == task.targets(src)[:, 1:]).sum())
    finally:
        model.train(was_training)
    return right / (n * task.length)
