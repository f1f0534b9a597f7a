"""Switch Transformers (arXiv:2101.03961) as `SwitchTransformersForConditionalGeneration` (an `XTransformer`)
and `SwitchTransformersEncoderModel` (an encoder): T5 v1.0 (t5.py: RMS norms, no biases, the shared relative
bias, unscaled scores, a tied head scaled by d_model ** -0.5) whose feedforward is, at the sparse layers, a
top-1 mixture of experts with a fixed per-row capacity. With tie_word_embeddings=False transformers gives each
stack its own embedding and the head its own weight, unscaled (`shared` is built but never read: dropped).

As transformers 5.23 computes it: the router is a bias-free linear map in float32, the gate the chosen
expert's softmax probability (not renormalised), jitter (multiplicative, in training only) on the router's
input (transformers multiplies a float32 input in place, so its experts see the jitter too: training
differs, eval does not); each expert takes at most `expert_capacity` tokens per row, counted in token order, and a token over
capacity gets zero from the layer (the residual carries it). Padding is routed like any token and takes
capacity (`router_ignore_padding_tokens` is not read): `ff_moe_route_padding=True`. The sparse layers are
those i with i % step == 1 (every layer when step == 1, none when step == 0), step = num_layers //
num_sparse_encoder_layers: `ff_moe_every=step, ff_moe_offset=1`.

Router losses: polyformer's "moe_z" / "moe_balance" (weights router_z_loss_coef / router_aux_loss_coef) are
summed over the expert layers, each over the whole batch; transformers' encoder_z_loss averages over the
sparse layers (equal with one sparse layer per stack, padding included), and its encoder_aux_loss pools
f and P per row over all sparse layers (equal with one sparse layer and one row). transformers adds them
only with output_router_logits=True and only when the sparse step is above 1.

Decoding: transformers' cached generation routes one token at a time, so its capacity never binds there;
polyformer keeps the running per-row counts, so cached equals uncached (and transformers' full forward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..encoder_decoder import XTransformer
from ..moe.options import is_moe
from ..wrappers import TransformerWrapper
from . import t5
from .family import Family, Link, Unsupported

NAME = "switch_transformers"
ENCODER_EMBEDDING, DECODER_EMBEDDING = "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"
# untied (tie_word_embeddings=False), transformers builds `shared` but reads the stacks' own embeddings
UNUSED = (r"shared\.weight",)
DEFAULTS = {**{k: v for k, v in t5.DEFAULTS.items() if k != "feed_forward_proj"},
            "d_model": 768, "num_layers": 12, "num_decoder_layers": 12, "num_heads": 12, "dense_act_fn": "relu",
            "num_experts": 8, "expert_capacity": 64, "num_sparse_encoder_layers": 3, "num_sparse_decoder_layers": 3,
            "router_bias": False, "router_jitter_noise": 0.01, "router_dtype": "float32",
            "router_ignore_padding_tokens": False, "router_z_loss_coef": 0.001, "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": True}


@dataclass(frozen=True)
class ExpertsLink(Link):
    """Stacked expert weights (E, in, out) made of one nn.Linear weight (out, in) per expert."""

    def to_ours(self, tensors: list[Tensor]) -> Tensor:
        return torch.stack([t.t() for t in tensors]).contiguous()

    def to_theirs(self, t: Tensor) -> list[Tensor]:
        return [w.t().contiguous().clone() for w in t]

    def their_shapes(self, ours: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [(ours[2], ours[1])] * len(self.theirs)


def sparse_layers(depth: int, sparse: int) -> list[int]:
    """The layers transformers gives experts: i % step == 1, or every layer when step == 1, none when 0."""
    step = depth // sparse if sparse > 0 else depth
    return [i for i in range(depth) if step > 0 and (step == 1 or i % step == 1)]


def placement(depth: int, sparse: int) -> dict[str, Any]:
    """The ff_moe / ff_moe_every / ff_moe_offset keywords of one stack's sparse layers ({} when none)."""
    layers = sparse_layers(depth, sparse)
    if not layers:
        return {}
    every = depth // sparse if sparse > 0 else depth
    return {"ff_moe": True, "ff_moe_every": every, **({"ff_moe_offset": 1} if every > 2 else {})}


def as_t5(c: dict[str, Any]) -> dict[str, Any]:
    """The T5 config of the dense part, after refusing what polyformer cannot reproduce."""
    act = c["dense_act_fn"]
    problems = []
    if act not in t5.T5_ACTIVATIONS:
        problems.append(f"dense_act_fn={act!r} is not supported; supported: {', '.join(t5.T5_ACTIVATIONS)}")
    if c["router_bias"]:
        problems.append("router_bias=True is not supported (polyformer's router has no bias)")
    if c["router_dtype"] != "float32":
        problems.append(f"router_dtype={c['router_dtype']!r} is not supported (polyformer routes in float32)")
    if c["router_ignore_padding_tokens"]:
        problems.append("router_ignore_padding_tokens=True is not supported: transformers does not read it (padding "
                        "is routed and takes capacity), so a converted model could not honour it")
    if c.get("is_decoder"):
        problems.append("is_decoder=True (a causal encoder with cross-attention) is not supported")
    if problems:
        raise Unsupported(f"{NAME}: " + "; ".join(problems))
    return {**c, "feed_forward_proj": act}


def experts(c: dict[str, Any], depth: int, sparse: int) -> dict[str, Any]:
    """The expert keywords of one stack."""
    where = placement(depth, sparse)
    if not where:
        return {}
    return dict(where, ff_num_experts=c["num_experts"], ff_moe_top_k=1, ff_moe_capacity=c["expert_capacity"],
                ff_moe_route_padding=True, ff_moe_jitter=float(c["router_jitter_noise"]),
                ff_moe_balance_loss=float(c["router_aux_loss_coef"]), ff_moe_z_loss=float(c["router_z_loss_coef"]))


def _t5(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Unsupported as error:
        raise Unsupported(str(error).replace("t5:", f"{NAME}:", 1)) from None


def build(c: dict[str, Any]) -> dict[str, Any]:
    keywords = {**_t5(t5.build, as_t5(c)), "tie_token_emb": t5.tied(c)}
    for side, depth, sparse in (("enc", c["num_layers"], c["num_sparse_encoder_layers"]),
                                ("dec", t5.decoder_depth(c), c["num_sparse_decoder_layers"])):
        keywords.update({f"{side}_{k}": v for k, v in experts(c, depth, sparse).items()})
    return keywords


def build_encoder(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    stack, layers, wrap = _t5(t5.build_encoder, as_t5(c))
    return stack, {**layers, **experts(c, c["num_layers"], c["num_sparse_encoder_layers"])}, wrap


def with_experts(links: list[Link], c: dict[str, Any], stacks: list[tuple[str, str, int, int, bool]]) -> list[Link]:
    """T5's links with transformers' Switch names: `mlp` for `DenseReluDense`, and the router and experts in
    place of the feedforward at the sparse layers. stacks: (ours, theirs, depth, sparse layers, cross)."""
    moe: dict[str, str] = {}
    for ours, theirs, depth, sparse, cross in stacks:
        per = 3 if cross else 2
        moe.update({f"{ours}.blocks.{per * i + per - 1}.branch.": f"{theirs}.block.{i}.layer.{per - 1}.mlp."
                    for i in sparse_layers(depth, sparse)})
    out = [replace(link, theirs=tuple(n.replace(".DenseReluDense.", ".mlp.") for n in link.theirs))
           for link in links if not any(link.ours.startswith(f"{f}proj_") for f in moe)]
    for f, h in moe.items():
        names = [f"{h}experts.expert_{e}" for e in range(c["num_experts"])]
        out += [Link(f"{f}router.weight", (f"{h}router.classifier.weight",)),
                ExpertsLink(f"{f}experts.w_in", tuple(f"{n}.wi.weight" for n in names)),
                ExpertsLink(f"{f}experts.w_out", tuple(f"{n}.wo.weight" for n in names))]
    return out


def untied(links: list[Link], c: dict[str, Any], embeddings: dict[str, str]) -> list[Link]:
    """Untied, each stack reads its own embedding (ours: theirs) instead of the shared one."""
    if t5.tied(c):
        return links
    return [replace(link, theirs=(embeddings[link.ours],)) if link.ours in embeddings else link for link in links]


def links(c: dict[str, Any]) -> list[Link]:
    own = {"encoder.token_emb.weight": ENCODER_EMBEDDING, "decoder.net.token_emb.weight": DECODER_EMBEDDING}
    return with_experts(untied(t5.links(as_t5(c)), c, own), c, [
        ("encoder.attn_layers", "encoder", c["num_layers"], c["num_sparse_encoder_layers"], False),
        ("decoder.net.attn_layers", "decoder", t5.decoder_depth(c), c["num_sparse_decoder_layers"], True)])


def encoder_links(c: dict[str, Any]) -> list[Link]:
    return with_experts(untied(t5.encoder_links(as_t5(c)), c, {"token_emb.weight": ENCODER_EMBEDDING}), c,
                        [("attn_layers", "encoder", c["num_layers"], c["num_sparse_encoder_layers"], False)])


def sparse_count(model: TransformerWrapper, side: str) -> int:
    """The num_sparse_*_layers that places transformers' sparse layers where the stack has experts."""
    cfg = model.attn_layers.cfg
    depth, moe = cfg.depth, cfg.ff.moe
    if moe is None:
        return depth + 1        # step 0: no sparse layer
    ours = [p for p in range(depth) if is_moe(moe, p)]
    for sparse in range(1, depth + 1):
        if sparse_layers(depth, sparse) == ours:
            return sparse
    return max(1, depth // moe.every)       # the closest: `differences` names ff_moe_every / ff_moe_offset


def moe_config(models: dict[str, TransformerWrapper]) -> dict[str, Any]:
    """The Switch config fields of the stacks' experts (the first stack with experts gives the shared ones).
    What Switch cannot express (top-k above 1, no absolute capacity, other placements) is written as the
    closest Switch value, for `differences` to name."""
    options = [m.attn_layers.cfg.ff.moe for m in models.values() if m.attn_layers.cfg.ff.moe is not None]
    if not options:
        raise Unsupported(f"{NAME}: the model has no experts (ff_moe=True)")
    o = options[0]
    capacity = o.capacity if o.capacity is not None else max(m.max_seq_len for m in models.values())
    out = {"num_experts": o.num_experts, "expert_capacity": capacity, "router_jitter_noise": o.jitter,
           "router_z_loss_coef": o.z_loss, "router_aux_loss_coef": o.balance_loss, "router_bias": False,
           "router_dtype": "float32", "router_ignore_padding_tokens": False}
    for side, model in models.items():
        out[f"num_sparse_{side}_layers"] = sparse_count(model, side)
    return out


def switch_fields(c: dict[str, Any]) -> dict[str, Any]:
    """T5's config fields as Switch names them: one activation (a gated one is written ungated, for
    `differences` to name ff.glu), the scaling read from tie_word_embeddings."""
    proj = c.pop("feed_forward_proj")
    c.pop("scale_decoder_outputs", None)
    return {**c, "dense_act_fn": "gelu_new" if proj == "gated-gelu" else proj.removeprefix("gated-")}


def config_of(model: XTransformer) -> dict[str, Any]:
    c = switch_fields(t5.config_of(model))
    return {**c, **moe_config({"encoder": model.encoder, "decoder": model.decoder.net})}


def encoder_config_of(model: TransformerWrapper) -> dict[str, Any]:
    return {**switch_fields(t5.encoder_config_of(model)), **moe_config({"encoder": model})}


SWITCH_ENCODER = Family(
    model_type=NAME, classes={"SwitchTransformersEncoderModel": ""}, defaults=DEFAULTS, derived=UNUSED,
    build=build_encoder, links=encoder_links, config_of=encoder_config_of,
    aliases=lambda c: {ENCODER_EMBEDDING: t5.SHARED} if t5.tied(c) else {},
    notes={"decoder": "SwitchTransformersEncoderModel converts the encoder only: pass ignore=['decoder', "
                      "'lm_head'] to leave the decoder of a full checkpoint out"})

SWITCH = Family(
    model_type=NAME, classes={"SwitchTransformersForConditionalGeneration": ""}, defaults=DEFAULTS, derived=UNUSED,
    build=build, links=links, config_of=config_of, encoder_decoder=True,
    aliases=lambda c: t5.aliases(c) if t5.tied(c) else {}, variants=(SWITCH_ENCODER,))
