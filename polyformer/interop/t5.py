"""T5 (arXiv:1910.10683) as `T5ForConditionalGeneration` (an `XTransformer`) and `T5EncoderModel` (an
encoder): pre-norm with RMS norms (no mean, no bias), no biases, T5's relative bias made in each stack's
first layer and shared by all its layers (bidirectional buckets in the encoder, causal ones in the
decoder), cross-attention without a position bias, one embedding shared by both stacks. v1.0: ReLU
feedforward and the LM head tied to the embedding, the decoder's output scaled by d_model ** -0.5;
v1.1: gated tanh-GELU, an untied head, no scaling.

Two quirks are folded into the weights rather than added as keywords: T5's scores are not divided by
sqrt(d_kv), so the query weights are multiplied by sqrt(d_kv); the output scaling multiplies the
decoder's final norm weight. Both are exact to rounding, and `to_hf` divides them back out.

    model = from_hf(t5)                                               # an XTransformer
    encoded = model.encoder(src, mask=src_mask, return_embeddings=True)
    logits = model.decoder.net(tgt, context=encoded, context_mask=src_mask)     # T5's lm_logits
    start = torch.full((b, 1), t5.config.decoder_start_token_id)
    tokens = model.generate(src, start, n, src_mask=src_mask, temperature=0.0)  # greedy

In transformers 5.x the LM head is always built tied and the scaling follows
`config.scale_decoder_outputs` (else `tie_word_embeddings` of a v4 config.json), while a checkpoint
whose lm_head differs from the shared embedding keeps it untied: the head is read from the tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..encoder_decoder import XTransformer
from ..stack import Encoder
from ..wrappers import TransformerWrapper
from .family import ACTIVATIONS, Family, Link, Unsupported, activation, ff_mult, head_keywords

DEFAULTS = {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_decoder_layers": None,
            "num_heads": 8, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
            "layer_norm_epsilon": 1e-6, "feed_forward_proj": "relu", "is_decoder": False, "pad_token_id": 0,
            "n_positions": 512}
SHARED = "shared.weight"
HEAD = "lm_head.weight"
# Hugging Face activation of T5's feed_forward_proj -> our activation keywords (relu beside the shared table)
T5_ACTIVATIONS = ("relu", *ACTIVATIONS)
OURS_TO_T5 = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "swish": "silu"}


def feedforward(c: dict[str, Any]) -> dict[str, Any]:
    """The stack keywords of `feed_forward_proj`: "act" or "gated-act" (T5's "gated-gelu" is the tanh GELU)."""
    proj = c["feed_forward_proj"]
    parts = proj.split("-") if isinstance(proj, str) else []
    gated = len(parts) == 2 and parts[0] == "gated"
    act = "gelu_new" if proj == "gated-gelu" else (parts[-1] if parts else None)
    if not (len(parts) == 1 or gated) or act not in T5_ACTIVATIONS:
        supported = ", ".join(f"{g}{a}" for g in ("", "gated-") for a in T5_ACTIVATIONS)
        raise Unsupported(f"t5: feed_forward_proj={proj!r} is not supported; supported: {supported}")
    return {**activation(act, "t5", "feed_forward_proj", relu=True), "ff_glu": gated, "ff_no_bias": True}


def stack_keywords(c: dict[str, Any], depth: int) -> dict[str, Any]:
    """The keywords of one T5 stack (without dim and causality)."""
    buckets, distance = c["relative_attention_num_buckets"], c["relative_attention_max_distance"]
    if not 4 <= buckets <= distance:    # polyformer's T5 bias: both directions get exact buckets, and a log range
        raise Unsupported(f"t5: relative_attention_num_buckets={buckets} with relative_attention_max_distance="
                          f"{distance} is not supported: it needs 4 <= relative_attention_num_buckets <= "
                          "relative_attention_max_distance")
    return dict(depth=depth, heads=c["num_heads"], attn_dim_head=c["d_kv"], use_rmsnorm=True,
                norm_eps=float(c["layer_norm_epsilon"]), rel_pos_bias=True,
                rel_pos_num_buckets=c["relative_attention_num_buckets"],
                rel_pos_max_distance=c["relative_attention_max_distance"],
                ff_mult=ff_mult(c["d_ff"], c["d_model"]), **feedforward(c))


def decoder_depth(c: dict[str, Any]) -> int:
    return c["num_decoder_layers"] if c["num_decoder_layers"] is not None else c["num_layers"]


def tied(c: dict[str, Any]) -> bool:
    """tie_word_embeddings, True unless a config sets it False."""
    return c.get("tie_word_embeddings") is not False


def resolve(c: dict[str, Any], tensors: dict[str, Tensor]) -> dict[str, Any]:
    """`scale_decoder_outputs` as transformers reads it, and `tie_word_embeddings` as what the tensors
    hold: a head absent or equal to the shared embedding is tied."""
    scale = c.get("scale_decoder_outputs")
    if scale is None:
        scale = tied(c)
    head, shared = tensors.get(HEAD), tensors.get(SHARED)
    same = head is None or (shared is not None and head.shape == shared.shape and torch.equal(head, shared))
    return {**c, "scale_decoder_outputs": bool(scale), "tie_word_embeddings": same}


def build(c: dict[str, Any]) -> dict[str, Any]:
    """The `XTransformer` keywords of T5ForConditionalGeneration."""
    keywords: dict[str, Any] = dict(dim=c["d_model"], tie_token_emb=True, pad_value=c["pad_token_id"] or 0)
    sides = (("enc", stack_keywords(c, c["num_layers"]), {"tie_embedding": True}),
             ("dec", stack_keywords(c, decoder_depth(c)), head_keywords({"tie_word_embeddings": tied(c)})))
    for side, layers, head in sides:
        wrap = dict(num_tokens=c["vocab_size"], max_seq_len=c["n_positions"], use_abs_pos_emb=False, **head)
        keywords.update({f"{side}_{k}": v for k, v in {**layers, **wrap}.items()})
    return keywords


def build_encoder(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    if c["is_decoder"]:
        raise Unsupported("t5: T5EncoderModel with is_decoder=True (a causal encoder) is not supported")
    layers = dict(dim=c["d_model"], **stack_keywords(c, c["num_layers"]))
    return Encoder, layers, dict(num_tokens=c["vocab_size"], max_seq_len=c["n_positions"], use_abs_pos_emb=False,
                                 tie_embedding=True)


def stack_links(c: dict[str, Any], ours: str, theirs: str, depth: int, cross: bool) -> list[Link]:
    """The links of one stack: our `ours.blocks.*` (a, [c,] f per layer) and their `theirs.block.*`."""
    inner, d_ff, q_scale = c["num_heads"] * c["d_kv"], c["d_ff"], c["d_kv"] ** 0.5
    gated = feedforward(c)["ff_glu"]
    per = 3 if cross else 2
    out = [Link(f"{ours}.shared_bias.embedding.weight",
                (f"{theirs}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",))]
    for i in range(depth):
        blocks = [f"{ours}.blocks.{per * i + k}" for k in range(per)]
        h = f"{theirs}.block.{i}.layer"
        a, f = blocks[0], blocks[-1]
        out += [Link(f"{a}.norm_in.weight", (f"{h}.0.layer_norm.weight",)),
                Link(f"{a}.branch.project.to_qkv.weight", tuple(f"{h}.0.SelfAttention.{p}.weight" for p in "qkv"),
                     sizes=(inner,) * 3, scales=(q_scale, 1.0, 1.0)),
                Link(f"{a}.branch.output.proj.weight", (f"{h}.0.SelfAttention.o.weight",))]
        if cross:
            x = blocks[1]
            out += [Link(f"{x}.norm_in.weight", (f"{h}.1.layer_norm.weight",)),
                    Link(f"{x}.branch.project.to_q.weight", (f"{h}.1.EncDecAttention.q.weight",), scales=(q_scale,)),
                    Link(f"{x}.branch.project.to_kv.weight", (f"{h}.1.EncDecAttention.k.weight",
                                                              f"{h}.1.EncDecAttention.v.weight"), sizes=(inner,) * 2),
                    Link(f"{x}.branch.output.proj.weight", (f"{h}.1.EncDecAttention.o.weight",))]
        ff = f"{h}.{per - 1}"
        # polyformer's GLU is first_half * act(second_half); T5's act(wi_0) * wi_1
        proj_in = ((f"{ff}.DenseReluDense.wi_1.weight", f"{ff}.DenseReluDense.wi_0.weight") if gated
                   else (f"{ff}.DenseReluDense.wi.weight",))
        out += [Link(f"{f}.norm_in.weight", (f"{ff}.layer_norm.weight",)),
                Link(f"{f}.branch.proj_in.weight", proj_in, sizes=(d_ff,) * len(proj_in)),
                Link(f"{f}.branch.proj_out.weight", (f"{ff}.DenseReluDense.wo.weight",))]
    return out


def links(c: dict[str, Any]) -> list[Link]:
    scale = (c["d_model"] ** -0.5,) if c.get("scale_decoder_outputs", tied(c)) else ()
    out = [Link("encoder.token_emb.weight", (SHARED,)), Link("decoder.net.token_emb.weight", (SHARED,)),
           *stack_links(c, "encoder.attn_layers", "encoder", c["num_layers"], cross=False),
           Link("encoder.attn_layers.final_norm.weight", ("encoder.final_layer_norm.weight",)),
           *stack_links(c, "decoder.net.attn_layers", "decoder", decoder_depth(c), cross=True),
           Link("decoder.net.attn_layers.final_norm.weight", ("decoder.final_layer_norm.weight",), scales=scale)]
    if not tied(c):
        out.append(Link("decoder.net.to_logits.weight", (HEAD,)))
    return out


def encoder_links(c: dict[str, Any]) -> list[Link]:
    return [Link("token_emb.weight", (SHARED,)),
            *stack_links(c, "attn_layers", "encoder", c["num_layers"], cross=False),
            Link("attn_layers.final_norm.weight", ("encoder.final_layer_norm.weight",))]


def aliases(c: dict[str, Any]) -> dict[str, str]:
    head = {HEAD: SHARED} if tied(c) else {}
    return {"encoder.embed_tokens.weight": SHARED, "decoder.embed_tokens.weight": SHARED, **head}


def stack_config(model: TransformerWrapper) -> dict[str, Any]:
    """The T5 config fields of one wrapper's stack."""
    c = model.attn_layers.cfg
    a = c.attention
    act = OURS_TO_T5.get(c.ff.activation)
    if act is None:
        raise Unsupported(f"t5: no feed_forward_proj has the activation {c.ff.activation!r}")
    proj = ("gated-gelu" if act == "gelu_new" else f"gated-{act}") if c.ff.glu else act
    return {"vocab_size": model.num_tokens, "d_model": c.dim, "d_kv": a.dim_head, "d_ff": int(c.dim * c.ff.mult),
            "num_layers": c.depth, "num_heads": a.heads, "relative_attention_num_buckets": a.rel_pos_num_buckets,
            "relative_attention_max_distance": a.rel_pos_max_distance, "layer_norm_epsilon": c.norm_eps,
            "feed_forward_proj": proj, "n_positions": model.max_seq_len, "dropout_rate": 0.0}


def config_of(model: XTransformer) -> dict[str, Any]:
    """A tied head is written with the v1.0 output scaling, an untied one without (v1.1), each folded
    into the decoder's final norm as `links` reads it."""
    decoder = model.decoder.net
    tied = decoder.to_logits is None
    return {**stack_config(model.encoder), "num_decoder_layers": decoder.attn_layers.cfg.depth,
            "tie_word_embeddings": tied, "scale_decoder_outputs": tied, "is_encoder_decoder": True,
            "pad_token_id": model.decoder.pad_value}


def encoder_config_of(model: TransformerWrapper) -> dict[str, Any]:
    return {**stack_config(model), "is_encoder_decoder": False, "use_cache": False}


# an encoder-decoder bias some checkpoints keep: transformers never uses it (_keys_to_ignore_on_load_unexpected)
UNUSED = (r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight",)

T5_ENCODER = Family(
    model_type="t5", classes={"T5EncoderModel": ""}, defaults=DEFAULTS, derived=UNUSED, build=build_encoder,
    links=encoder_links, config_of=encoder_config_of,
    aliases=lambda c: {"encoder.embed_tokens.weight": SHARED},
    notes={"decoder": "T5EncoderModel converts the encoder only: pass ignore=['decoder', 'lm_head'] to leave "
                      "the decoder of a full checkpoint out"})

T5 = Family(
    model_type="t5", classes={"T5ForConditionalGeneration": ""}, defaults=DEFAULTS, derived=UNUSED, build=build,
    links=links, config_of=config_of, encoder_decoder=True, aliases=aliases, resolve=resolve,
    variants=(T5_ENCODER,))
