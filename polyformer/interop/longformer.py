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
from . import bert
from .bert import encoder_keywords
from .family import Family, Link, Unsupported, layer_names

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
    layers, wrap = encoder_keywords(c, "longformer", first(c))
    return Encoder, {**layers, "attn_window": window(c), "attn_global_projections": True}, wrap


def first(c: dict[str, Any]) -> int:
    """The position table row of the first token: RoBERTa counts from padding_idx + 1."""
    return int(c["pad_token_id"]) + 1


def links(c: dict[str, Any]) -> list[Link]:
    dim = c["hidden_size"]
    out = bert.links(c, first(c))
    for a, _, h in layer_names(c["num_hidden_layers"], "encoder.layer"):
        out += [Link(f"{a}.branch.global_queries.project.to_qkv.{kind}",
                     tuple(f"{h}.attention.self.{p}_global.{kind}" for p in ("query", "key", "value")), sizes=(dim,) * 3)
                for kind in ("weight", "bias")]
    return out


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    pattern = model.attn_layers.cfg.attention.pattern
    windows = [p.options.size for p in pattern if p.name == "window"] or [DEFAULTS["attention_window"]]
    return {**bert.config_of(model), "max_position_embeddings": model.max_seq_len + 2,
            "attention_window": windows[0], "pad_token_id": 1}


LONGFORMER = Family(
    model_type="longformer", classes={"LongformerModel": ""}, defaults=DEFAULTS,
    derived=(r"embeddings\.(position_ids|token_type_ids)",), build=build, links=links, config_of=config_of,
    embedding="embeddings.word_embeddings.weight", main_kwargs={"add_pooling_layer": False}, base_model="longformer",
    notes={"pooler": "LongformerModel's pooler has no place in polyformer: pass ignore=['pooler'] to leave it out"})
