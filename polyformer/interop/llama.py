"""Llama (arXiv:2302.13971): pre-norm decoder with RMSNorm, SwiGLU feedforward, rotary positions
paired as halves (rotate_half: feature i with i + d/2), grouped-query attention, no biases, an
untied head by default."""

from __future__ import annotations

import math
from typing import Any

from ..config import Choice
from ..routes import LLAMA3_KEYS
from ..stack import Decoder
from ..wrappers import TransformerWrapper
from .family import Family, Link, Unsupported, activation, ff_mult, head_keywords, head_links, inner_dim, layer_names

DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False}


def rope(c: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """(rope type, theta, its parameters) from a v5 config (rope_parameters) or an older one
    (rope_theta, rope_scaling)."""
    params = c.get("rope_parameters")
    if isinstance(params, dict):
        return params.get("rope_type", "default"), float(params.get("rope_theta", 10000.0)), params
    scaling = c.get("rope_scaling") or {}
    return scaling.get("rope_type", scaling.get("type", "default")), float(c.get("rope_theta", 10000.0)), scaling


SCALINGS = {"default": (), "linear": ("factor",), "llama3": LLAMA3_KEYS, "dynamic": ("factor",),
            "yarn": ("factor", "original_max_position_embeddings"),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
OPTIONAL = {"yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
            "longrope": ("factor", "attention_factor"),
            "dynamic": ("original_max_position_embeddings",)}     # Hugging Face's dynamic NTK does not read it
NEUTRAL = {"attention_factor": 1.0, "partial_rotary_factor": 1.0}     # present in some configs, no effect


def rotary_scaling(kind: str, params: dict[str, Any], max_len: int = 2048) -> dict[str, Any]:
    """The layer keywords for a rope type: linear -> rotary_interpolation_factor (position
    interpolation), llama3 -> rotary_llama3_scaling, dynamic -> rotary_dynamic_ntk (Hugging Face's original
    context is max_position_embeddings = `max_len`), yarn -> rotary_yarn, longrope -> rotary_longrope; the
    other types are refused."""
    if kind not in SCALINGS:
        raise Unsupported(f"llama: rope type {kind!r} is not supported; only {sorted(SCALINGS)}")
    known = {"rope_type", "type", "rope_theta", *SCALINGS[kind], *OPTIONAL.get(kind, ())}
    extra = sorted(k for k, v in params.items() if k not in known and not (k in NEUTRAL and v in (None, NEUTRAL[k])))
    if extra:
        raise Unsupported(f"llama: rope parameters {extra} are not supported with rope type {kind!r}")
    missing = [k for k in SCALINGS[kind] if k not in params or (params[k] is None and k != "factor")]
    if missing:
        raise Unsupported(f"llama: rope type {kind!r} needs {missing}")
    if kind == "linear":
        return {"rotary_interpolation_factor": float(params["factor"])}
    if kind == "llama3":
        return {"rotary_llama3_scaling": {k: params[k] for k in LLAMA3_KEYS}}
    if kind == "dynamic":
        return {"rotary_dynamic_ntk": (float(params["factor"]), max_len)}
    if kind == "default":
        return {}
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_len / original    # Hugging Face's default
    if kind == "yarn":
        return {"rotary_yarn": dict(factor=factor, original_max_len=original, beta_fast=params.get("beta_fast") or 32.0,
                                    beta_slow=params.get("beta_slow") or 1.0, truncate=params.get("truncate", True),
                                    attention_factor=_yarn_attention(params, factor))}
    if kind == "longrope":
        return {"rotary_longrope": dict(short_factor=params["short_factor"], long_factor=params["long_factor"],
                                        original_max_len=original, factor=factor,
                                        attention_factor=params.get("attention_factor"))}


def _yarn_attention(params: dict[str, Any], factor: float) -> float | None:
    """YaRN's attention factor as Hugging Face reads it: given, or DeepSeek's ratio of two mscales when both are
    set, else None (0.1 ln(factor) + 1, rotary_yarn's default)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and all_dim):
        return None

    def m(scale: float) -> float:
        return 0.1 * scale * math.log(factor) + 1.0 if factor > 1 else 1.0

    return m(mscale) / m(all_dim)


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    kind, theta, params = rope(c)
    scaling = rotary_scaling(kind, params, c["max_position_embeddings"])
    heads = c["num_attention_heads"]
    kv = c["num_key_value_heads"] or heads
    if heads % kv:
        raise Unsupported(f"llama: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
    dim = c["hidden_size"]
    act = activation(c["hidden_act"], "llama", "hidden_act")
    layers = dict(dim=dim, depth=c["num_hidden_layers"], heads=heads, attn_dim_head=c["head_dim"] or dim // heads,
                  rotary_pos_emb=True, rotary_base=theta, use_rmsnorm=True, norm_eps=float(c["rms_norm_eps"]),
                  ff_glu=True, ff_mult=ff_mult(c["intermediate_size"], dim), **act, **scaling)
    if kv != heads:
        layers["attn_kv_heads"] = kv
    if not c["mlp_bias"]:
        layers["ff_no_bias"] = True
    if c["attention_bias"]:
        layers.update(attn_qkv_bias=True, attn_out_bias=True)
    wrap = dict(num_tokens=c["vocab_size"], max_seq_len=c["max_position_embeddings"], **head_keywords(c))
    return Decoder, layers, wrap


def links(c: dict[str, Any]) -> list[Link]:
    heads = c["num_attention_heads"]
    kv = c["num_key_value_heads"] or heads
    d = c["head_dim"] or c["hidden_size"] // heads
    inner = c["intermediate_size"]
    kinds = ("weight", "bias") if c["attention_bias"] else ("weight",)
    ff_kinds = ("weight", "bias") if c["mlp_bias"] else ("weight",)
    out = [Link("token_emb.weight", ("embed_tokens.weight",))]
    for a, f, h in layer_names(c["num_hidden_layers"], "layers"):
        out += [Link(f"{a}.norm_in.weight", (f"{h}.input_layernorm.weight",)),
                Link(f"{f}.norm_in.weight", (f"{h}.post_attention_layernorm.weight",))]
        for kind in kinds:
            out += [Link(f"{a}.branch.project.to_qkv.{kind}",
                         tuple(f"{h}.self_attn.{p}_proj.{kind}" for p in "qkv"), sizes=(heads * d, kv * d, kv * d)),
                    Link(f"{a}.branch.output.proj.{kind}", (f"{h}.self_attn.o_proj.{kind}",))]
        for kind in ff_kinds:     # polyformer's GLU computes first_half * act(second_half): up, then gate
            out += [Link(f"{f}.branch.proj_in.{kind}", (f"{h}.mlp.up_proj.{kind}", f"{h}.mlp.gate_proj.{kind}"),
                         sizes=(inner, inner)),
                    Link(f"{f}.branch.proj_out.{kind}", (f"{h}.mlp.down_proj.{kind}",))]
    out.append(Link("attn_layers.final_norm.weight", ("norm.weight",)))
    return out + head_links(c)


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    c = model.attn_layers.cfg
    a = c.attention
    return {"vocab_size": model.num_tokens, "hidden_size": c.dim, "intermediate_size": inner_dim(model),
            "num_hidden_layers": c.depth, "num_attention_heads": a.heads,
            "num_key_value_heads": a.kv_heads or a.heads, "head_dim": a.dim_head,
            "hidden_act": "silu", "max_position_embeddings": model.max_seq_len, "rms_norm_eps": c.norm_eps,
            "tie_word_embeddings": model.to_logits is None, "attention_bias": a.qkv_bias,
            "mlp_bias": c.ff.bias, "attention_dropout": 0.0,
            "rope_parameters": rope_parameters(a.rotary_base, a.rotary_interpolation, a.rotary_llama3)
            if a.rotary_scaling is None else scaled_rope_parameters(a.rotary_base, a.rotary_scaling, model.max_seq_len)}


def rope_parameters(theta: float, interpolation: float, llama3: tuple[float, ...] | None) -> dict[str, Any]:
    if llama3 is not None:
        factor, low, high, context = llama3
        return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": int(context)}
    if interpolation != 1.0:
        return {"rope_type": "linear", "rope_theta": theta, "factor": interpolation}
    return {"rope_type": "default", "rope_theta": theta}


def scaled_rope_parameters(theta: float, scaling: Choice, max_len: int) -> dict[str, Any]:
    """Hugging Face's rope parameters of rotary_yarn / rotary_dynamic_ntk / rotary_longrope (an attention factor
    left at None is Hugging Face's default too)."""
    o = scaling.options
    if scaling.name == "dynamic":
        if o.original_max_len != max_len:
            raise Unsupported(f"llama: Hugging Face's dynamic rope scales past max_position_embeddings; "
                              f"rotary_dynamic_ntk's original_max_len ({o.original_max_len}) must equal max_seq_len "
                              f"({max_len})")
        return {"rope_type": "dynamic", "rope_theta": theta, "factor": o.factor}
    common = {"rope_type": scaling.name, "rope_theta": theta, "original_max_position_embeddings": o.original_max_len,
              "factor": o.factor}
    if o.attention_factor is not None:
        common["attention_factor"] = o.attention_factor
    if scaling.name == "yarn":
        return {**common, "beta_fast": o.beta_fast, "beta_slow": o.beta_slow, "truncate": o.truncate}
    return {**common, "short_factor": list(o.short_factor), "long_factor": list(o.long_factor)}


LLAMA = Family(
    model_type="llama", classes={"LlamaForCausalLM": "model."}, defaults=DEFAULTS,
    derived=(r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq",), build=build, links=links, config_of=config_of,
    embedding="embed_tokens.weight", tied_head="lm_head.weight")
