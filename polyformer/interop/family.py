"""What the converters need to know about one Hugging Face model family: how its config becomes
polyformer keywords and back, and which of its tensors becomes which polyformer tensor (`Link`).
Each family (gpt2.py, bert.py, llama.py) is one `Family` record; hf.py runs them. An encoder-decoder
family (t5.py) builds an `XTransformer`; a family whose classes build models of another shape (T5's
encoder-only class) lists them as `variants`, records of the same model type."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from ..encoder_decoder import XTransformer
from ..stack import AttentionLayers
from ..wrappers import TransformerWrapper


class Unsupported(ValueError):
    """A checkpoint uses an option polyformer cannot reproduce exactly."""


@dataclass(frozen=True)
class Link:
    """One polyformer tensor `ours` made of the Hugging Face tensors `theirs`.

    Several tensors are joined along dim 0, `sizes` rows each (separate q / k / v projections into
    one fused q|k|v); `transpose` undoes GPT-2's Conv1D layout (in, out). `absolute` names are not
    under the base model's prefix (the LM head). `offset`: their first rows have no counterpart (RoBERTa's
    position table starts at padding_idx + 1); they are dropped, and written as zeros. `scales`: one
    factor per tensor of `theirs`, multiplied in on the way in and divided out on the way back (T5's
    unscaled scores become polyformer's 1/sqrt(d) by scaling the queries by sqrt(d)). `heads`: their
    tensors are einsum weights (dim, heads, dim_head) (XLNet): each is read as (dim, heads * dim_head),
    transposed first when `transpose`, then joined.
    """

    ours: str
    theirs: tuple[str, ...]
    sizes: tuple[int, ...] = ()
    transpose: bool = False
    absolute: bool = False
    offset: int = 0
    scales: tuple[float, ...] = ()
    heads: int = 0

    def to_ours(self, tensors: list[Tensor]) -> Tensor:
        if self.scales:
            tensors = [t * s if s != 1.0 else t for t, s in zip(tensors, self.scales)]
        if self.heads:
            return torch.cat([t.flatten(1).t() if self.transpose else t.flatten(1) for t in tensors]).contiguous()
        t = torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]
        return t.t().contiguous() if self.transpose else t[self.offset:].clone()

    def to_theirs(self, t: Tensor) -> list[Tensor]:
        parts = self._to_theirs(t)
        if self.scales:
            parts = [p / s if s != 1.0 else p for p, s in zip(parts, self.scales)]
        return parts

    def _to_theirs(self, t: Tensor) -> list[Tensor]:
        if self.heads:
            parts = t.split(list(self.sizes), dim=0) if len(self.theirs) > 1 else [t]
            return [(p.t() if self.transpose else p).unflatten(1, (self.heads, -1)).contiguous() for p in parts]
        if len(self.theirs) > 1:
            return [part.clone() for part in t.split(list(self.sizes), dim=0)]
        if self.offset:
            return [torch.cat((t.new_zeros(self.offset, *t.shape[1:]), t))]
        return [(t.t() if self.transpose else t).contiguous().clone()]

    def their_shapes(self, ours: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The shapes the Hugging Face tensors must have to make a tensor of shape `ours`."""
        if self.heads:
            rows = self.sizes if len(self.theirs) > 1 else (ours[0],)
            return [(ours[1], self.heads, n // self.heads) if self.transpose else (n, self.heads, ours[1] // self.heads)
                    for n in rows]
        if len(self.theirs) > 1:
            return [(n, *ours[1:]) for n in self.sizes]
        if self.offset:
            return [(ours[0] + self.offset, *ours[1:])]
        return [tuple(reversed(ours)) if self.transpose else tuple(ours)]


@dataclass(frozen=True)
class Family:
    """A Hugging Face model family.

    classes: the accepted model classes, each with the prefix of its base model's tensors in its
        state dict; the first is the class `to_hf` makes.
    defaults: the Hugging Face config defaults for keys a config.json may leave out.
    derived: regular expressions of buffers some checkpoints store that hold no weights (causal
        masks, position ids, rotary frequencies): rebuilt from the config, so they are dropped.
    build: config -> (stack class, stack keywords, wrapper keywords); raises `Unsupported`. An
        `encoder_decoder` family's build gives the keywords of an `XTransformer` instead.
    links: config -> the links of every polyformer tensor.
    config_of: a polyformer model -> the Hugging Face config that describes it.
    tied_head: the name of the LM head tensor that a tied config shares with the token embedding.
    main_kwargs: keyword arguments of the main class beside its config.
    base_model: where other task-head models of the family keep a base model that converts (the
        hint for an unsupported class), or None.
    encoder_decoder: the family's models are `XTransformer`s (an encoder and a cross-attending decoder).
    aliases: config -> {tensor: the tensor it repeats} (T5's per-stack copies of the shared
        embedding): read only to check they are equal, written back by `to_hf`.
    resolve: (config, the checkpoint's tensors) -> the config, completed with what only the tensors
        tell (whether T5's LM head is the shared embedding).
    variants: records of the same model type for classes that build models of another shape.
    zeros: config -> {tensor: shape} of tensors with no polyformer counterpart whose zero value is
        what the polyformer model computes (XLNet's segment term): `to_hf` / `save_hf` write zeros.
    """

    model_type: str
    classes: dict[str, str]
    defaults: dict[str, Any]
    derived: tuple[str, ...]
    build: Callable[[dict[str, Any]], tuple[type[AttentionLayers], dict[str, Any], dict[str, Any]]]
    links: Callable[[dict[str, Any]], list[Link]]
    config_of: Callable[[TransformerWrapper], dict[str, Any]]
    embedding: str = ""                       # the token embedding's name (the tied head's twin)
    tied_head: str | None = None
    notes: dict[str, str] = field(default_factory=dict)   # hints for unexpected tensors, by prefix
    main_kwargs: dict[str, Any] = field(default_factory=dict)
    base_model: str | None = None
    encoder_decoder: bool = False
    aliases: Callable[[dict[str, Any]], dict[str, str]] | None = None
    resolve: Callable[[dict[str, Any], dict[str, Tensor]], dict[str, Any]] | None = None
    variants: tuple["Family", ...] = ()
    zeros: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]] | None = None

    @property
    def main_class(self) -> str:
        return next(iter(self.classes))


def make_model(family: Family, c: dict[str, Any]) -> TransformerWrapper | XTransformer:
    """The polyformer model of a Hugging Face config (defaults applied), with fresh weights."""
    if family.encoder_decoder:
        return XTransformer(**family.build(c))
    stack_cls, layers, wrap = family.build(c)
    return TransformerWrapper(attn_layers=stack_cls(**layers), **wrap)


def wrappers_of(model: nn.Module) -> dict[str, TransformerWrapper]:
    """The `TransformerWrapper`s a model is made of, by name: itself, or an XTransformer's encoder and
    decoder."""
    if isinstance(model, XTransformer):
        return {"encoder": model.encoder, "decoder": model.decoder.net}
    return {"": model}


def ff_mult(inner: int, dim: int) -> float:
    """The `ff_mult` whose int(dim * ff_mult) is exactly `inner` (polyformer sizes the feedforward as a
    multiple of dim)."""
    mult = inner / dim
    for _ in range(4):
        if int(dim * mult) == inner:
            return float(mult) if mult != int(mult) else int(mult)
        mult = math.nextafter(mult, math.inf)
    raise Unsupported(f"no ff_mult gives a feedforward of exactly {inner} features for dim={dim}")


def inner_dim(model: TransformerWrapper) -> int:
    cfg = model.attn_layers.cfg
    return int(cfg.dim * cfg.ff.mult)


# Hugging Face activation name -> our feedforward activation (the first name of each is the one written)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "swish",
               "swish": "swish"}
ACTIVATION_KEYWORDS = {"gelu": {}, "gelu_tanh": {"ff_gelu_tanh": True}, "swish": {"ff_swish": True}}


def activation(name: str, family: str, key: str, *, relu: bool = False) -> dict[str, Any]:
    """The stack keyword of a Hugging Face activation name; `relu`: the family's feedforward may be a plain ReLU
    (T5, XLNet, Reformer)."""
    if relu and name == "relu":
        return {"ff_relu": True}
    if name not in ACTIVATIONS:
        supported = sorted(ACTIVATIONS) + (["relu"] if relu else [])
        raise Unsupported(f"{family}: {key}={name!r} is not supported; supported: {supported}")
    return dict(ACTIVATION_KEYWORDS[ACTIVATIONS[name]])


def activation_name(model: TransformerWrapper) -> str:
    """The Hugging Face name of the model's activation (its own name when none matches)."""
    ours = model.attn_layers.cfg.ff.activation
    return next((theirs for theirs, name in ACTIVATIONS.items() if name == ours), ours)


def head_dim(family: str, dim: int, heads: int, dim_key: str, heads_key: str) -> int:
    """dim // heads; `Unsupported` when heads does not divide dim."""
    if dim % heads:
        raise Unsupported(f"{family}: {dim_key} ({dim}) must be a multiple of {heads_key} ({heads})")
    return dim // heads


def layer_names(depth: int, theirs: str) -> Iterator[tuple[str, str, str]]:
    """For each layer i: our attention block's name, our feedforward block's name (the stack alternates
    them) and the Hugging Face layer's name `theirs.i`."""
    for i in range(depth):
        yield f"attn_layers.blocks.{2 * i}", f"attn_layers.blocks.{2 * i + 1}", f"{theirs}.{i}"


def head_keywords(c: dict[str, Any]) -> dict[str, Any]:
    """The wrapper keywords of the LM head: tied to the token embedding, or a bias-free `lm_head`."""
    return {"tie_embedding": True} if c["tie_word_embeddings"] else {"tie_embedding": False, "logits_bias": False}


def head_links(c: dict[str, Any]) -> list[Link]:
    """The untied LM head (outside the base model's prefix); none when it is tied."""
    return [] if c["tie_word_embeddings"] else [Link("to_logits.weight", ("lm_head.weight",), absolute=True)]
