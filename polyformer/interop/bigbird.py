"""BigBird (arXiv:2007.14062) as `BigBirdModel`: BERT's post-norm encoder (positions from 0, token
types, q / k / v biases when use_bias) with attention_type "block_sparse" as `attn_bigbird_blocks`
(block_size, num_random_blocks), or "original_full" as dense attention.

Reproduced in eval mode, where Hugging Face draws every random block as block 0
(patterns/bigbird_blocks.py). Hugging Face pads the input to a multiple of block_size inside its
forward and masks the padding; the pattern takes any length and pads inside the same way (the last,
partial block is global), so outputs equal Hugging Face's at every length. Not reproduced: the
random blocks of train mode (a NumPy table, seeded by the layer index), and Hugging Face's switch to
full attention being permanent: an input of at most (5 + 2 num_random_blocks) block_size tokens gets
full attention in both, but a later, longer input gets block-sparse attention here while that model
stays full."""

from __future__ import annotations

from typing import Any

from ..stack import Encoder
from ..wrappers import TransformerWrapper
from . import bert
from .bert import encoder_keywords
from .family import Family, Link, Unsupported, layer_names

DEFAULTS = {"vocab_size": 50358, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "intermediate_size": 3072, "hidden_act": "gelu_new", "max_position_embeddings": 4096,
            "type_vocab_size": 2, "layer_norm_eps": 1e-12, "use_bias": True, "rescale_embeddings": False,
            "attention_type": "block_sparse", "block_size": 64, "num_random_blocks": 3, "is_decoder": False,
            "add_cross_attention": False, "pad_token_id": 0}


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    if c["is_decoder"] or c["add_cross_attention"]:
        raise Unsupported("big_bird: is_decoder / add_cross_attention (BigBird as a decoder) is not supported")
    if c["rescale_embeddings"]:
        raise Unsupported("big_bird: rescale_embeddings=True (token embeddings times sqrt(hidden_size)) is not "
                          "supported")
    layers, wrap = encoder_keywords(c, "big_bird")
    if not c["use_bias"]:
        del layers["attn_qkv_bias"]
    kind = c["attention_type"]
    if kind == "block_sparse":
        layers["attn_bigbird_blocks"] = dict(block_size=int(c["block_size"]),
                                             random_blocks=int(c["num_random_blocks"]))
    elif kind != "original_full":
        raise Unsupported(f"big_bird: attention_type={kind!r} is not supported ('block_sparse' or 'original_full')")
    return Encoder, layers, wrap


def links(c: dict[str, Any]) -> list[Link]:
    out = bert.links(c)
    if c["use_bias"]:
        return out
    qkv = {f"{a}.branch.project.to_qkv.bias" for a, _, _ in layer_names(c["num_hidden_layers"], "encoder.layer")}
    return [link for link in out if link.ours not in qkv]


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    attention = model.attn_layers.cfg.attention
    blocks = [p.options for p in attention.pattern if p.name == "bigbird_blocks"]
    out = {**bert.config_of(model), "use_bias": attention.qkv_bias, "rescale_embeddings": False,
           "attention_type": "block_sparse" if blocks else "original_full", "pad_token_id": 0}
    if blocks:
        out.update(block_size=blocks[0].block_size, num_random_blocks=blocks[0].random_blocks)
    return out


BIGBIRD = Family(
    model_type="big_bird", classes={"BigBirdModel": ""}, defaults=DEFAULTS,
    derived=(r"embeddings\.(position_ids|token_type_ids)",), build=build, links=links, config_of=config_of,
    embedding="embeddings.word_embeddings.weight", main_kwargs={"add_pooling_layer": False}, base_model="bert",
    notes={"pooler": "BigBirdModel's pooler (tanh of a dense layer on [CLS]) has no place in polyformer: pass "
                     "ignore=['pooler'] to leave it out"})
