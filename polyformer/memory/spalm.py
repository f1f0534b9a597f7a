"""SPALM (Yogatama, de Masson d'Autume, Kong 2021, arXiv:2102.02557): a Transformer-XL language model
(the short-term memory: `max_mem_len` on the net) with a long-term memory of (context key, next token)
pairs. For each position t the k nearest entries' next tokens are embedded with the word embedding W,
aggregated by attention with the last layer's state h_t as query, and gated into the prediction:

    m_t = Σ_i softmax_i(y_iᵀ h_t) y_i,      y_i = W[token_i]   (no distance term),
    g_t = σ(w_gᵀ h_t + b_g)                 (a scalar per position),
    z_t = (1 - g_t) h_t + g_t m_t,          p(x_{t+1}) = softmax(W z_t).

g here is the long-term share (g -> 0 is the XL model); a gate written on h_t instead,
z = (1 - g) m + g h, is the same model with w_g, b_g negated. As in the paper the datastore's keys
stay fixed, made by a frozen pretrained model (here the key model, which also forms the queries), and
W is the trained net's tied embedding, learning through the retrieved embeddings and the output alike.
The query is h_t of the last layer (the paper's layer R of R), after the final norm."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks
from ..losses import AuxLosses, with_aux
from ..precision import upcast
from .datastore import Datastore, model_fingerprint
from .knn_lm import KEY_LAYERS, forward_keys
from .memories import span


def _causal_wrapper(model: object, name: str) -> None:
    from ..wrappers import TransformerWrapper

    if not isinstance(model, TransformerWrapper) or not model.attn_layers.causal:
        raise TypeError(f"Spalm: {name} must be a TransformerWrapper with a Decoder, got {type(model).__name__}")


class Spalm(nn.Module):
    """forward(x (b, N), starts) -> next-token loss in segments of max_seq_len with XL memories;
    `logits` for one segment; `generate` / `stepwise_logits` through the decode states.

    Args:
        net: the trained model, a TransformerWrapper with a Decoder and tie_embedding=True (W embeds the
            retrieved tokens and reads out the logits); its max_mem_len is the short-term memory.
        datastore: a `Datastore` built with `key_model` (`knn_lm.build_datastore`; its meta's "key"
            names the layer read, its "model" fingerprint must be key_model's).
        key_model: the frozen pretrained TransformerWrapper whose representations keyed the datastore:
            it forms the retrieval queries, never trained (it may not be `net`).
        k: neighbours per position (>= 1).
        exclude_radius: when a forward is given `starts`, a position never retrieves the entries
            within this many of its own (itself, the text it sees, as much of what follows); default
            the net's short-term span, max_seq_len + max_mem_len.
        gate_bias: b_g at the start (w_g starts at 0): σ(b_g) is the initial long-term share.
        verify_model: check key_model against the fingerprint the datastore records.
    """

    def __init__(self, net: nn.Module, datastore: Datastore, key_model: nn.Module, k: int = 4,
                 exclude_radius: int | None = None, gate_bias: float = 0.0, verify_model: bool = True):
        super().__init__()
        _causal_wrapper(net, "net")
        _causal_wrapper(key_model, "key_model")
        if not net.tie_embedding:
            raise ValueError("Spalm: net must be built with tie_embedding=True: SPALM embeds the retrieved "
                             "tokens with the word embedding it also predicts with (W shared in and out)")
        if key_model is net:
            raise ValueError("Spalm: key_model must be a frozen copy, not net itself: the datastore's keys "
                             "would drift from the queries as net trains (pass copy.deepcopy(net))")
        if not isinstance(datastore, Datastore):
            raise TypeError(f"Spalm: datastore must be a Datastore, got {type(datastore).__name__}")
        for problem in checks.whole(k, "Spalm k") + checks.whole(exclude_radius, "Spalm exclude_radius", 0, True):
            raise ValueError(problem)
        if not checks.number(gate_bias):
            raise ValueError(f"Spalm gate_bias must be a finite number, got {gate_bias!r}")
        if key_model.num_tokens != net.num_tokens:
            raise ValueError(f"Spalm: key_model has {key_model.num_tokens} tokens and net {net.num_tokens}; "
                             "both must read the same tokenizer")
        self.key = datastore.meta.get("key", "ffn_input")
        if self.key not in KEY_LAYERS:
            raise ValueError(f"Spalm: the datastore's key layer must be one of {', '.join(KEY_LAYERS)}, "
                             f"got {self.key!r}")
        width = key_model.attn_layers.out_dim if self.key == "final" else key_model.attn_layers.dim
        if datastore.dim != width:
            raise ValueError(f"Spalm: the datastore's keys have dim {datastore.dim}, but key_model's "
                             f"{self.key!r} representation has {width}: it was built with another model")
        if len(datastore) and int(datastore.values.max()) >= net.num_tokens:
            raise ValueError(f"Spalm: the datastore holds token {int(datastore.values.max())}, outside the "
                             f"net's vocabulary of {net.num_tokens}")
        if verify_model:
            if not isinstance(datastore.meta.get("model"), dict):
                raise ValueError("Spalm: the datastore records no model fingerprint, so key_model cannot be "
                                 "checked; build it with meta={'model': {'fingerprint': model_fingerprint(key_model)}} "
                                 "or pass verify_model=False")
            datastore.check_built_with(model=model_fingerprint(key_model))
        self.net, self.key_model, self.datastore = net, key_model.requires_grad_(False).eval(), datastore
        self.k = k
        self.exclude_radius = net.max_seq_len + span(net) if exclude_radius is None else exclude_radius
        self.gate = nn.Linear(net.attn_layers.dim, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, float(gate_bias))

    def train(self, mode: bool = True) -> "Spalm":
        super().train(mode)
        self.key_model.eval()           # frozen: its queries never see dropout
        return self

    # --- retrieval and the gated mix ---------------------------------------------------------

    @torch.no_grad()
    def queries(self, x: Tensor, **kwargs: Any) -> Tensor:
        """The key model's representation of each position of x (b, n): (b, n, key dim)."""
        return forward_keys(self.key_model, x, self.key, **kwargs)[1]

    @torch.no_grad()
    def neighbours(self, queries: Tensor, own: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """queries (..., dim) -> (next tokens, entry ids) (..., k), nearest first, -1 where none is
        left. own (...) int: each position's own entry id (-1: not in the datastore); entries within
        exclude_radius of it are skipped (the training text retrieving itself)."""
        flat = queries.reshape(-1, queries.shape[-1])
        if own is None:
            _, tokens, ids = self.datastore.search(flat, self.k)
        else:
            _, tokens, ids = self.datastore.search(flat, self.k + 2 * self.exclude_radius + 1)
            own = own.reshape(-1, 1).to(ids.device)
            keep = (ids >= 0) & ((own < 0) | ((ids - own).abs() > self.exclude_radius))
            order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :self.k]
            keep = keep.gather(1, order)
            tokens = tokens.gather(1, order).masked_fill(~keep, -1)
            ids = ids.gather(1, order).masked_fill(~keep, -1)
        shape = (*queries.shape[:-1], self.k)
        return tokens.view(shape).to(queries.device), ids.view(shape).to(queries.device)

    def memory(self, h: Tensor, tokens: Tensor) -> Tensor:
        """m_t (..., dim): the retrieved tokens (..., k) embedded with W, weighted by softmax(y_iᵀ h_t)
        (computed in at least float32); zero where no neighbour was found."""
        y = self.net.token_emb.weight[tokens.clamp(min=0)]                       # (..., k, dim)
        scores = torch.einsum("...kd,...d->...k", upcast(y), upcast(h))
        valid = tokens >= 0
        weights = torch.softmax(scores.masked_fill(~valid, -torch.inf), dim=-1).nan_to_num(0.0)
        return torch.einsum("...k,...kd->...d", weights.to(y.dtype), y)

    def mix(self, h: Tensor, tokens: Tensor) -> Tensor:
        """Logits W z_t (..., vocab) from the net's last-layer states h (..., dim) and neighbours (..., k)."""
        g = torch.sigmoid(self.gate(h))                                          # (..., 1)
        z = (1 - g) * h + g * self.memory(h, tokens)
        return self.net.head(z)

    # --- training ----------------------------------------------------------------------------

    def logits(self, x: Tensor, mems: list[Tensor] | None = None, return_mems: bool = False,
               starts: Tensor | None = None) -> Any:
        """x (b, n) -> logits (b, n, vocab) (and the next XL memories with return_mems). `starts` (b,)
        int: where each row's x[:, 0] lies in the text the datastore was built over (the entry id of
        position p is starts + p), so each position skips its own neighbourhood."""
        logits, new_mems, _ = self._segment(x, mems, starts, 0)
        return (logits, new_mems) if return_mems else logits

    def _segment(self, x: Tensor, mems: list[Tensor] | None, starts: Tensor | None,
                 offset: int) -> tuple[Tensor, list[Tensor] | None, AuxLosses]:
        b, n = checks.token_ids(x, self.net.num_tokens).shape
        h, record = self.net(x, mems=mems, return_embeddings=True, return_intermediates=True)
        tokens, _ = self.neighbours(self.queries(x), _own(starts, b, n, offset, x.device))
        return self.mix(h, tokens), record.mems if self.net.max_mem_len else None, record.losses or AuxLosses()

    def forward(self, x: Tensor, starts: Tensor | None = None, ignore_index: int = -100) -> Tensor:
        """Mean next-token loss over x (b, N) in segments of max_seq_len, each with the XL memories of
        those before it (as XLAutoregressiveWrapper), plus the blocks' auxiliary losses' mean."""
        checks.token_ids(x, self.net.num_tokens)
        if x.shape[1] < 2:
            raise ValueError(f"x must have at least 2 tokens, got shape {tuple(x.shape)}")
        inp, target = x[:, :-1], x[:, 1:]
        total = (target != ignore_index).sum().clamp(min=1)
        loss, aux, mems = x.new_zeros((), dtype=torch.float32), AuxLosses(), None
        size = self.net.max_seq_len
        parts = range(0, inp.shape[1], size)
        for start in parts:
            logits, mems, losses = self._segment(inp[:, start: start + size], mems, starts, start)
            aux.merge(losses)
            loss = loss + F.cross_entropy(logits.transpose(1, 2).float(), target[:, start: start + size],
                                          ignore_index=ignore_index, reduction="sum")
        mean = AuxLosses({n: v / len(parts) for n, v in aux.terms.items()}, dict(aux.weights))
        return with_aux(loss / total, mean)

    # --- decoding ----------------------------------------------------------------------------

    @torch.no_grad()
    def stepwise_logits(self, x: Tensor, prompt_len: int) -> Tensor:
        """Logits (b, n - prompt_len + 1, vocab) of positions prompt_len - 1 .. n - 1 of x (b, n),
        computed as generation does: the prompt at once, then one token per step through the decode
        states of net and key model."""
        b, n = checks.token_ids(x, self.net.num_tokens).shape
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or not 1 <= prompt_len <= n:
            raise ValueError(f"prompt_len must be an integer in [1, {n}], got {prompt_len!r}")
        with self._decoding(b, prompt_len, n - prompt_len) as step:
            out = [step(x[:, :prompt_len])]
            out += [step(x[:, i: i + 1]) for i in range(prompt_len, n)]
        return torch.stack(out, 1)

    @torch.no_grad()
    def generate(self, prompts: Tensor, seq_len: int, temperature: float = 1.0,
                 filter_logits_fn: Callable | list | None = None, filter_kwargs: dict | list | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """`seq_len` tokens (b, seq_len) sampled after prompts (b, n), one step at a time through the
        decode states (retrieval per step from the key model's state); sampling as
        AutoregressiveWrapper's (temperature 0 greedy; top-k / top-p filters)."""
        from ..generate.sampling import Sampler

        for problem in checks.whole(seq_len, "seq_len"):
            raise ValueError(problem)
        b, n = checks.token_ids(prompts, self.net.num_tokens, "prompts").shape
        sampler = Sampler(temperature, filter_logits_fn, filter_kwargs, 1.0, generator)
        sampler.check(self.net.num_tokens)
        out = []
        with self._decoding(b, n, seq_len) as step:
            logits = step(prompts)
            for i in range(seq_len):
                out.append(sampler(logits, None))
                if i + 1 < seq_len:
                    logits = step(out[-1][:, None])
        return torch.stack(out, 1)

    def _decoding(self, batch: int, prompt_len: int, steps: int) -> "_Decoding":
        for model in (self.net, self.key_model):
            if model.bounded and prompt_len > model.max_seq_len:
                raise ValueError(f"prompts have {prompt_len} tokens but a model's learned positions stop at "
                                 f"max_seq_len={model.max_seq_len}")
        return _Decoding(self, batch, prompt_len, steps)


def _own(starts: Tensor | None, b: int, n: int, offset: int, device: torch.device) -> Tensor | None:
    if starts is None:
        return None
    if not isinstance(starts, Tensor) or starts.shape != (b,) or starts.dtype.is_floating_point:
        got = (tuple(starts.shape), starts.dtype) if isinstance(starts, Tensor) else type(starts).__name__
        raise ValueError(f"starts must be an integer tensor of shape ({b},), the text offset of each row, got {got}")
    return starts.to(device)[:, None] + offset + torch.arange(n, device=device)


class _Feed:
    """One model over a growing sequence: through a decode state, or (learned positions past their
    window) the last max_seq_len tokens again each step. Calls give the last position's output."""

    def __init__(self, model: nn.Module, fn: Callable, batch: int, prompt_len: int, steps: int):
        from ..generate.decode import AutoregressiveWrapper

        self.wrapper, self.fn, self.window = AutoregressiveWrapper(model), fn, model.max_seq_len
        self.recompute = model.bounded and prompt_len + steps > model.max_seq_len
        self.state = None if self.recompute else self.wrapper.state_for(batch, prompt_len, steps)
        self.seq: Tensor | None = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.state is not None:
            return self.wrapper.feed(x, self.state, self.fn)[:, -1]
        self.seq = x if self.seq is None else torch.cat((self.seq, x), 1)
        return self.fn(self.seq[:, -self.window:])[:, -1]


class _Decoding:
    """Context manager: both models in eval mode, a step function new tokens (b, n) -> logits (b, vocab)."""

    def __init__(self, spalm: Spalm, batch: int, prompt_len: int, steps: int):
        self.spalm, self.was_training = spalm, spalm.training
        net, key = spalm.net, spalm.key_model
        self.net = _Feed(net, lambda x, **kw: net(x, return_embeddings=True, **kw), batch, prompt_len, steps)
        self.key = _Feed(key, lambda x, **kw: forward_keys(key, x, spalm.key, **kw)[1], batch, prompt_len, steps)

    def step(self, x: Tensor) -> Tensor:
        h, q = self.net(x), self.key(x)
        return self.spalm.mix(h, self.spalm.neighbours(q)[0])

    def __enter__(self) -> Callable[[Tensor], Tensor]:
        self.spalm.eval()
        return self.step

    def __exit__(self, *exc: object) -> None:
        self.spalm.train(self.was_training)
