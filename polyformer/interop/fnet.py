"""FNet (arXiv:2105.03824) as `FNetModel`: BERT's post-norm encoder with Fourier mixing (`attn_fnet`)
in place of self-attention; word, position and token-type embeddings summed, normalised
(post_emb_norm), then projected by a linear layer (post_emb_proj); tanh GELU by default. The pooler and
the pre-training heads are not part of it.

Hugging Face's FNet takes no attention mask: padding is part of the sequence it transforms. Given
a mask, polyformer zeroes padded positions before each transform instead (mixers/fnet.py), so the two
agree on unpadded inputs. `use_tpu_fourier_optimizations=True` (the DFT as complex64 matrix products,
for inputs of exactly `tpu_short_seq_length` tokens) computes the same transform as the FFT; it
converts, and `to_hf` writes the FFT setting."""

from __future__ import annotations

from typing import Any

from ..stack import Encoder
from ..wrappers import TransformerWrapper
from .bert import feedforward_links
from .family import Family, Link, activation, activation_name, ff_mult, inner_dim, layer_names

DEFAULTS = {"vocab_size": 32000, "hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072,
            "hidden_act": "gelu_new", "max_position_embeddings": 512, "type_vocab_size": 4, "layer_norm_eps": 1e-12}


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    dim = c["hidden_size"]
    layers = dict(dim=dim, depth=c["num_hidden_layers"], attn_fnet=True, pre_norm=False,
                  ff_mult=ff_mult(c["intermediate_size"], dim), norm_eps=float(c["layer_norm_eps"]),
                  **activation(c["hidden_act"], "fnet", "hidden_act"))
    wrap: dict[str, Any] = dict(num_tokens=c["vocab_size"], max_seq_len=c["max_position_embeddings"],
                                use_abs_pos_emb=True, post_emb_norm=True, post_emb_proj=True, tie_embedding=True)
    if c["type_vocab_size"]:
        wrap["embed_num_tokens"] = {"token_type": c["type_vocab_size"]}
    return Encoder, layers, wrap


def links(c: dict[str, Any]) -> list[Link]:
    out = [Link("token_emb.weight", ("embeddings.word_embeddings.weight",)),
           Link("pos_emb.emb.weight", ("embeddings.position_embeddings.weight",))]
    for kind in ("weight", "bias"):
        out += [Link(f"post_emb_norm.{kind}", (f"embeddings.LayerNorm.{kind}",)),
                Link(f"post_emb_proj.{kind}", (f"embeddings.projection.{kind}",))]
    if c["type_vocab_size"]:
        out.append(Link("embeds.token_type.weight", ("embeddings.token_type_embeddings.weight",)))
    for a, f, h in layer_names(c["num_hidden_layers"], "encoder.layer"):
        for kind in ("weight", "bias"):
            out += [Link(f"{a}.post_norm.{kind}", (f"{h}.fourier.output.LayerNorm.{kind}",)),
                    *feedforward_links(f, h, kind)]
    return out


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    c = model.attn_layers.cfg
    types = model.embeds["token_type"].num_embeddings if model.embeds is not None and "token_type" in model.embeds else 0
    return {"vocab_size": model.num_tokens, "hidden_size": c.dim, "num_hidden_layers": c.depth,
            "intermediate_size": inner_dim(model), "hidden_act": activation_name(model),
            "max_position_embeddings": model.max_seq_len, "type_vocab_size": types, "layer_norm_eps": c.norm_eps,
            "hidden_dropout_prob": 0.0, "use_tpu_fourier_optimizations": False}


FNET = Family(
    model_type="fnet", classes={"FNetModel": ""}, defaults=DEFAULTS,
    derived=(r"embeddings\.(position_ids|token_type_ids)", r"encoder\.layer\.\d+\.fourier\.self\.dft_mat_(hidden|seq)"),
    build=build, links=links, config_of=config_of, embedding="embeddings.word_embeddings.weight",
    main_kwargs={"add_pooling_layer": False}, base_model="fnet",
    notes={"pooler": "FNetModel's pooler (tanh of a dense layer on the first token) has no place in polyformer: "
                     "pass ignore=['pooler'] to leave it out"})
