"""RoFormer (arXiv:2104.09864) as `RoFormerModel`: BERT's post-norm encoder (biases everywhere, token types
summed with the tokens then normalised) without absolute positions: rotary on queries and keys instead,
pairs interleaved (2i, 2i+1), base 10000 over the head size. Its sinusoid table (`encoder.embed_positions`,
built in float64) is rebuilt from the config, so it is dropped; rotating values too (rotary_value), a
separate embedding size and RoFormer as a decoder are refused by name."""

from __future__ import annotations

from typing import Any

from ..stack import Encoder
from ..wrappers import TransformerWrapper
from .bert import encoder_keywords, links as bert_links
from .family import Family, Link, Unsupported, activation_name, inner_dim

DEFAULTS = {"vocab_size": 50000, "embedding_size": None, "hidden_size": 768, "num_hidden_layers": 12,
            "num_attention_heads": 12, "intermediate_size": 3072, "hidden_act": "gelu",
            "max_position_embeddings": 1536, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "rotary_value": False,
            "is_decoder": False, "add_cross_attention": False}


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    if c["rotary_value"]:
        raise Unsupported("roformer: rotary_value=True (values rotated too) is not supported")
    if c["embedding_size"] not in (None, c["hidden_size"]):
        raise Unsupported(f"roformer: embedding_size ({c['embedding_size']}) must equal hidden_size "
                          f"({c['hidden_size']}): the embeddings are normalised before RoFormer's projection, "
                          "after polyformer's")
    if c["is_decoder"] or c["add_cross_attention"]:
        raise Unsupported("roformer: is_decoder / add_cross_attention (RoFormer as a decoder) is not supported")
    layers, wrap = encoder_keywords(c, "roformer")
    layers.update(rotary_pos_emb=True, rotary_interleaved=True)
    wrap["use_abs_pos_emb"] = False
    return Encoder, layers, wrap


def links(c: dict[str, Any]) -> list[Link]:
    """BERT's tensors, less the absolute position table."""
    return [link for link in bert_links(c) if link.ours != "pos_emb.emb.weight"]


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    c = model.attn_layers.cfg
    types = model.embeds["token_type"].num_embeddings if model.embeds is not None and "token_type" in model.embeds else 0
    return {"vocab_size": model.num_tokens, "embedding_size": c.dim, "hidden_size": c.dim,
            "num_hidden_layers": c.depth, "num_attention_heads": c.attention.heads,
            "intermediate_size": inner_dim(model), "hidden_act": activation_name(model),
            "max_position_embeddings": model.max_seq_len, "type_vocab_size": types, "layer_norm_eps": c.norm_eps,
            "rotary_value": False, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


ROFORMER = Family(
    model_type="roformer", classes={"RoFormerModel": ""}, defaults=DEFAULTS,
    derived=(r"encoder\.embed_positions\.weight", r"embeddings\.(position_ids|token_type_ids)"), build=build,
    links=links, config_of=config_of, embedding="embeddings.word_embeddings.weight", base_model="roformer")
