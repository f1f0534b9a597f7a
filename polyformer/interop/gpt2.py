"""GPT-2 (Radford et al. 2019): pre-norm decoder, learned absolute positions, biases everywhere,
GELU's tanh approximation ("gelu_new"), Conv1D weights stored as (in, out), head tied to the
token embedding."""

from __future__ import annotations

from typing import Any

from ..stack import Decoder
from ..wrappers import TransformerWrapper
from .family import (Family, Link, Unsupported, activation, activation_name, ff_mult, head_dim, head_keywords,
                     head_links, inner_dim, layer_names)

DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False, "tie_word_embeddings": True}


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    if not c["scale_attn_weights"]:
        raise Unsupported("gpt2: scale_attn_weights=False (unscaled attention scores) is not supported")
    if c["scale_attn_by_inverse_layer_idx"]:
        raise Unsupported("gpt2: scale_attn_by_inverse_layer_idx=True (scores divided by the layer index) "
                          "is not supported")
    if c["add_cross_attention"]:
        raise Unsupported("gpt2: add_cross_attention=True is not supported")
    dim, heads = c["n_embd"], c["n_head"]
    d = head_dim("gpt2", dim, heads, "n_embd", "n_head")
    layers = dict(dim=dim, depth=c["n_layer"], heads=heads, attn_dim_head=d, attn_qkv_bias=True,
                  attn_out_bias=True, ff_mult=ff_mult(c["n_inner"] or 4 * dim, dim),
                  norm_eps=float(c["layer_norm_epsilon"]),
                  **activation(c["activation_function"], "gpt2", "activation_function"))
    wrap = dict(num_tokens=c["vocab_size"], max_seq_len=c["n_positions"], use_abs_pos_emb=True, **head_keywords(c))
    return Decoder, layers, wrap


def links(c: dict[str, Any]) -> list[Link]:
    out = [Link("token_emb.weight", ("wte.weight",)), Link("pos_emb.emb.weight", ("wpe.weight",))]
    for a, f, h in layer_names(c["n_layer"], "h"):
        for kind in ("weight", "bias"):
            t = kind == "weight"          # Conv1D weights are (in, out)
            out += [Link(f"{a}.norm_in.{kind}", (f"{h}.ln_1.{kind}",)),
                    Link(f"{a}.branch.project.to_qkv.{kind}", (f"{h}.attn.c_attn.{kind}",), transpose=t),
                    Link(f"{a}.branch.output.proj.{kind}", (f"{h}.attn.c_proj.{kind}",), transpose=t),
                    Link(f"{f}.norm_in.{kind}", (f"{h}.ln_2.{kind}",)),
                    Link(f"{f}.branch.proj_in.{kind}", (f"{h}.mlp.c_fc.{kind}",), transpose=t),
                    Link(f"{f}.branch.proj_out.{kind}", (f"{h}.mlp.c_proj.{kind}",), transpose=t)]
    out += [Link(f"attn_layers.final_norm.{kind}", (f"ln_f.{kind}",)) for kind in ("weight", "bias")]
    return out + head_links(c)


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    c = model.attn_layers.cfg
    inner = inner_dim(model)
    return {"vocab_size": model.num_tokens, "n_positions": model.max_seq_len, "n_embd": c.dim, "n_layer": c.depth,
            "n_head": c.attention.heads, "n_inner": None if inner == 4 * c.dim else inner,
            "activation_function": activation_name(model), "layer_norm_epsilon": c.norm_eps,
            "tie_word_embeddings": model.to_logits is None,
            # GPT-2's <|endoftext|> is id 50256 of its own vocabulary; another vocabulary has no known id
            "bos_token_id": 50256 if model.num_tokens > 50256 else None,
            "eos_token_id": 50256 if model.num_tokens > 50256 else None,
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}


GPT2 = Family(
    model_type="gpt2", classes={"GPT2LMHeadModel": "transformer.", "GPT2Model": ""}, defaults=DEFAULTS,
    derived=(r"h\.\d+\.attn\.(bias|masked_bias)",), build=build, links=links, config_of=config_of,
    embedding="wte.weight", tied_head="lm_head.weight", base_model="transformer")
