"""The option sets every contract runs through: one entry per keyword of the README (wrapper
keywords mixed in, as `tiny_lm` allows), plus the later spellings and combinations."""

from __future__ import annotations

import torch

LAYER_OPTIONS: dict[str, dict] = {
    "default": {},
    "rel_pos_bias": dict(rel_pos_bias=True),
    "alibi_pos_emb": dict(alibi_pos_emb=True),
    "alibi_num_heads": dict(alibi_pos_emb=True, alibi_num_heads=2),
    "rotary_pos_emb": dict(rotary_pos_emb=True),
    "axial_pos_emb": dict(axial_pos_emb=(4, 8), axial_pos_emb_dims=(12, 20)),
    "rotary_partial_interleaved": dict(rotary_pos_emb=True, rotary_emb_dim=4, rotary_interleaved=True),
    "position_infused_attn": dict(position_infused_attn=True),
    "scaled_sinu_pos_emb": dict(scaled_sinu_pos_emb=True),
    "no_abs_pos_emb": dict(use_abs_pos_emb=False),
    "shift_tokens": dict(shift_tokens=1),
    "shift_tokens_2": dict(shift_tokens=2),
    "shift_tokens_tuple": dict(shift_tokens=(1, 0, 2, 0)),
    "attn_num_mem_kv": dict(attn_num_mem_kv=4),
    "num_memory_tokens": dict(num_memory_tokens=3),
    "use_scalenorm": dict(use_scalenorm=True),
    "use_rmsnorm": dict(use_rmsnorm=True),
    "use_rezero": dict(use_rezero=True),
    "ff_glu": dict(ff_glu=True),
    "ff_relu_squared": dict(ff_relu_squared=True),
    "attn_sparse_topk": dict(attn_sparse_topk=3),
    "attn_use_entmax15": dict(attn_use_entmax15=True),
    "attn_talking_heads": dict(attn_talking_heads=True),
    "attn_collab_heads": dict(attn_collab_heads=True),
    "attn_on_attn": dict(attn_on_attn=True),
    "gate_values": dict(gate_values=True),
    "attn_kv_heads": dict(attn_kv_heads=2),
    "attn_one_kv_head": dict(attn_one_kv_head=True),
    "sandwich_coef": dict(sandwich_coef=1),
    "macaron": dict(macaron=True),
    "post_norm_residual_attn": dict(pre_norm=False, residual_attn=True),
    "gate_residual": dict(gate_residual=True),
    "sandwich_norm": dict(sandwich_norm=True),
    "gradient_checkpointing": dict(gradient_checkpointing=True),
    # DeepNet (deepnet.py): post-LN with alpha * x + f(x), beta-scaled init
    "deepnorm": dict(deepnorm=True),
    # Universal Transformer (universal.py) and ACT (act.py): depth steps of one shared unit; ACT's halting mixes 1 and 2
    "universal": dict(universal=True, ut_timestep_emb=True, shift_tokens=1, rotary_pos_emb=True),
    "act": dict(universal=True, act=True, act_threshold=0.9, act_max_steps=3, ut_timestep_emb=True, shift_tokens=1,
                attn_num_mem_kv=2),
    "emb_dim": dict(emb_dim=24),
    "tie_embedding": dict(tie_embedding=True),
    # relative positions (position/shaw.py, position/xl_relative.py): with GQA and memory key / values
    "rel_pos_shaw": dict(rel_pos_shaw=3, attn_kv_heads=2, attn_num_mem_kv=2),
    "rel_pos_shaw_keys_only": dict(rel_pos_shaw=2, rel_pos_shaw_values=False),
    "rel_pos_xl": dict(rel_pos_xl=True, attn_kv_heads=2, attn_num_mem_kv=2),
    "rel_pos_xl_shared_uv": dict(rel_pos_xl=True, rel_pos_xl_shared_uv=True, attn_one_kv_head=True),
    "combined": dict(rotary_pos_emb=True, attn_num_mem_kv=2, num_memory_tokens=2, shift_tokens=1,
                     attn_kv_heads=2, ff_glu=True, use_rmsnorm=True),
    # rotary scaling (position/rotary_scaling.py), 32 rotated pairs: YaRN is static (its context of 8 is left by
    # every test); dynamic NTK and LongRoPE follow the length, and a cached key keeps its step's rotation, so their
    # context of 128 is never left here (past it cached != uncached: tests/position/test_rotary_scaling.py)
    "rotary_yarn": dict(rotary_pos_emb=True, rotary_yarn=dict(factor=4.0, original_max_len=8, beta_fast=16.0)),
    "rotary_dynamic_ntk": dict(rotary_pos_emb=True, rotary_dynamic_ntk=(2.0, 128), attn_kv_heads=2),
    "rotary_longrope": dict(rotary_pos_emb=True, rotary_longrope=dict(
        short_factor=[1.0 + 0.05 * i for i in range(32)], long_factor=[1.0 + i for i in range(32)],
        original_max_len=128, factor=4.0)),
    # mixture-of-experts feedforward (moe/): top-2 without a limit; top-1 with a capacity that drops tokens
    "ff_moe": dict(ff_moe=True, ff_num_experts=4, ff_moe_top_k=2, ff_glu=True, ff_moe_shared_experts=1),
    "ff_moe_capacity": dict(ff_moe=True, ff_num_experts=4, ff_moe_top_k=1, ff_moe_capacity_factor=0.75,
                            ff_moe_every=2, macaron=True, ff_moe_z_loss=1e-3, num_memory_tokens=2),
    # x-transformers' wrapper options (polyformer/wrap/): fixnorm embeddings, a gradient fraction, a mixture of softmaxes
    "l2norm_embed": dict(l2norm_embed=True, use_abs_pos_emb=True),
    "emb_frac_gradient": dict(emb_frac_gradient=0.1),
    "mixture_of_softmax": dict(mixture_of_softmax=True, mixture_of_softmax_k=2),
}
# one entry per registered attention pattern (registry.PATTERN; tests/contracts keeps the two in
# step), small enough that a 12-token input has keys outside every pattern
PATTERN_OPTIONS: dict[str, dict] = {
    "attn_window": dict(attn_window=4, rotary_pos_emb=True),
    "attn_window_dilation_global": dict(attn_window=4, attn_window_dilation=2, attn_global_tokens=1),
    "attn_sink_tokens": dict(attn_window=4, attn_sink_tokens=2, alibi_pos_emb=True),
    "attn_random_blocks": dict(attn_window=4, attn_random_blocks=1, attn_block_size=2, rotary_pos_emb=True),
    "attn_sparse": dict(attn_sparse="strided", attn_sparse_stride=3),
    "attn_blockwise": dict(attn_blockwise=2),
    "attn_block_local": dict(attn_block_local=(4, 2)),
    "attn_local_2d": dict(attn_local_2d=dict(image=(4, 8), query=(2, 2), memory=(1, 1))),
    "attn_dilated": dict(attn_dilated=((4, 1), (8, 2))),
    # BigBird's blocks as Hugging Face lays them out (patterns/bigbird_blocks.py): 12 tokens > (5 + 2) x 1
    "attn_bigbird_blocks": dict(attn_bigbird_blocks=dict(block_size=1, random_blocks=1), rotary_pos_emb=True),
    # relative schemes on a window: the pattern's dense path takes their terms
    "attn_window_rel_pos_xl": dict(attn_window=4, rel_pos_xl=True, attn_kv_heads=2),
    "attn_window_rel_pos_shaw": dict(attn_window=4, rel_pos_shaw=2),
}
# one entry per registered attention kernel other than dense, and per mixer (registry.KERNEL /
# registry.MIXER; tests/contracts keeps them in step), each with a keyword it combines with; and the
# stack policies kept out of LAYER_OPTIONS (reversible, hourglass, attn_per_layer: the compile, export
# and fast-step tests run LAYER_OPTIONS only)
KERNEL_OPTIONS: dict[str, dict] = {
    "attn_linear": dict(attn_linear="elu", attn_linear_chunk=4, rotary_pos_emb=True, attn_num_mem_kv=2),
    "attn_linear_relu": dict(attn_linear="relu", attn_linear_chunk=3, attn_kv_heads=2),
    "attn_performer": dict(attn_performer=True, attn_performer_features=16, attn_performer_chunk=4,
                           rotary_pos_emb=True),
    "attn_performer_relu": dict(attn_performer=True, attn_performer_kernel="relu", attn_one_kv_head=True),
    "attn_rfa": dict(attn_rfa=True, attn_rfa_features=8, attn_rfa_chunk=4),
    "attn_rfa_gate": dict(attn_rfa=True, attn_rfa_gate=True, attn_rfa_chunk=5, attn_kv_heads=2),
    "attn_fnet": dict(attn_fnet=True),
    "attn_linformer": dict(attn_linformer_k=4, attn_linformer_seq_len=32, attn_kv_heads=2, attn_num_mem_kv=2),
    "attn_nystrom": dict(attn_nystrom_landmarks=4, attn_nystrom_conv=3, rotary_pos_emb=True),
    # Attention Free Transformer (attention/kernels/aft.py)
    "attn_aft_full": dict(attn_aft="full", attn_aft_max_len=32, attn_num_mem_kv=2),
    "attn_aft_simple": dict(attn_aft="simple", rotary_pos_emb=True),
    "attn_aft_local": dict(attn_aft="local", attn_aft_window=3, attn_aft_max_len=32, attn_kv_heads=2),
    "attn_aft_conv": dict(attn_aft="conv", attn_aft_window=3, attn_kv_heads=2, attn_num_mem_kv=2),
    # FLASH's gated attention unit (mixers/gau.py)
    "gau": dict(gau=True, gau_qk_dim=8),
    "gau_chunk": dict(gau=True, gau_chunk=4, gau_qk_dim=8, rotary_pos_emb=True),
    # Sparse Sinkhorn attention (attention/kernels/sinkhorn.py): 12-14 tokens make 3-4 blocks
    "attn_sinkhorn": dict(attn_sinkhorn=True, attn_sinkhorn_bucket_size=4, attn_kv_heads=2, attn_num_mem_kv=2,
                          rotary_pos_emb=True),
    "attn_sinkhorn_sortcut": dict(attn_sinkhorn=True, attn_sinkhorn_bucket_size=4, attn_sinkhorn_sortcut=2),
    # LSH attention (attention/kernels/lsh.py): buckets chunked by position; the paper's global sort
    "attn_lsh": dict(attn_lsh=True, attn_shared_qk=True, attn_lsh_bucket_size=4, attn_lsh_n_hashes=2,
                     attn_lsh_n_buckets=4, rotary_pos_emb=True),
    "attn_lsh_separate_qk": dict(attn_lsh=True, attn_lsh_bucket_size=3, attn_lsh_n_hashes=2, attn_lsh_n_buckets=2,
                                 attn_kv_heads=2),
    "attn_lsh_global": dict(attn_lsh=True, attn_shared_qk=True, attn_lsh_global_sort=True, attn_lsh_bucket_size=4,
                            attn_lsh_n_hashes=2),
    # Routing attention (attention/kernels/routing.py): 2 clusters, chunks of 4; half the heads local
    "attn_routing": dict(attn_routing=True, attn_routing_clusters=2, attn_routing_window=4, attn_num_mem_kv=2,
                         rotary_pos_emb=True),
    "attn_routing_mixed": dict(attn_routing=True, attn_routing_clusters=2, attn_routing_window=4,
                               attn_routing_heads=2, attn_window=4, attn_kv_heads=2),
    # reversible layers and chunked feedforward (reversible.py, feedforward.py): on dense attention, as the
    # Reformer (LSH), and with an auxiliary loss (routing's commitment)
    "reversible": dict(reversible=True, ff_chunks=5, shift_tokens=1, rotary_pos_emb=True, attn_num_mem_kv=2),
    "reversible_lsh": dict(reversible=True, ff_chunks=3, attn_lsh=True, attn_shared_qk=True, attn_lsh_bucket_size=4,
                           attn_lsh_n_hashes=2, attn_lsh_n_buckets=4),
    "reversible_routing": dict(reversible=True, attn_routing=True, attn_routing_clusters=2, attn_routing_window=4),
    # Hugging Face's Reformer as converted (interop/reformer.py): streams concatenated, local chunks, ReLU
    "reversible_concat": dict(reversible=True, reversible_merge="concat", attn_block_local=(4, 4), ff_relu=True),
    # adaptive attention span (attention/kernels/adaptive_span.py): spans of 4 + a ramp of 2 < 12 tokens
    "attn_adaptive_span": dict(attn_adaptive_span=8, attn_adaptive_span_ramp=2, attn_adaptive_span_init=0.5,
                               rotary_pos_emb=True, attn_num_mem_kv=2, attn_kv_heads=2),
    # DA-Transformer (attention/kernels/distance_aware.py): heads off their neutral alpha = 0
    "attn_distance_aware": dict(attn_distance_aware=True, attn_distance_aware_alpha=-0.5, attn_distance_aware_beta=0.5,
                                attn_kv_heads=2, attn_num_mem_kv=2),
    # Hourglass (hourglass.py): one layer before the shortening by 3, one on it; nested 2 x 2, mean pool, repeat
    "hourglass": dict(hourglass=3, hourglass_depths=(1, 1, 0), rotary_pos_emb=True, shift_tokens=1,
                      num_memory_tokens=2),
    "hourglass_nested": dict(hourglass=(2, 2), hourglass_depths=(1, 0, 1, 0, 0), hourglass_pool="average",
                             hourglass_upsample="repeat", alibi_pos_emb=True, attn_kv_heads=2),
    # per-layer attention options (per_layer.py): a window block and a Performer block (keys + a recurrent
    # summary in one decode state); the Reformer's mix of local and LSH blocks (LSH per bucket: it decodes)
    "per_layer_mixed": dict(rotary_pos_emb=True, attn_per_layer=[
        dict(attn_window=4), dict(attn_performer=True, attn_performer_features=16, attn_performer_chunk=4)]),
    "per_layer_local_lsh": dict(attn_per_layer=[
        dict(attn_block_local=(4, 4)), dict(attn_lsh=True, attn_shared_qk=True, attn_lsh_bucket_size=4,
                                            attn_lsh_n_hashes=2, attn_lsh_n_buckets=4)]),
    # per-layer absolute positions (position/per_layer_abs.py): tables read at the stack's positions, memory
    # tokens first; and on a macaron layout ('faf' per layer: a table before each 'a' only)
    "abs_pos_per_layer": dict(abs_pos_per_layer=True, num_memory_tokens=2, attn_kv_heads=2),
    "abs_pos_per_layer_rotary": dict(abs_pos_per_layer=True, rotary_pos_emb=True, macaron=True, attn_num_mem_kv=2),
    # randomized positions (position/randomized.py): learned tables of L rows, rotary; identity in eval
    "randomized_pos": dict(randomized_pos=48, num_memory_tokens=2),
    "randomized_pos_rotary": dict(randomized_pos=48, rotary_pos_emb=True, attn_kv_heads=2),
    # Infini-attention (attention/kernels/infini.py): segments of 4 (12-14 tokens: 3-4 segments), linear and delta
    # rules, with GQA, memory key / values and rotary
    "attn_infini": dict(attn_infini=True, attn_infini_segment=4, attn_kv_heads=2, attn_num_mem_kv=2),
    "attn_infini_delta": dict(attn_infini=True, attn_infini_segment=5, attn_infini_delta=True, rotary_pos_emb=True),
    # Landmark attention (attention/kernels/landmark.py): blocks of 3 and a landmark each, the wrapper inserting
    # them (landmark.py); eval retrieves the top 2 earlier blocks, so 12-14 tokens leave blocks unread
    "landmark_block": dict(landmark_block=3, landmark_topk=2, rotary_pos_emb=True, attn_kv_heads=2),
    # Memorizing Transformer (attention/knn_memory.py): the contracts call a model many times on unrelated inputs, so
    # its memory only reads here (knn_memory_write=False: empty, the gate's local share); writing, retrieval,
    # causality and cache parity with a filled memory: tests/memory/test_memorizing.py
    "knn_memory": dict(knn_memory_layers=(1,), knn_memory_size=16, knn_topk=4, knn_memory_write=False,
                       rotary_pos_emb=True, attn_kv_heads=2),
    # early exit (early_exit.py): a plain forward is the full model; training averages the exits' losses
    "exit_layers": dict(exit_layers=True, exit_confidence="state_change", rotary_pos_emb=True, shift_tokens=1),
    # multi-latent attention (attention/latent.py): kv latent with GQA and memory key / values; both latents with
    # the decoupled rotary heads (the last 2 of 4 keys straight from the input)
    "attn_latent_kv": dict(attn_use_latent_kv=True, attn_dim_latent_kv=12, attn_kv_heads=2, attn_num_mem_kv=2,
                           rotary_pos_emb=True),
    "attn_latent_rope": dict(attn_use_latent_q=True, attn_dim_latent_q=16, attn_use_latent_kv=True,
                             attn_dim_latent_kv=12, attn_latent_rope_subheads=2, rotary_pos_emb=True, shift_tokens=1),
    # attention scores, x-transformers 2.x spellings (attention/scoring.py, gates.py): cosine-sim with groups, rotary,
    # GQA and memory kv; sigmoid with a bias and ALiBi; soft-capping with both sinks; one-sided talking heads with
    # the z-loss; the causal window attn_max_attend_past is; per-head and output gates
    "attn_qk_norm": dict(attn_qk_norm=True, attn_qk_norm_groups=2, rotary_pos_emb=True, attn_kv_heads=2,
                         attn_num_mem_kv=2),
    "attn_qk_norm_dim_scale": dict(attn_qk_norm=True, attn_qk_norm_dim_scale=True, shift_tokens=1),
    "attn_sigmoid": dict(attn_sigmoid=True, attn_sigmoid_bias=-2.0, alibi_pos_emb=True, attn_num_mem_kv=2),
    "attn_softclamp_sinks": dict(attn_softclamp_logits=True, attn_logit_softclamp_value=2.0,
                                 attn_head_learned_sink=True, attn_add_zero_kv=True, attn_kv_heads=2),
    "attn_pre_talking_heads": dict(attn_pre_talking_heads=True, attn_z_loss_weight=1e-3, rel_pos_bias=True),
    "attn_post_talking_heads": dict(attn_post_talking_heads=True, attn_head_learned_sink=True, attn_num_mem_kv=2),
    "attn_max_attend_past": dict(attn_max_attend_past=3, rotary_pos_emb=True),
    "attn_head_gates": dict(attn_gate_value_heads=True, attn_output_gate=True, attn_output_gate_headwise=True),
    "attn_output_gate": dict(attn_output_gate=True, attn_num_mem_kv=2),
    "attn_hybrid_gate": dict(attn_gate_values=True, attn_gate_values_rank=3, attn_output_gate=True,
                             attn_output_gate_headwise=True, attn_swiglu_values=True),
    # x-transformers' stack policies (stack_policies.py, stack_order.py, attention/value_residual.py): repeated runs
    # of blocks with token shift (one decode slot per run), a PAR layout, U-Net skips, the reinjected input with its
    # gate, learned and fixed value residuals (keys and a recurrent summary); layer_dropout (training only, it leaves
    # blocks without gradients) is tested in tests/test_xt_stack.py
    "weight_tie_layers": dict(weight_tie_layers=True, rotary_pos_emb=True, shift_tokens=1),
    "layers_execute_order": dict(layers_execute_order=(0, 1, 0, 1, 2, 3, 2, 3), shift_tokens=1, attn_num_mem_kv=2,
                                 rotary_pos_emb=True),
    "par_ratio": dict(par_ratio=2, rotary_pos_emb=True, attn_kv_heads=2),
    "unet_skips": dict(unet_skips=True, shift_tokens=1, attn_kv_heads=2),
    "reinject_input": dict(reinject_input=True, learned_reinject_input_gate=True, shift_tokens=1, num_memory_tokens=2),
    "add_value_residual": dict(add_value_residual=True, rotary_pos_emb=True, attn_kv_heads=2, attn_num_mem_kv=2),
    "add_value_residual_fixed": dict(add_value_residual=True, learned_value_residual_mix=False, attn_linear="elu",
                                     attn_linear_chunk=4),
    # x-transformers' residual / norm / feedforward keywords (hyper.py, layerscale.py, dyt.py, feedforward_norm.py);
    # the adaptive norms need the forward's condition: their decode / causality tests are in tests/test_xt_residual.py
    "num_residual_streams": dict(num_residual_streams=3, rotary_pos_emb=True, shift_tokens=1, attn_num_mem_kv=2,
                                 num_memory_tokens=2),
    "hyper_conn_sinkhorn_iters": dict(num_residual_streams=3, hyper_conn_sinkhorn_iters=5, rotary_pos_emb=True),
    "use_layerscale": dict(use_layerscale=True, layerscale_init_value=0.1, sandwich_norm=True, attn_kv_heads=2),
    "use_dynamic_tanh": dict(use_dynamic_tanh=True, dynamic_tanh_init_alpha=0.5, pre_norm_has_final_norm=False),
    "ff_post_act_ln": dict(ff_post_act_ln=True, ff_glu=True, ff_chunks=2, rotary_pos_emb=True),
    "ff_solu": dict(ff_solu=True, macaron=True, use_rmsnorm=True),
    # x-transformers' position keywords (position/rotary.py, rotary_scaling.py, dynamic_bias.py, cope.py): xPos and
    # CoPE are causal only (with GQA, memory key / values, a window); rotate_num_heads with GQA
    "rotary_xpos": dict(rotary_xpos=True, rotary_xpos_scale_base=16, rotary_base_rescale_factor=2.0, attn_num_mem_kv=2),
    "rotate_num_heads": dict(rotary_pos_emb=True, rotate_num_heads=2, attn_kv_heads=2, rotary_emb_dim=4),
    "dynamic_pos_bias": dict(dynamic_pos_bias=True, dynamic_pos_bias_log_distance=True, dynamic_pos_bias_norm=True,
                             attn_num_mem_kv=2),
    "attn_use_cope": dict(attn_use_cope=True, attn_cope_max_pos=4, attn_kv_heads=2, attn_num_mem_kv=2),
    "attn_cope_soft_onehot": dict(attn_use_cope=True, attn_cope_soft_onehot_pos=True, attn_cope_talking_heads=True,
                                  attn_window=4),
    # x-transformers' norm / residual extras (residual_scale.py, resi_dual.py,
    # attention/head_scale.py, attention/topk_straight.py)
    "use_simple_rmsnorm": dict(use_simple_rmsnorm=True, shift_tokens=1, num_memory_tokens=2),
    "scale_residual": dict(scale_residual=0.5, scale_residual_constant=0.9, attn_kv_heads=2, rotary_pos_emb=True),
    "resi_dual": dict(resi_dual=True, resi_dual_scale=0.1, rotary_pos_emb=True, attn_num_mem_kv=2, shift_tokens=1),
    "attn_head_scale": dict(attn_head_scale=True, attn_gate_value_heads=True, attn_kv_heads=2),
    "attn_sparse_topk_straight_through": dict(attn_sparse_topk=3, attn_sparse_topk_straight_through=True,
                                              attn_num_mem_kv=2),
    # hard attention (attention/hard_attention.py): one key per query, with GQA, memory key / values and rotary;
    # Gumbel-softmax draws in eval too (as x-transformers): its cached == uncached test is in test_hard_attention.py
    "attn_hard": dict(attn_hard=True, attn_kv_heads=2, attn_num_mem_kv=2, rotary_pos_emb=True),
    # Forgetting Transformer (attention/forgetting.py): gates that forget (bias_init 1: log f near -0.3) with GQA,
    # memory key / values, rotary and sigmoid attention (where c_i does not cancel); per row with soft-capping
    "attn_data_dependent_alibi": dict(attn_data_dependent_alibi=True, attn_kv_heads=2, attn_num_mem_kv=2,
                                      attn_data_dependent_alibi_kwargs=dict(bias_init=1.0, post_log_scale=2.0),
                                      rotary_pos_emb=True, attn_sigmoid=True),
    "attn_data_dependent_alibi_per_row": dict(attn_data_dependent_alibi=True, attn_data_dependent_alibi_per_row=True,
                                              attn_data_dependent_alibi_per_row_dim_head=4, attn_one_kv_head=True,
                                              attn_softclamp_logits=True, attn_logit_softclamp_value=2.0,
                                              num_memory_tokens=2, shift_tokens=1),
    # memory tokens every m tokens (wrap/interspersed.py): decoder only; rows place them by their own positions
    "memory_tokens_interspersed_every": dict(num_memory_tokens=2, memory_tokens_interspersed_every=4,
                                             rotary_pos_emb=True, attn_kv_heads=2),
    "memory_tokens_interspersed_abs": dict(num_memory_tokens=1, memory_tokens_interspersed_every=3,
                                           attn_num_mem_kv=2, ff_glu=True),
}
DECODER_ONLY, ENCODER_ONLY = {"attn_sink_tokens"}, {"attn_blockwise", "attn_bigbird_blocks"}
# kernels and mixers that cannot be causal (refused in a Decoder) or need one
KERNEL_ENCODER_ONLY: set[str] = {"attn_fnet", "attn_linformer", "attn_nystrom", "attn_sinkhorn_sortcut",
                                 "attn_lsh_global"}
KERNEL_DECODER_ONLY: set[str] = {"rotary_xpos", "attn_use_cope", "attn_cope_soft_onehot", "attn_rfa_gate", "attn_adaptive_span", "landmark_block", "attn_infini",
                                  "attn_infini_delta", "exit_layers", "attn_max_attend_past",
                                  "attn_data_dependent_alibi_per_row", "memory_tokens_interspersed_every",
                                  "memory_tokens_interspersed_abs"}
DECODER_OPTIONS = LAYER_OPTIONS
ENCODER_OPTIONS = LAYER_OPTIONS
DECODER_PATTERNS = {k: v for k, v in PATTERN_OPTIONS.items() if k not in ENCODER_ONLY}
ENCODER_PATTERNS = {k: v for k, v in PATTERN_OPTIONS.items() if k not in DECODER_ONLY}
DECODER_KERNELS = {k: v for k, v in KERNEL_OPTIONS.items() if k not in KERNEL_ENCODER_ONLY}
ENCODER_KERNELS = {k: v for k, v in KERNEL_OPTIONS.items() if k not in KERNEL_DECODER_ONLY}


def perturb(model: torch.nn.Module, seed: int = 1, scale: float = 0.1) -> torch.nn.Module:
    """Move every parameter off its initial value, so that zero / identity inits (ReZero's g,
    value-gate weights, talking-heads identity) cannot hide a broken dependency."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model
