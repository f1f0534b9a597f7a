"""kNN-LM (Khandelwal et al. 2020, arXiv:1911.00172): a trained LM's next-token distribution
interpolated with a nearest-neighbour one over a datastore of (context representation, next token),

    p(y | x) = λ p_kNN(y | x) + (1 - λ) p_LM(y | x),
    p_kNN(y | x) ∝ Σ_{(k_i, v_i) ∈ N(x), v_i = y} exp(-d(k_i, q(x)) / T),

with d the squared L2 distance, N(x) the k nearest keys, computed in log space. The context
representation q(x) is the input of the final layer's feedforward after its norm (key "ffn_input", the
paper's choice) or the stack's output after the final norm, what the head reads (key "final")."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from .. import checks
from .datastore import Datastore, KEY_DTYPES
from .vector_index import IndexSpec

KEY_LAYERS = ("ffn_input", "final")


def check_knn(lam: float, k: int, temperature: float) -> None:
    if not (checks.number(lam) and 0.0 <= lam <= 1.0):
        raise ValueError(f"knn lambda must be in [0, 1], got {lam!r}")
    for problem in checks.whole(k, "knn k"):
        raise ValueError(problem)
    if not (checks.number(temperature) and temperature > 0):
        raise ValueError(f"knn temperature must be a positive number, got {temperature!r}")


def knn_log_probs(distances: Tensor, tokens: Tensor, vocab: int, temperature: float = 1.0) -> Tensor:
    """log p_kNN (m, vocab) float32 from neighbours' squared distances (m, k) and next tokens (m, k):
    log_softmax(-d / T) over the neighbours, summed per token (-inf for a token none of them had;
    padding neighbours, token -1, count for nothing)."""
    valid = tokens >= 0
    logits = (-distances.float() / temperature).masked_fill(~valid, -math.inf)
    weights = torch.log_softmax(logits, dim=-1).masked_fill(~valid, -math.inf)
    top = weights.amax(dim=-1, keepdim=True).clamp(min=-1e30)      # a row of padding alone stays -inf
    summed = torch.zeros(tokens.shape[0], vocab, device=tokens.device)
    summed.scatter_add_(1, tokens.clamp(min=0), (weights - top).exp())
    return summed.log() + top


def interpolate(lm_log_probs: Tensor, knn: Tensor, lam: float) -> Tensor:
    """log(λ p_kNN + (1 - λ) p_LM) = logsumexp(log λ + log p_kNN, log(1 - λ) + log p_LM), float32;
    λ = 0 gives log p_LM and λ = 1 log p_kNN exactly."""
    lm = lm_log_probs.float()
    if lam == 0.0:
        return lm
    if lam == 1.0:
        return knn.float()
    return torch.logaddexp(math.log(lam) + knn.float(), math.log1p(-lam) + lm)


@contextmanager
def reading_keys(net: nn.Module, key: str) -> Iterator[list[Tensor]]:
    """While open, each forward of `net` (a TransformerWrapper) appends the representation `key`
    reads for its positions, (b, n, dim), to the yielded list ("final" keys: run the net with
    return_embeddings=True and read its output instead)."""
    if key not in KEY_LAYERS:
        raise ValueError(f"knn key must be one of {', '.join(KEY_LAYERS)}, got {key!r}")
    seen: list[Tensor] = []
    if key == "final":
        yield seen
        return
    blocks = [b for b in net.attn_layers.blocks if b.kind == "f"]
    if not blocks:
        raise ValueError("knn key 'ffn_input' reads the final feedforward's input, and this stack has no "
                         "feedforward block; use key 'final'")
    handle = blocks[-1].branch.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


def forward_keys(net: nn.Module, x: Tensor, key: str, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """(logits (b, n, vocab), keys (b, n, dim)) of token ids x (b, n); kwargs go to the net (state)."""
    with reading_keys(net, key) as seen:
        hidden = net(x, return_embeddings=True, **kwargs)
    if key == "final":
        return net.head(hidden), hidden
    if not seen or seen[-1].shape[:2] != x.shape:
        raise ValueError("knn key 'ffn_input' was not seen in this forward (a depth policy such as reversible or "
                         "hourglass runs the feedforward itself); use key 'final'")
    return net.head(hidden), seen[-1]


def sliding_windows(tokens: Tensor, seq_len: int, stride: int | None = None) -> list[tuple[Tensor, int]]:
    """Windows of at most seq_len + 1 tokens of a stream (N,), one every `stride` tokens (default
    seq_len: `train.scoring.windows`), each with how many of its leading targets an earlier window
    already scored: every token but the first is a target once, with at least seq_len - stride
    tokens of left context where the text has them."""
    stride = seq_len if stride is None else stride
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be an integer in [1, max_seq_len={seq_len}], got {stride!r}")
    if tokens.numel() < 2:
        raise ValueError(f"the text has {tokens.numel()} token(s); scoring needs at least 2")
    out, start, scored = [], 0, 0
    while True:
        window = tokens[start: start + seq_len + 1]
        out.append((window, max(scored - start, 0)))
        scored = start + window.numel() - 1
        if scored >= tokens.numel() - 1:
            return out
        start += stride


def batched(parts: list[tuple[Tensor, int]], batch_size: int) -> Iterator[tuple[Tensor, list[int]]]:
    """Windows of one length stacked `batch_size` at a time: (x (b, n + 1), skips)."""
    group: list[tuple[Tensor, int]] = []
    for window, skip in parts:
        if group and (len(group) == batch_size or group[0][0].numel() != window.numel()):
            yield torch.stack([w for w, _ in group]), [s for _, s in group]
            group = []
        group.append((window, skip))
    if group:
        yield torch.stack([w for w, _ in group]), [s for _, s in group]


def unscored(skips: list[int], n: int, device: torch.device) -> Tensor:
    """(b, n) bool: the positions of b windows of n inputs whose targets no earlier window scored."""
    return torch.arange(n, device=device) >= torch.tensor(skips, device=device)[:, None]


@torch.no_grad()
def build_datastore(net: nn.Module, tokens: Tensor, key: str = "ffn_input", stride: int | None = None,
                    batch_size: int = 8, spec: IndexSpec | None = None, key_dtype: str = "float16",
                    meta: dict[str, Any] | None = None, progress: Callable[[int], None] | None = None) -> Datastore:
    """One entry per target of `tokens` (N,): the representation `key` of its left context (windows
    as `sliding_windows`) and the target token. `progress(n)` is told each batch's entry count."""
    if key_dtype not in KEY_DTYPES:
        raise ValueError(f"knn key dtype must be one of {', '.join(KEY_DTYPES)}, got {key_dtype!r}")
    for problem in checks.whole(batch_size, "batch_size"):
        raise ValueError(problem)
    was_training = net.training
    net.eval()
    device = next(net.parameters()).device
    keys, values = [], []
    try:
        for x, skips in batched(sliding_windows(tokens, net.max_seq_len, stride), batch_size):
            x = x.to(device)
            _, reps = forward_keys(net, x[:, :-1], key)
            fresh = unscored(skips, x.shape[1] - 1, device)
            keys.append(reps[fresh].to(KEY_DTYPES[key_dtype]).cpu())
            values.append(x[:, 1:][fresh].cpu())
            if progress is not None:
                progress(values[-1].numel())
    finally:
        net.train(was_training)
    return Datastore(torch.cat(keys), torch.cat(values), spec, {**(meta or {}), "key": key})


class KnnLM:
    """A causal TransformerWrapper with a datastore: `log_probs` (interpolated), `score` (a text's
    mean loss, kNN-LM and LM alone), `generate` (sampling the interpolated distribution through the
    decode state).

    Args:
        net: the model the datastore was built with (its key layer is read from the datastore's meta).
        datastore: a `Datastore`.
        lam: λ in [0, 1], the kNN share. k: neighbours per query (>= 1). temperature: T > 0 on distances.
    """

    def __init__(self, net: nn.Module, datastore: Datastore, lam: float = 0.25, k: int = 1024,
                 temperature: float = 1.0, key: str | None = None):
        check_knn(lam, k, temperature)
        key = key or datastore.meta.get("key", "ffn_input")
        if key not in KEY_LAYERS:
            raise ValueError(f"knn key must be one of {', '.join(KEY_LAYERS)}, got {key!r}")
        self.net, self.datastore = net, datastore
        self.lam, self.k, self.temperature, self.key = float(lam), k, float(temperature), key

    def knn(self, keys: Tensor, vocab: int) -> Tensor:
        """log p_kNN (..., vocab) float32 of keys (..., dim), on the keys' device."""
        distances, tokens, _ = self.datastore.search(keys.reshape(-1, keys.shape[-1]), self.k)
        return knn_log_probs(distances, tokens, vocab, self.temperature).view(*keys.shape[:-1], vocab).to(keys.device)

    def mix(self, logits: Tensor, keys: Tensor) -> Tensor:
        """Interpolated log-probabilities (..., vocab) float32 from LM logits (..., vocab) and keys (..., dim)."""
        lm = torch.log_softmax(logits.float(), dim=-1)
        return lm if self.lam == 0.0 else interpolate(lm, self.knn(keys, logits.shape[-1]), self.lam)

    @torch.no_grad()
    def log_probs(self, x: Tensor) -> Tensor:
        """x (b, n) -> (b, n, vocab) log p of each next token."""
        logits, keys = forward_keys(self.net, x, self.key)
        return self.mix(logits, keys)

    @torch.no_grad()
    def target_log_probs(self, tokens: Tensor, stride: int | None = None, batch_size: int = 8,
                         max_batches: int | None = None, with_knn: bool = True) -> tuple[Tensor, Tensor | None]:
        """(log p_LM, log p_kNN) float32 (T,) of each target of a stream (N,) in `sliding_windows`, in
        order (the first `max_batches` batches only, when given); log p_kNN is None without `with_knn`.
        Any λ's log-probabilities are then `interpolate(lm, knn, λ)`."""
        for problem in checks.whole(max_batches, "max_batches", optional=True):
            raise ValueError(problem)
        was_training = self.net.training
        self.net.eval()
        device = next(self.net.parameters()).device
        lm, knn = [], []
        try:
            for i, (x, skips) in enumerate(batched(sliding_windows(tokens, self.net.max_seq_len, stride), batch_size)):
                if max_batches is not None and i >= max_batches:
                    break
                x = x.to(device)
                logits, keys = forward_keys(self.net, x[:, :-1], self.key)
                fresh = unscored(skips, x.shape[1] - 1, device)
                logits, keys, target = logits[fresh], keys[fresh], x[:, 1:][fresh, None]     # (m, vocab), (m, dim), (m, 1)
                lm.append(torch.log_softmax(logits.float(), dim=-1).gather(-1, target)[:, 0])
                if with_knn:
                    knn.append(self.knn(keys, logits.shape[-1]).gather(-1, target)[:, 0])
        finally:
            self.net.train(was_training)
        return torch.cat(lm), torch.cat(knn) if with_knn else None

    def score(self, tokens: Tensor, stride: int | None = None, batch_size: int = 8,
              max_batches: int | None = None) -> dict[str, float]:
        """Mean next-token loss in nats over a stream (N,) in `sliding_windows`: {"loss", "lm_loss",
        "count"} (kNN-LM and the LM alone, on the same windows)."""
        lm, knn = self.target_log_probs(tokens, stride, batch_size, max_batches, with_knn=self.lam > 0.0)
        mixed = lm if knn is None else interpolate(lm, knn, self.lam)
        return {"loss": -mixed.double().mean().item(), "lm_loss": -lm.double().mean().item(), "count": lm.numel()}

    @torch.no_grad()
    def generate(self, prompts: Tensor, seq_len: int, temperature: float = 1.0,
                 filter_logits_fn: Callable | list | None = None, filter_kwargs: dict | list | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """`seq_len` tokens (b, seq_len) sampled after prompts (b, n) from the interpolated
        distribution: the model runs on a decode state (one token per step after the prompt; learned
        positions asked past their window recompute the last max_seq_len tokens each step, as
        AutoregressiveWrapper does), the kNN part only changes each step's distribution. Sampling as
        AutoregressiveWrapper's (temperature 0 greedy; top-k / top-p filters on the log-probabilities)."""
        from ..generate.decode import AutoregressiveWrapper
        from ..generate.sampling import Sampler

        for problem in checks.whole(seq_len, "seq_len"):
            raise ValueError(problem)
        b, n = checks.token_ids(prompts, self.net.num_tokens, "prompts").shape
        if self.net.bounded and n > self.net.max_seq_len:
            raise ValueError(f"prompts have {n} tokens but the model's learned positions stop at "
                             f"max_seq_len={self.net.max_seq_len}")
        sampler = Sampler(temperature, filter_logits_fn, filter_kwargs, 1.0, generator)
        sampler.check(self.net.num_tokens)
        wrapper, window = AutoregressiveWrapper(self.net), self.net.max_seq_len
        recompute = self.net.bounded and n + seq_len > window     # learned positions past their window
        state = None if recompute else wrapper.state_for(b, n, seq_len)

        def run(x: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
            return forward_keys(self.net, x, self.key, **kwargs)

        was_training = self.net.training
        self.net.eval()
        out, seq, x = [], prompts, prompts
        try:
            for _ in range(seq_len):
                logits, keys = wrapper.feed(x, state, run) if state is not None else run(seq[:, -window:])
                token = sampler(self.mix(logits[:, -1], keys[:, -1]), None)
                out.append(token)
                x = token[:, None]
                seq = torch.cat((seq, x), 1) if state is None else seq
        finally:
            self.net.train(was_training)
        return torch.stack(out, 1)
