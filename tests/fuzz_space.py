"""The fuzzer's space (tests/test_fuzz.py): keyword rows per wrapper, a drawn `Case`, and its build
through the public classes. A row is one keyword: how often it is drawn and which values (some out
of range on purpose: a refusal must then name the keyword)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import assume, event, note
from hypothesis import strategies as st

from polyformer import (ContinuousTransformerWrapper, Decoder, Encoder, TransformerWrapper, ViTransformerWrapper,
                        XTransformer)
from polyformer.stack import AttentionLayers
from tests.options import perturb


NUM_TOKENS = 16
MAX_SEQ_LEN = 12
IMAGE = 8

# ---------------------------------------------------------------------------------------------
# draws


def sometimes(values: list | tuple, p: int = 4) -> st.SearchStrategy:
    """None (keyword not given) p times out of p + 1, else one of `values`; shrinks towards None.
    One `sampled_from` per keyword keeps a draw cheap (a draw is ~60 choices)."""
    values = tuple(values)
    return st.sampled_from((None,) * (p * len(values)) + values)


TRUE = (True,)
BOOL = (True, False)

# one row per layer keyword: how often it is drawn and which values (some out of range on purpose)
LAYER_SPACE: dict[str, st.SearchStrategy] = {
    # positions
    "rotary_pos_emb": sometimes(TRUE, 3),
    "rotary_emb_dim": sometimes([2, 4, 3], 10),
    "rotary_base": sometimes([100.0, 10000.0], 8),
    "rotary_interleaved": sometimes(BOOL, 6),
    "position_infused_attn": sometimes(TRUE, 6),
    "rel_pos_bias": sometimes(TRUE, 4),
    "rel_pos_num_buckets": sometimes([4, 8, 2], 10),
    "rel_pos_max_distance": sometimes([16, 64, 3], 12),
    "alibi_pos_emb": sometimes(TRUE, 4),
    "alibi_pos_bias": sometimes(TRUE, 12),
    "alibi_num_heads": sometimes([1, 2, 3], 12),
    # norm and residual
    "pre_norm": sometimes(BOOL, 5),
    "sandwich_norm": sometimes(TRUE, 8),
    "use_scalenorm": sometimes(TRUE, 8),
    "use_rmsnorm": sometimes(TRUE, 6),
    "use_rezero": sometimes(TRUE, 8),
    "gate_residual": sometimes(TRUE, 6),
    "norm_eps": sometimes([1e-6, 1e-3], 10),
    # attention
    "attn_dim_head": sometimes([4, 8, 6, 4, 8, 6, 5], 2),
    "attn_kv_heads": sometimes([1, 2, 1, 2, 3], 4),
    "attn_one_kv_head": sometimes(TRUE, 10),
    "attn_dropout": sometimes([0.1, 0.5], 6),
    "attn_num_mem_kv": sometimes([1, 3], 4),
    "attn_sparse_topk": sometimes([1, 2, 4, 32], 6),
    "attn_use_entmax15": sometimes(TRUE, 8),
    "attn_talking_heads": sometimes(TRUE, 6),
    "attn_collab_heads": sometimes(TRUE, 8),
    "attn_collab_compression": sometimes([0.25, 0.5, 1.0], 10),
    "attn_on_attn": sometimes(TRUE, 6),
    "gate_values": sometimes(TRUE, 6),
    "attn_gate_values": sometimes(TRUE, 12),
    "attn_flash": sometimes(BOOL, 5),
    "attn_qkv_bias": sometimes(TRUE, 6),
    "attn_out_bias": sometimes(TRUE, 6),
    # sparse attention patterns (one keyword each; tests/attention/patterns holds each to its definition)
    "attn_window": sometimes([2, 3, 5], 6),
    "attn_sink_tokens": sometimes([1], 12),
    "attn_global_tokens": sometimes([1, 2], 10),
    "attn_sparse": sometimes(["strided", "fixed"], 12),
    "attn_sparse_stride": sometimes([2, 3], 12),
    "attn_block_local": sometimes([(3, 2)], 12),
    "attn_dilated": sometimes([((4, 1), (8, 2))], 14),
    # attention kernels of their own and mixers (tests/attention/kernels, tests/mixers hold each to its definition)
    "attn_linear": sometimes(["elu", "relu"], 10),
    "attn_performer": sometimes(TRUE, 10),
    "attn_performer_features": sometimes([4, 8, 0], 12),
    "attn_rfa": sometimes(TRUE, 12),
    "attn_rfa_gate": sometimes(BOOL, 12),
    "attn_fnet": sometimes(TRUE, 12),
    "attn_linformer_k": sometimes([2, 4, 0], 12),
    "attn_linformer_seq_len": sometimes([16, 32], 12),
    "attn_nystrom_landmarks": sometimes([2, 3, 0], 12),
    "gau": sometimes(TRUE, 10),
    "gau_chunk": sometimes([2, 3, 0], 10),
    "attn_distance_aware": sometimes(TRUE, 12),
    "attn_aft": sometimes(["simple", "local", "full"], 14),
    "attn_adaptive_span": sometimes([4, 0], 14),
    "reversible": sometimes(TRUE, 12),
    # feedforward
    "ff_mult": sometimes([1, 2, 0.5], 3),
    "ff_glu": sometimes(TRUE, 4),
    "ff_relu_squared": sometimes(TRUE, 6),
    "ff_swish": sometimes(TRUE, 6),
    "ff_gelu_tanh": sometimes(TRUE, 8),
    "ff_dropout": sometimes([0.1, 0.5], 6),
    "ff_no_bias": sometimes(TRUE, 6),
    # layout
    "macaron": sometimes(TRUE, 6),
    "sandwich_coef": sometimes([1, 2], 10),
    "custom_layers": sometimes(["a", "f", "af", "fa", "aaf", "ac", "acf", "cf", "c", "fcaf", "afaf"], 8),
    "shift_tokens": sometimes([1, 2, 1, 2, (1, 0), (0, 1, 2), (1, 0, 1, 0), (2, 0, 1, 0, 0, 1)], 4),
    "residual_attn": sometimes(TRUE, 6),
    "cross_residual_attn": sometimes(TRUE, 14),
    "cross_attend": sometimes(TRUE, 6),
    "only_cross": sometimes(TRUE, 16),
    "dim_context": sometimes([8, 12], 10),
    "gradient_checkpointing": sometimes(TRUE, 8),
    # x-transformers 2.x (issue 24). Not drawn: use_adaptive_layernorm / use_adaptive_rmsnorm /
    # use_adaptive_layerscale (every forward needs condition=) and attn_gumbel_softmax (it draws in eval
    # too, so two forwards differ): tests/test_xt_residual.py, tests/attention/test_hard_attention.py
    # attention scores (attention/scoring.py, gates.py, head_scale.py, topk_straight.py, hard_attention.py)
    "attn_qk_norm": sometimes(TRUE, 18),
    "attn_qk_norm_groups": sometimes([2, 3], 24),
    "attn_qk_norm_scale": sometimes([4.0, 10.0], 26),
    "attn_qk_norm_dim_scale": sometimes(TRUE, 26),
    "attn_sigmoid": sometimes(TRUE, 20),
    "attn_sigmoid_bias": sometimes([-2.0, 0.0], 26),
    "attn_softclamp_logits": sometimes(TRUE, 20),
    "attn_logit_softclamp_value": sometimes([2.0, 0.0], 26),
    "attn_head_learned_sink": sometimes(TRUE, 20),
    "attn_add_zero_kv": sometimes(TRUE, 20),
    "attn_pre_talking_heads": sometimes(TRUE, 22),
    "attn_post_talking_heads": sometimes(TRUE, 22),
    "attn_max_attend_past": sometimes([2, 4, 0], 22),
    "attn_z_loss_weight": sometimes([1e-3], 22),
    "attn_gate_value_heads": sometimes(TRUE, 22),
    "attn_output_gate": sometimes(TRUE, 22),
    "attn_output_gate_headwise": sometimes(TRUE, 26),
    "attn_output_gate_rank": sometimes([3], 26),
    "attn_gate_values_rank": sometimes([3], 26),
    "attn_swiglu_values": sometimes(TRUE, 24),
    "attn_head_scale": sometimes(TRUE, 22),
    "attn_sparse_topk_straight_through": sometimes(TRUE, 22),
    "attn_hard": sometimes(TRUE, 24),
    # multi-latent attention (attention/latent.py), the Forgetting Transformer (attention/forgetting.py)
    "attn_use_latent_q": sometimes(TRUE, 22),
    "attn_dim_latent_q": sometimes([8, 12], 26),
    "attn_use_latent_kv": sometimes(TRUE, 20),
    "attn_dim_latent_kv": sometimes([8, 3], 26),
    "attn_latent_rope_subheads": sometimes([1, 2], 24),
    "attn_data_dependent_alibi": sometimes(TRUE, 20),
    "attn_data_dependent_alibi_per_row": sometimes(TRUE, 24),
    "attn_data_dependent_alibi_per_row_dim_head": sometimes([4], 30),
    "attn_data_dependent_alibi_kwargs": sometimes([{"bias_init": 1.0}], 30),
    # positions (position/rotary.py, rotary_scaling.py, dynamic_bias.py, cope.py)
    "rotary_xpos": sometimes(TRUE, 20),
    "rotary_xpos_scale_base": sometimes([16, 512], 26),
    "rotary_base_rescale_factor": sometimes([2.0, 0.5], 22),
    "rotate_num_heads": sometimes([1, 2, 5], 22),
    "dynamic_pos_bias": sometimes(TRUE, 18),
    "dynamic_pos_bias_mlp_depth": sometimes([1, 2, 0], 26),
    "dynamic_pos_bias_log_distance": sometimes(BOOL, 26),
    "dynamic_pos_bias_norm": sometimes(TRUE, 26),
    "attn_use_cope": sometimes(TRUE, 20),
    "attn_cope_max_pos": sometimes([4, 16], 26),
    "attn_cope_soft_onehot_pos": sometimes(TRUE, 26),
    "attn_cope_talking_heads": sometimes(TRUE, 26),
    # norm, residual and feedforward (hyper.py, layerscale.py, dyt.py, residual_scale.py,
    # resi_dual.py, feedforward_norm.py)
    "num_residual_streams": sometimes([2, 4, 0], 20),
    "hyper_conn_sinkhorn_iters": sometimes([3, 0], 24),
    "use_layerscale": sometimes(TRUE, 18),
    "layerscale_init_value": sometimes([0.1, 1.0], 26),
    "use_dynamic_tanh": sometimes(TRUE, 20),
    "dynamic_tanh_init_alpha": sometimes([0.5, 2.0], 26),
    "use_simple_rmsnorm": sometimes(TRUE, 20),
    "pre_norm_has_final_norm": sometimes([False], 20),
    "scale_residual": sometimes([True, 0.5], 22),
    "scale_residual_constant": sometimes([0.9], 26),
    "resi_dual": sometimes(TRUE, 20),
    "resi_dual_scale": sometimes([0.1, 1.0], 26),
    "ff_post_act_ln": sometimes(TRUE, 18),
    "ff_solu": sometimes(TRUE, 18),
    # stack policies (stack_policies.py, stack_order.py, attention/value_residual.py)
    "weight_tie_layers": sometimes(TRUE, 18),
    "layers_execute_order": sometimes([(0, 0), (1, 0), (0, 1, 0, 1)], 22),
    "par_ratio": sometimes([2, 1], 22),
    "layer_dropout": sometimes([0.1, 1.5], 20),
    "unet_skips": sometimes(TRUE, 20),
    "reinject_input": sometimes(TRUE, 20),
    "learned_reinject_input_gate": sometimes(TRUE, 26),
    "add_value_residual": sometimes(TRUE, 18),
    "learned_value_residual_mix": sometimes(BOOL, 26),
    "cross_attn_tokens_dropout": sometimes([0.25], 20),
}

SEQ_WRAPPER_SPACE: dict[str, st.SearchStrategy] = {
    "num_memory_tokens": sometimes([1, 2], 4),
    "max_mem_len": sometimes([3, 6], 4),
    "shift_mem_down": sometimes([1, 2], 10),
    "use_abs_pos_emb": sometimes(BOOL, 4),
    "scaled_sinu_pos_emb": sometimes(TRUE, 8),
    "abs_pos_per_layer": sometimes(TRUE, 8), "randomized_pos": sometimes([20, 8], 10),    # position/
    "emb_dropout": sometimes([0.1], 8),
    "post_emb_norm": sometimes(TRUE, 6),
}
TOKEN_SPACE = {**SEQ_WRAPPER_SPACE, "emb_dim": sometimes([8, 12], 6), "tie_embedding": sometimes(TRUE, 6),
               "logits_bias": sometimes([False], 6), "embed_num_tokens": sometimes([{"token_type": 3}], 6),
               "max_cmem_len": sometimes([2, 4], 4), "cmem_ratio": sometimes([1, 2], 4),   # memory/compressive.py
               # issue 24 (wrap/); outputs that are not per position (pools, class tokens, several heads) and
               # recycling (its eval forward needs recycle_steps=) are tested in tests/test_xt_wrappers*.py
               "l2norm_embed": sometimes(TRUE, 8), "emb_frac_gradient": sometimes([0.1, 1.5], 8),
               "mixture_of_softmax": sometimes(TRUE, 10), "mixture_of_softmax_k": sometimes([2, 0], 16),
               "memory_tokens_interspersed_every": sometimes([2, 3], 6), "return_only_embed": sometimes(TRUE, 12),
               "input_not_include_cache": sometimes(TRUE, 16), "attn_z_loss_weight": sometimes([1e-3], 16)}
CONTINUOUS_SPACE = {**SEQ_WRAPPER_SPACE, "dim_in": sometimes([5], 3), "dim_out": sometimes([3], 3)}
VIT_SPACE = {"patch_size": st.sampled_from([2, 4, 2, 4, 3]), "channels": sometimes([1, 2], 2),
             "num_classes": sometimes([5], 2), "emb_dropout": sometimes([0.1], 8)}
XT_SPACE = {"tie_token_emb": sometimes(TRUE, 4), "num_memory_tokens": sometimes([1, 2], 5),
            "use_abs_pos_emb": sometimes(BOOL, 5), "scaled_sinu_pos_emb": sometimes(TRUE, 8)}
XT_DECODER_ONLY = ("cross_residual_attn", "custom_layers", "dim_context")
XT_NOT_GIVEN = ("cross_attend",)                      # XTransformer sets dec_cross_attend itself

WRAPPERS = ("token", "continuous", "vit", "xtransformer")
# an issue 24 option is drawn only with its switch: alone it is refused by name, and with ~20 of them a draw
# would almost never build (their refusals are tested beside each piece)
NEEDS = {"attn_qk_norm_groups": "attn_qk_norm", "attn_qk_norm_scale": "attn_qk_norm",
         "attn_qk_norm_dim_scale": "attn_qk_norm", "attn_sigmoid_bias": "attn_sigmoid",
         "attn_logit_softclamp_value": "attn_softclamp_logits", "attn_output_gate_headwise": "attn_output_gate",
         "attn_output_gate_rank": "attn_output_gate", "attn_gate_values_rank": "attn_gate_values",
         "attn_swiglu_values": "attn_output_gate",
         "attn_dim_latent_q": "attn_use_latent_q", "attn_dim_latent_kv": "attn_use_latent_kv",
         "attn_latent_rope_subheads": "attn_use_latent_kv", "attn_data_dependent_alibi_per_row":
         "attn_data_dependent_alibi", "attn_data_dependent_alibi_per_row_dim_head": "attn_data_dependent_alibi_per_row",
         "attn_data_dependent_alibi_kwargs": "attn_data_dependent_alibi", "rotary_xpos_scale_base": "rotary_xpos",
         "dynamic_pos_bias_mlp_depth": "dynamic_pos_bias", "dynamic_pos_bias_log_distance": "dynamic_pos_bias",
         "dynamic_pos_bias_norm": "dynamic_pos_bias", "attn_cope_max_pos": "attn_use_cope",
         "attn_cope_soft_onehot_pos": "attn_use_cope", "attn_cope_talking_heads": "attn_use_cope",
         "layerscale_init_value": "use_layerscale", "dynamic_tanh_init_alpha": "use_dynamic_tanh",
         "scale_residual_constant": "scale_residual", "resi_dual_scale": "resi_dual",
         "learned_reinject_input_gate": "reinject_input", "learned_value_residual_mix": "add_value_residual",
         "mixture_of_softmax_k": "mixture_of_softmax", "hyper_conn_sinkhorn_iters": "num_residual_streams", "memory_tokens_interspersed_every": "num_memory_tokens"}
# keywords that are the same option under two spellings
ALIASES = {"alibi_pos_bias": "alibi_pos_emb", "attn_gate_values": "gate_values", "attn_one_kv_head": "attn_kv_heads"}


def keyword_dict(space: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.fixed_dictionaries(space).map(
        lambda d: {k: v for k, v in d.items() if v is not None and d.get(NEEDS.get(k, k)) is not None})


@dataclass
class Case:
    wrapper: str
    stack: str                          # "Encoder", "Decoder", "AttentionLayers"
    dim: int
    depth: int
    heads: int
    layers: dict[str, Any]
    wrap: dict[str, Any]
    batch: int
    n: int
    context_len: int
    seed: int

    def keywords(self) -> set[str]:
        """The keywords a refusal may name."""
        return {"dim", "depth", "heads", *self.layers, *self.wrap}


@st.composite
def cases(draw, wrappers: tuple[str, ...] = WRAPPERS, causal: bool | None = None) -> Case:
    wrapper = draw(st.sampled_from(wrappers))
    if wrapper == "vit":
        stack = "Encoder"
    elif wrapper == "xtransformer":
        stack = "Decoder"                       # the decoder side; the encoder side is an Encoder
    elif causal is None:
        stack = draw(st.sampled_from(["Decoder", "Encoder", "AttentionLayers"]))
    else:
        stack = "Decoder" if causal else "Encoder"
    if causal is not None and wrapper in ("vit", "xtransformer") and causal != (wrapper == "xtransformer"):
        assume(False)
    layers = draw(keyword_dict(LAYER_SPACE))
    if stack == "AttentionLayers":
        layers["causal"] = draw(st.booleans()) if causal is None else causal
    if wrapper in ("vit", "xtransformer"):
        for k in XT_NOT_GIVEN:
            layers.pop(k, None)
    space = {"token": TOKEN_SPACE, "continuous": CONTINUOUS_SPACE, "vit": VIT_SPACE, "xtransformer": XT_SPACE}[wrapper]
    wrap = draw(keyword_dict(space))
    n = draw(st.integers(2, 10))
    return Case(wrapper=wrapper, stack=stack, dim=draw(st.sampled_from([16, 24, 32])), depth=draw(st.sampled_from([1, 2])),
                heads=draw(st.sampled_from([1, 2, 4])), layers=layers, wrap=wrap,
                batch=draw(st.sampled_from([2, 1, 3])), n=n, context_len=draw(st.sampled_from([3, 5, 1, 0])),
                seed=draw(st.integers(0, 2 ** 16)))


# ---------------------------------------------------------------------------------------------
# building


STACKS = {"Encoder": Encoder, "Decoder": Decoder, "AttentionLayers": AttentionLayers}


def construct(case: Case) -> torch.nn.Module:
    """Build the drawn model through the public classes (may raise: the draw may be invalid)."""
    torch.manual_seed(case.seed)
    if case.wrapper == "xtransformer":
        enc = {f"enc_{k}": v for k, v in case.layers.items() if k not in XT_DECODER_ONLY}
        dec = {f"dec_{k}": v for k, v in case.layers.items()}
        sides = {f"{side}_{k}": v for k, v in case.wrap.items() if k != "tie_token_emb" for side in ("enc", "dec")}
        return XTransformer(dim=case.dim, tie_token_emb=case.wrap.get("tie_token_emb", False),
                            enc_num_tokens=NUM_TOKENS, enc_max_seq_len=MAX_SEQ_LEN, enc_depth=case.depth,
                            enc_heads=case.heads, dec_num_tokens=NUM_TOKENS, dec_max_seq_len=MAX_SEQ_LEN,
                            dec_depth=case.depth, dec_heads=case.heads, **enc, **dec, **sides)
    layers = STACKS[case.stack](dim=case.dim, depth=case.depth, heads=case.heads, **case.layers)
    if case.wrapper == "token":
        return TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=MAX_SEQ_LEN, attn_layers=layers, **case.wrap)
    if case.wrapper == "continuous":
        return ContinuousTransformerWrapper(max_seq_len=MAX_SEQ_LEN, attn_layers=layers, **case.wrap)
    return ViTransformerWrapper(image_size=IMAGE, attn_layers=layers, **case.wrap)


def names_keyword(message: str, keyword: str) -> bool:
    spellings = {keyword, ALIASES.get(keyword, keyword)}
    return any(re.search(rf"(?<![A-Za-z0-9_])(?:enc_|dec_)?{re.escape(s)}(?![A-Za-z0-9_])", message)
               for s in spellings)


def build(case: Case) -> torch.nn.Module:
    """The drawn model, perturbed off its initial values (ReZero / gates start as identities);
    a refused draw must be refused with a message naming a drawn keyword, and is discarded."""
    note(repr(case))
    try:
        model = construct(case)
    except (ValueError, TypeError) as err:
        message = str(err)
        named = [k for k in sorted(case.keywords()) if names_keyword(message, k)]
        assert named, f"refusal names none of the drawn keywords {sorted(case.keywords())}: {message}"
        event(f"refused: {re.sub(r'[0-9]+', 'N', message)[:90]}")
        assume(False)
    event("built")
    return perturb(model, seed=case.seed + 1, scale=0.1)
