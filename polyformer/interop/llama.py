"""Llama (arXiv:2302.13971): pre-norm decoder with RMSNorm, SwiGLU feedforward, rotary positions
paired as halves (rotate_half: feature i with i + d/2), grouped-query attention, no biases, an
untied head by default."""

from __future__ import annotations

from typing import Any

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


SCALINGS = {"default": (), "linear": ("factor",), "llama3": LLAMA3_KEYS}
NEUTRAL = {"attention_factor": 1.0, "partial_rotary_factor": 1.0}     # present in some configs, no effect


def rotary_scaling(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """The layer keywords for a rope type: linear -> rotary_interpolation_factor (position
    interpolation), llama3 -> rotary_llama3_scaling; the other types are refused."""
    if kind not in SCALINGS:
        raise Unsupported(f"llama: rope type {kind!r} is not supported; only {sorted(SCALINGS)}")
    known = {"rope_type", "type", "rope_theta", *SCALINGS[kind]}
    extra = sorted(k for k, v in params.items() if k not in known and not (k in NEUTRAL and v in (None, NEUTRAL[k])))
    if extra:
        raise Unsupported(f"llama: rope parameters {extra} are not supported with rope type {kind!r}")
    missing = [k for k in SCALINGS[kind] if k not in params]
    if missing:
        raise Unsupported(f"llama: rope type {kind!r} needs {missing}")
    if kind == "linear":
        return {"rotary_interpolation_factor": float(params["factor"])}
    if kind == "llama3":
        return {"rotary_llama3_scaling": {k: params[k] for k in LLAMA3_KEYS}}
    return {}


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    kind, theta, params = rope(c)
    scaling = rotary_scaling(kind, params)
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
            "rope_parameters": rope_parameters(a.rotary_base, a.rotary_interpolation, a.rotary_llama3)}


def rope_parameters(theta: float, interpolation: float, llama3: tuple[float, ...] | None) -> dict[str, Any]:
    if llama3 is not None:
        factor, low, high, context = llama3
        return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": int(context)}
    if interpolation != 1.0:
        return {"rope_type": "linear", "rope_theta": theta, "factor": interpolation}
    return {"rope_type": "default", "rope_theta": theta}


LLAMA = Family(
    model_type="llama", classes={"LlamaForCausalLM": "model."}, defaults=DEFAULTS,
    derived=(r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq",), build=build, links=links, config_of=config_of,
    embedding="embed_tokens.weight", tied_head="lm_head.weight")
