"""Longformer (arXiv:2004.05150) as `LongformerModel`: BERT's post-norm encoder with RoBERTa's
embeddings (positions start at pad_token_id + 1), a bidirectional sliding window of
`attention_window` (w // 2 keys each side), and global tokens (`global_attention_mask`, our
`global_mask`) whose rows come from their own query / key / value projections. Hugging Face pads
the input to a multiple of the window inside its forward; polyformer takes any length, and the
padding changes nothing at the kept positions. One window for every layer: a per-layer list of
different windows is refused."""

from __future__ import annotations

from typing import Any

from ..stack import Encoder
from ..wrappers import TransformerWrapper
from .family import (Family, Link, Unsupported, activation, activation_name, ff_mult, head_dim, inner_dim,
                     layer_names)

DEFAULTS = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "intermediate_size": 3072, "hidden_act": "gelu", "max_position_embeddings": 512, "type_vocab_size": 2,
            "layer_norm_eps": 1e-12, "attention_window": 512, "pad_token_id": 1}


def window(c: dict[str, Any]) -> int:
    w = c["attention_window"]
    if isinstance(w, (list, tuple)):
        if len(set(w)) != 1:
            raise Unsupported(f"longformer: attention_window differs by layer ({list(w)}); polyformer has one "
                              "window for every layer")
        w = w[0]
    if w % 2 or w < 2:
        raise Unsupported(f"longformer: attention_window must be a positive even number, got {w}")
    return int(w)


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    dim, heads = c["hidden_size"], c["num_attention_heads"]
    d = head_dim("longformer", dim, heads, "hidden_size", "num_attention_heads")
    layers = dict(dim=dim, depth=c["num_hidden_layers"], heads=heads, attn_dim_head=d, pre_norm=False,
                  attn_qkv_bias=True, attn_out_bias=True, ff_mult=ff_mult(c["intermediate_size"], dim),
                  norm_eps=float(c["layer_norm_eps"]), attn_window=window(c), attn_global_projections=True,
                  **activation(c["hidden_act"], "longformer", "hidden_act"))
    wrap: dict[str, Any] = dict(num_tokens=c["vocab_size"], max_seq_len=c["max_position_embeddings"] - first(c),
                                use_abs_pos_emb=True, post_emb_norm=True, tie_embedding=True)
    if c["type_vocab_size"]:
        wrap["embed_num_tokens"] = {"token_type": c["type_vocab_size"]}
    return Encoder, layers, wrap


def first(c: dict[str, Any]) -> int:
    """The position table row of the first token: RoBERTa counts from padding_idx + 1."""
    return int(c["pad_token_id"]) + 1


def links(c: dict[str, Any]) -> list[Link]:
    dim = c["hidden_size"]
    out = [Link("token_emb.weight", ("embeddings.word_embeddings.weight",)),
           Link("pos_emb.emb.weight", ("embeddings.position_embeddings.weight",), offset=first(c)),
           Link("post_emb_norm.weight", ("embeddings.LayerNorm.weight",)),
           Link("post_emb_norm.bias", ("embeddings.LayerNorm.bias",))]
    if c["type_vocab_size"]:
        out.append(Link("embeds.token_type.weight", ("embeddings.token_type_embeddings.weight",)))
    for a, f, h in layer_names(c["num_hidden_layers"], "encoder.layer"):
        for kind in ("weight", "bias"):
            out += [Link(f"{a}.branch.project.to_qkv.{kind}",
                         tuple(f"{h}.attention.self.{p}.{kind}" for p in ("query", "key", "value")), sizes=(dim,) * 3),
                    Link(f"{a}.branch.global_queries.project.to_qkv.{kind}",
                         tuple(f"{h}.attention.self.{p}_global.{kind}" for p in ("query", "key", "value")),
                         sizes=(dim,) * 3),
                    Link(f"{a}.branch.output.proj.{kind}", (f"{h}.attention.output.dense.{kind}",)),
                    Link(f"{a}.post_norm.{kind}", (f"{h}.attention.output.LayerNorm.{kind}",)),
                    Link(f"{f}.branch.proj_in.{kind}", (f"{h}.intermediate.dense.{kind}",)),
                    Link(f"{f}.branch.proj_out.{kind}", (f"{h}.output.dense.{kind}",)),
                    Link(f"{f}.post_norm.{kind}", (f"{h}.output.LayerNorm.{kind}",))]
    return out


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    c = model.attn_layers.cfg
    windows = [p.options.size for p in c.attention.pattern if p.name == "window"] or [DEFAULTS["attention_window"]]
    types = model.embeds["token_type"].num_embeddings if model.embeds is not None and "token_type" in model.embeds else 0
    return {"vocab_size": model.num_tokens, "hidden_size": c.dim, "num_hidden_layers": c.depth,
            "num_attention_heads": c.attention.heads, "intermediate_size": inner_dim(model),
            "hidden_act": activation_name(model), "max_position_embeddings": model.max_seq_len + 2,
            "type_vocab_size": types, "layer_norm_eps": c.norm_eps, "attention_window": windows[0],
            "pad_token_id": 1, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


LONGFORMER = Family(
    model_type="longformer", classes={"LongformerModel": ""}, defaults=DEFAULTS,
    derived=(r"embeddings\.(position_ids|token_type_ids)",), build=build, links=links, config_of=config_of,
    embedding="embeddings.word_embeddings.weight", main_kwargs={"add_pooling_layer": False}, base_model="longformer",
    notes={"pooler": "LongformerModel's pooler has no place in polyformer: pass ignore=['pooler'] to leave it out"})
