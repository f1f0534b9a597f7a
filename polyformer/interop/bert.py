"""BERT (arXiv:1810.04805) as `BertModel`: post-norm encoder, learned absolute positions and token
types summed then normalised (post_emb_norm), biases everywhere, exact GELU. The pooler and the
pre-training heads are not part of it."""

from __future__ import annotations

from typing import Any

from ..stack import Encoder
from ..wrappers import TransformerWrapper
from .family import (Family, Link, Unsupported, activation, activation_name, ff_mult, head_dim, inner_dim,
                     layer_names)

DEFAULTS = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "intermediate_size": 3072, "hidden_act": "gelu", "max_position_embeddings": 512, "type_vocab_size": 2,
            "layer_norm_eps": 1e-12, "position_embedding_type": "absolute", "is_decoder": False,
            "add_cross_attention": False}


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    if c.get("position_embedding_type", "absolute") != "absolute":
        raise Unsupported(f"bert: position_embedding_type={c['position_embedding_type']!r} is not supported "
                          "(only 'absolute')")
    if c["is_decoder"] or c["add_cross_attention"]:
        raise Unsupported("bert: is_decoder / add_cross_attention (BERT as a decoder) is not supported")
    return Encoder, *encoder_keywords(c, "bert")


def encoder_keywords(c: dict[str, Any], family: str, first_position: int = 0) -> tuple[dict, dict]:
    """The stack and wrapper keywords of BERT's encoder (also Longformer's, whose positions start at
    row `first_position` of the table)."""
    dim, heads = c["hidden_size"], c["num_attention_heads"]
    d = head_dim(family, dim, heads, "hidden_size", "num_attention_heads")
    layers = dict(dim=dim, depth=c["num_hidden_layers"], heads=heads, attn_dim_head=d, pre_norm=False,
                  attn_qkv_bias=True, attn_out_bias=True, ff_mult=ff_mult(c["intermediate_size"], dim),
                  norm_eps=float(c["layer_norm_eps"]), **activation(c["hidden_act"], family, "hidden_act"))
    wrap: dict[str, Any] = dict(num_tokens=c["vocab_size"], max_seq_len=c["max_position_embeddings"] - first_position,
                                use_abs_pos_emb=True, post_emb_norm=True, tie_embedding=True)
    if c["type_vocab_size"]:
        wrap["embed_num_tokens"] = {"token_type": c["type_vocab_size"]}
    return layers, wrap


def links(c: dict[str, Any], first_position: int = 0) -> list[Link]:
    dim = c["hidden_size"]
    out = [Link("token_emb.weight", ("embeddings.word_embeddings.weight",)),
           Link("pos_emb.emb.weight", ("embeddings.position_embeddings.weight",), offset=first_position),
           Link("post_emb_norm.weight", ("embeddings.LayerNorm.weight",)),
           Link("post_emb_norm.bias", ("embeddings.LayerNorm.bias",))]
    if c["type_vocab_size"]:
        out.append(Link("embeds.token_type.weight", ("embeddings.token_type_embeddings.weight",)))
    for a, f, h in layer_names(c["num_hidden_layers"], "encoder.layer"):
        for kind in ("weight", "bias"):
            out += [Link(f"{a}.branch.project.to_qkv.{kind}",
                         tuple(f"{h}.attention.self.{p}.{kind}" for p in ("query", "key", "value")), sizes=(dim,) * 3),
                    Link(f"{a}.branch.output.proj.{kind}", (f"{h}.attention.output.dense.{kind}",)),
                    Link(f"{a}.post_norm.{kind}", (f"{h}.attention.output.LayerNorm.{kind}",)),
                    *feedforward_links(f, h, kind)]
    return out


def feedforward_links(f: str, h: str, kind: str) -> list[Link]:
    """A BERT-like layer's feedforward (intermediate, output dense, its LayerNorm): our block f, theirs h."""
    return [Link(f"{f}.branch.proj_in.{kind}", (f"{h}.intermediate.dense.{kind}",)),
            Link(f"{f}.branch.proj_out.{kind}", (f"{h}.output.dense.{kind}",)),
            Link(f"{f}.post_norm.{kind}", (f"{h}.output.LayerNorm.{kind}",))]


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    c = model.attn_layers.cfg
    types = model.embeds["token_type"].num_embeddings if model.embeds is not None and "token_type" in model.embeds else 0
    return {"vocab_size": model.num_tokens, "hidden_size": c.dim, "num_hidden_layers": c.depth,
            "num_attention_heads": c.attention.heads, "intermediate_size": inner_dim(model),
            "hidden_act": activation_name(model), "max_position_embeddings": model.max_seq_len,
            "type_vocab_size": types, "layer_norm_eps": c.norm_eps, "position_embedding_type": "absolute",
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


BERT = Family(
    model_type="bert", classes={"BertModel": ""}, defaults=DEFAULTS,
    derived=(r"embeddings\.(position_ids|token_type_ids)",), build=build, links=links, config_of=config_of,
    embedding="embeddings.word_embeddings.weight", main_kwargs={"add_pooling_layer": False}, base_model="bert",
    notes={"pooler": "BertModel's pooler (tanh of a dense layer on [CLS]) has no place in polyformer: pass "
                     "ignore=['pooler'] to leave it out",
           "cls": "BERT's pre-training heads are not converted: pass ignore=['cls'] to leave them out"})
