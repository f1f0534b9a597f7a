"""Mixtral (arXiv:2401.04088): Llama's decoder (llama.py) with a top-k mixture of SwiGLU experts in place of
every feedforward: a bias-free router, softmax in float32, the top-k probabilities renormalised, no capacity
limit. Hugging Face stores the experts fused: gate_up_proj (E, 2 inner, dim), gate rows first, and down_proj
(E, dim, inner); polyformer's are (E, dim, 2 inner), value (up) features first, and (E, inner, dim)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..wrappers import TransformerWrapper
from . import llama
from .family import Link, Unsupported, layer_names

DEFAULTS = {**llama.DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
            "router_aux_loss_coef": 0.001, "sliding_window": None}
NO_BIASES = {"attention_bias": False, "mlp_bias": False}


@dataclass(frozen=True)
class ExpertLink(Link):
    """A stacked expert tensor: theirs (E, out, in) is ours (E, in, out); `glu`: their rows are [gate; up],
    our columns [up | gate]."""

    glu: bool = False

    def to_ours(self, tensors: list[Tensor]) -> Tensor:
        t = tensors[0]
        if self.glu:
            gate, up = t.chunk(2, dim=1)
            t = torch.cat([up, gate], dim=1)
        return t.transpose(1, 2).contiguous()

    def to_theirs(self, t: Tensor) -> list[Tensor]:
        t = t.transpose(1, 2)
        if self.glu:
            up, gate = t.chunk(2, dim=1)
            t = torch.cat([gate, up], dim=1)
        return [t.contiguous().clone()]

    def their_shapes(self, ours: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [(ours[0], ours[2], ours[1])]


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    if c.get("sliding_window") is not None:
        raise Unsupported(f"mixtral: sliding_window={c['sliding_window']} is not supported; only None")
    if c["router_jitter_noise"]:
        raise Unsupported("mixtral: router_jitter_noise > 0 is not supported (Hugging Face jitters the experts' "
                          "inputs too; polyformer's ff_moe_jitter only the router's)")
    stack, layers, wrap = llama.build({**c, **NO_BIASES})
    k = c["num_experts_per_tok"]
    layers.update(ff_moe=True, ff_num_experts=c["num_local_experts"], ff_moe_top_k=k, ff_moe_renormalize=True,
                  ff_moe_balance_loss=float(c["router_aux_loss_coef"]) * k)     # theirs sums f over the k slots
    return stack, layers, wrap


def links(c: dict[str, Any]) -> list[Link]:
    dense = {f"{f}.branch.proj_{p}.weight" for _, f, _ in layer_names(c["num_hidden_layers"], "layers") for p in ("in", "out")}
    out = [link for link in llama.links({**c, **NO_BIASES}) if link.ours not in dense]
    for _, f, h in layer_names(c["num_hidden_layers"], "layers"):
        out += [Link(f"{f}.branch.router.weight", (f"{h}.mlp.gate.weight",)),
                ExpertLink(f"{f}.branch.experts.w_in", (f"{h}.mlp.experts.gate_up_proj",), glu=True),
                ExpertLink(f"{f}.branch.experts.w_out", (f"{h}.mlp.experts.down_proj",))]
    return out


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    moe = model.attn_layers.cfg.ff.moe
    if moe is None:
        raise Unsupported("mixtral: the model has no experts (ff_moe=True)")
    c = llama.config_of(model)
    for key in NO_BIASES:
        c.pop(key)
    return {**c, "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "router_jitter_noise": 0.0,
            "router_aux_loss_coef": moe.balance_loss / moe.top_k, "sliding_window": None,
            "output_router_logits": False}


# Llama's record (its tensor names, derived rotary buffers, tied head) with Mixtral's class and experts
MIXTRAL = replace(llama.LLAMA, model_type="mixtral", classes={"MixtralForCausalLM": "model."}, defaults=DEFAULTS,
                  build=build, links=links, config_of=config_of)
