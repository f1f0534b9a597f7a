"""XLNet (arXiv:1906.08237) as `XLNetModel`, read as a Transformer-XL: its content stream is post-norm
relative attention (rel_pos_xl: u = r_w_bias, v = r_r_bias, W_R = r, per layer, sinusoids of d_model
concatenated as [sin, cos], distances in both directions for attn_type="bi", an Encoder; "uni" is a
Decoder), a GELU / ReLU feedforward, no biases on the projections, no final norm.

Only the content stream converts: there is no permutation mask, target mapping or query stream
(`mask_emb`), and no segment term, which XLNet adds only when `token_type_ids` are passed; so
`seg_embed`, `r_s_bias` and `mask_emb` have no place and are dropped, and a converted model takes no
token types. XLNet never masks a query's own key (a padded query still sees itself); that only
changes the outputs at padded positions. `mem_len` becomes the wrapper's `max_mem_len`.
`to_hf` writes the dropped tensors as zeros: a zero segment embedding and bias add nothing, so the
written XLNet computes what the polyformer model does, with or without token types."""

from __future__ import annotations

from typing import Any

from ..stack import Decoder, Encoder
from ..wrappers import TransformerWrapper
from .family import Family, Link, Unsupported, activation, activation_name, ff_mult, head_dim, inner_dim, layer_names

DEFAULTS = {"vocab_size": 32000, "d_model": 1024, "n_layer": 24, "n_head": 16, "d_inner": 4096,
            "ff_activation": "gelu", "attn_type": "bi", "layer_norm_eps": 1e-12, "mem_len": 512, "reuse_len": None,
            "bi_data": False, "clamp_len": -1, "same_length": False}
UNUSED = r"(mask_emb|layer\.\d+\.rel_attn\.(seg_embed|r_s_bias))"


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    if c["attn_type"] not in ("bi", "uni"):
        raise Unsupported(f"xlnet: attn_type={c['attn_type']!r} is not supported (only 'bi' and 'uni')")
    refused = [f"{k}={c[k]!r}" for k, off in (("bi_data", False), ("same_length", False)) if c[k] != off]
    if c["clamp_len"] is not None and c["clamp_len"] > 0:
        refused.append(f"clamp_len={c['clamp_len']!r}")
    if c["reuse_len"]:
        refused.append(f"reuse_len={c['reuse_len']!r}")
    if refused:
        raise Unsupported(f"xlnet: {', '.join(refused)} is not supported (polyformer reads every distance as it is, "
                          "in one direction of data, with every memory kept)")
    dim, heads = c["d_model"], c["n_head"]
    layers = dict(dim=dim, depth=c["n_layer"], heads=heads, attn_dim_head=head_dim("xlnet", dim, heads, "d_model", "n_head"),
                  rel_pos_xl=True, pre_norm=False, ff_mult=ff_mult(c["d_inner"], dim),
                  norm_eps=float(c["layer_norm_eps"]),
                  **activation(c["ff_activation"], "xlnet", "ff_activation", relu=True))
    wrap = dict(num_tokens=c["vocab_size"], max_seq_len=c["mem_len"] or 512, use_abs_pos_emb=False,
                tie_embedding=True, max_mem_len=c["mem_len"] or 0)
    return (Encoder if c["attn_type"] == "bi" else Decoder), layers, wrap


def links(c: dict[str, Any]) -> list[Link]:
    heads, dim = c["n_head"], c["d_model"]
    out = [Link("token_emb.weight", ("word_embedding.weight",))]
    for a, f, h in layer_names(c["n_layer"], "layer"):
        att = f"{h}.rel_attn"
        out += [Link(f"{a}.branch.project.to_qkv.weight", tuple(f"{att}.{p}" for p in "qkv"), sizes=(dim,) * 3,
                     transpose=True, heads=heads),
                Link(f"{a}.branch.output.proj.weight", (f"{att}.o",), heads=heads),
                Link(f"{a}.branch.relative.to_r.weight", (f"{att}.r",), transpose=True, heads=heads),
                Link(f"{a}.branch.relative.own.u", (f"{att}.r_w_bias",)),
                Link(f"{a}.branch.relative.own.v", (f"{att}.r_r_bias",))]
        for kind in ("weight", "bias"):
            out += [Link(f"{a}.post_norm.{kind}", (f"{att}.layer_norm.{kind}",)),
                    Link(f"{f}.branch.proj_in.{kind}", (f"{h}.ff.layer_1.{kind}",)),
                    Link(f"{f}.branch.proj_out.{kind}", (f"{h}.ff.layer_2.{kind}",)),
                    Link(f"{f}.post_norm.{kind}", (f"{h}.ff.layer_norm.{kind}",))]
    return out


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    c = model.attn_layers.cfg
    if c.attention.relative is None or c.attention.relative.name != "xl":
        raise Unsupported("xlnet: the model has no Transformer-XL relative encoding (rel_pos_xl=True)")
    return {"vocab_size": model.num_tokens, "d_model": c.dim, "n_layer": c.depth, "n_head": c.attention.heads,
            "d_inner": inner_dim(model), "ff_activation": activation_name(model),
            "attn_type": "uni" if c.causal else "bi", "layer_norm_eps": c.norm_eps, "mem_len": model.max_mem_len}


def zeros(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    heads, dim = c["n_head"], c["d_model"]
    out: dict[str, tuple[int, ...]] = {"mask_emb": (1, 1, dim)}
    for i in range(c["n_layer"]):
        out |= {f"layer.{i}.rel_attn.seg_embed": (2, heads, dim // heads),
                f"layer.{i}.rel_attn.r_s_bias": (heads, dim // heads)}
    return out


XLNET = Family(
    model_type="xlnet", classes={"XLNetModel": ""}, defaults=DEFAULTS, derived=(UNUSED,), build=build,
    links=links, config_of=config_of, embedding="word_embedding.weight", base_model="transformer", zeros=zeros)
