"""The keyword rows of the family's variants (sparse patterns, kernels, mixers, depth policies): one
row per public keyword, merged into `keywords.KEYWORDS`; the x-transformers keywords stay there."""

from __future__ import annotations

from .act import ActOptions
from .early_exit import keyword as _early_exit
from .attention.knn_memory import layers_keyword as knn_layers
from .attention.latent import RopeSubheads
from .attention.score_options import AttendPast, ScoreRoute, same
from .attention.value_residual import ValueResidualOptions
from .attention.forgetting import ForgetKwargs, ForgettingOptions
from .attention.hard_attention import GumbelOptions
from .stack_policies import ReinjectOptions
from .residual_scale import ScaleRoute
from .resi_dual import ResiDualOptions
from .hourglass import keyword as _hourglass
from .moe.options import MoeOptions
from .conditioning import ConditionOptions
from .layerscale import LayerScaleOptions
from .per_layer import parse as _per_layer
from .position.dynamic_bias import DynamicBiasOptions
from .position.rotary_scaling import dynamic_ntk_keyword, longrope_keyword, ntk_keyword, yarn_keyword
from .routes import Route, _bigbird_blocks, _block_local, _ints, _local_2d, _pairs, flag, sequence

FAMILY_KEYWORDS: dict[str, Route] = {
    # DeepNet (deepnet.py): post-LN with alpha * x + f(x) and the beta-scaled init, alpha / beta from the depths
    "deepnorm": flag(residual="deepnorm", placement="post"),
    "deepnorm_depths": Route("deepnorm_depths", sequence("(N encoder layers, M decoder layers)")),
    # sparse attention patterns (attention/patterns/): each writes its piece's options
    "attn_window": Route("attention.pattern.window.size"),
    "attn_window_dilation": Route("attention.pattern.window.dilation", _ints),
    "attn_global_tokens": Route("attention.pattern.global.tokens"),
    "attn_global_projections": Route("attention.pattern.global.projections"),
    "attn_sink_tokens": Route("attention.pattern.sinks.tokens"),
    "attn_random_blocks": Route("attention.pattern.random.blocks"),
    "attn_block_size": Route("attention.pattern.random.block_size"),
    "attn_random_seed": Route("attention.pattern.random.seed"),
    "attn_sparse": Route("attention.pattern.sparse_transformer.kind"),
    "attn_sparse_stride": Route("attention.pattern.sparse_transformer.stride"),
    "attn_sparse_summary": Route("attention.pattern.sparse_transformer.summary"),
    "attn_sparse_mode": Route("attention.pattern.sparse_transformer.mode"),
    "attn_blockwise": Route("attention.pattern.blockwise.blocks"),
    "attn_block_local": Route("attention.pattern.block_local", _block_local),
    "attn_local_2d": Route("attention.pattern.local_2d", _local_2d),
    "attn_dilated": Route("attention.pattern.dilated.segments", _pairs),
    # BigBird's block layout as Hugging Face computes it (attention/patterns/bigbird_blocks.py)
    "attn_bigbird_blocks": Route("attention.pattern.bigbird_blocks", _bigbird_blocks),
    # kernel attention (attention/kernels/linear.py): a recurrent decode state
    "attn_linear": Route("attention.kernel.linear.feature"),
    "attn_linear_chunk": Route("attention.kernel.linear.chunk"),
    "attn_performer": flag(attention__kernel__performer={}),
    "attn_performer_features": Route("attention.kernel.performer.features"),
    "attn_performer_kernel": Route("attention.kernel.performer.kernel"),
    "attn_performer_redraw": Route("attention.kernel.performer.redraw"),
    "attn_performer_orthogonal": Route("attention.kernel.performer.orthogonal"),
    "attn_performer_seed": Route("attention.kernel.performer.seed"),
    "attn_performer_chunk": Route("attention.kernel.performer.chunk"),
    "attn_rfa": flag(attention__kernel__rfa={}),
    "attn_rfa_features": Route("attention.kernel.rfa.features"),
    "attn_rfa_gate": Route("attention.kernel.rfa.gate"),
    "attn_rfa_seed": Route("attention.kernel.rfa.seed"),
    "attn_rfa_chunk": Route("attention.kernel.rfa.chunk"),
    # low-rank attention (attention/kernels/linformer.py, nystrom.py): bidirectional only
    "attn_linformer_k": Route("attention.kernel.linformer.k"),
    "attn_linformer_seq_len": Route("attention.kernel.linformer.seq_len"),
    "attn_linformer_share_kv": Route("attention.kernel.linformer.share_kv"),
    "attn_nystrom_landmarks": Route("attention.kernel.nystrom.landmarks"),
    "attn_nystrom_pinv_iters": Route("attention.kernel.nystrom.pinv_iters"),
    "attn_nystrom_pinv_init": Route("attention.kernel.nystrom.pinv_init"),
    "attn_nystrom_conv": Route("attention.kernel.nystrom.conv"),
    # Attention Free Transformer (attention/kernels/aft.py): keeps keys in a decode state
    "attn_aft": Route("attention.kernel.aft.mode"),
    "attn_aft_window": Route("attention.kernel.aft.window"),
    "attn_aft_max_len": Route("attention.kernel.aft.max_len"),
    # Sparse Sinkhorn attention (attention/kernels/sinkhorn.py): sorted key blocks, keeps keys
    "attn_sinkhorn": flag(attention__kernel__sinkhorn={}),
    "attn_sinkhorn_bucket_size": Route("attention.kernel.sinkhorn.bucket_size"),
    "attn_sinkhorn_iters": Route("attention.kernel.sinkhorn.iters"),
    "attn_sinkhorn_temperature": Route("attention.kernel.sinkhorn.temperature"),
    "attn_sinkhorn_sortcut": Route("attention.kernel.sinkhorn.sortcut"),
    # LSH attention, the Reformer's (attention/kernels/lsh.py): hashed buckets, keeps keys
    "attn_lsh": flag(attention__kernel__lsh={}),
    "attn_lsh_bucket_size": Route("attention.kernel.lsh.bucket_size"),
    "attn_lsh_n_hashes": Route("attention.kernel.lsh.n_hashes"),
    "attn_lsh_seed": Route("attention.kernel.lsh.seed"),
    "attn_lsh_n_buckets": Route("attention.kernel.lsh.n_buckets"),
    "attn_lsh_global_sort": Route("attention.kernel.lsh.global_sort"),
    "attn_shared_qk": Route("attention.kernel.lsh.shared_qk"),
    # Routing attention (attention/kernels/routing.py): k-means clusters, keeps keys; local heads take attn_window
    "attn_routing": flag(attention__kernel__routing={}),
    "attn_routing_clusters": Route("attention.kernel.routing.clusters"),
    "attn_routing_window": Route("attention.kernel.routing.window"),
    "attn_routing_heads": Route("attention.kernel.routing.heads"),
    "attn_routing_decay": Route("attention.kernel.routing.decay"),
    "attn_routing_commitment": Route("attention.kernel.routing.commitment"),
    # FNet (mixers/fnet.py): Fourier mixing instead of self-attention
    "attn_fnet": flag(mixer__fnet={}),
    # FLASH's gated attention unit (mixers/gau.py): attention and feedforward in one block
    "gau": flag(mixer__gau={}),
    "gau_chunk": Route("mixer.gau.chunk"),
    "gau_qk_dim": Route("mixer.gau.qk_dim"),
    "gau_expansion": Route("mixer.gau.expansion"),
    # the Reformer's memory-lean stack (reversible.py; feedforward.py)
    "reversible": Route("reversible"),
    "ff_chunks": Route("ff.chunks"),
    # Hugging Face's Reformer (interop/reformer.py): its concatenated streams, its default ReLU
    "reversible_merge": Route("reversible_merge"),
    "ff_relu": flag(ff__activation="relu"),
    # Universal Transformer (universal.py) and ACT halting over its steps (act.py)
    "universal": Route("universal"),
    "ut_timestep_emb": Route("ut_timestep_emb"),
    "act": flag(act=ActOptions()),
    "act_threshold": Route("act.threshold"),
    "act_max_steps": Route("act.max_steps"),
    "act_ponder_weight": Route("act.ponder_weight"),
    # early exit, depth-adaptive transformer / CALM (early_exit.py): exit layers, confidence measure, threshold
    "exit_layers": Route("early_exit", _early_exit),
    "exit_confidence": Route("early_exit.confidence"),
    "exit_threshold": Route("early_exit.threshold"),
    # Hourglass (hourglass.py): pre layers, layers on the pooled sequence (nested per factor), upsampling, post layers
    "hourglass": Route("hourglass", _hourglass),
    "hourglass_depths": Route("hourglass.depths", sequence(
        "layer counts per segment (pre layers per level, middle, post layers)")),
    "hourglass_pool": Route("hourglass.pool"),
    "hourglass_upsample": Route("hourglass.upsample"),
    # adaptive attention span (attention/kernels/adaptive_span.py): learned soft span per head, causal
    "attn_adaptive_span": Route("attention.kernel.adaptive_span.span"),
    "attn_adaptive_span_ramp": Route("attention.kernel.adaptive_span.ramp"),
    "attn_adaptive_span_loss": Route("attention.kernel.adaptive_span.loss"),
    "attn_adaptive_span_init": Route("attention.kernel.adaptive_span.init"),
    # relative positions (position/shaw.py, position/xl_relative.py): q-dependent score terms, one scheme
    "rel_pos_shaw": Route("attention.relative.shaw.max_distance"),
    "rel_pos_shaw_values": Route("attention.relative.shaw.values"),
    "rel_pos_xl": flag(attention__relative__xl={}),
    "rel_pos_xl_shared_uv": Route("attention.relative.xl.shared_uv"),
    # DA-Transformer (attention/kernels/distance_aware.py): ReLU scores scaled by a learned function of distance
    "attn_distance_aware": flag(attention__kernel__distance_aware={}),
    "attn_distance_aware_alpha": Route("attention.kernel.distance_aware.alpha"),
    "attn_distance_aware_beta": Route("attention.kernel.distance_aware.beta"),
    # rotary scaling past the trained context (position/rotary_scaling.py): YaRN, dynamic NTK, LongRoPE
    "rotary_yarn": Route("attention.rotary_scaling", yarn_keyword),
    "rotary_dynamic_ntk": Route("attention.rotary_scaling", dynamic_ntk_keyword),
    "rotary_longrope": Route("attention.rotary_scaling", longrope_keyword),
    # per-layer attention options (per_layer.py): one dict of attention keywords per self-attention block
    "attn_per_layer": Route("attention_layers", _per_layer),
    # Infini-attention (attention/kernels/infini.py): segment-local attention + a compressive memory, causal
    "attn_infini": flag(attention__kernel__infini={}),
    "attn_infini_segment": Route("attention.kernel.infini.segment"),
    "attn_infini_delta": Route("attention.kernel.infini.delta"),
    # Landmark attention (attention/kernels/landmark.py; the wrapper inserts the landmarks, landmark.py)
    "landmark_block": Route("attention.kernel.landmark.block"),
    "landmark_topk": Route("attention.kernel.landmark.topk"),
    # mixture-of-experts feedforward (moe/): routed experts at every ff_moe_every-th feedforward block
    "ff_moe": flag(ff__moe=MoeOptions()),
    "ff_num_experts": Route("ff.moe.num_experts"),
    "ff_moe_top_k": Route("ff.moe.top_k"),
    "ff_moe_capacity_factor": Route("ff.moe.capacity_factor"),
    "ff_moe_capacity": Route("ff.moe.capacity"),
    "ff_moe_balance_loss": Route("ff.moe.balance_loss"),
    "ff_moe_z_loss": Route("ff.moe.z_loss"),
    "ff_moe_jitter": Route("ff.moe.jitter"),
    "ff_moe_shared_experts": Route("ff.moe.shared_experts"),
    "ff_moe_every": Route("ff.moe.every"),
    "ff_moe_renormalize": Route("ff.moe.renormalize"),
    # Switch Transformers interop (interop/switch.py): transformers' sparse-layer placement and padding routing
    "ff_moe_offset": Route("ff.moe.offset"),
    "ff_moe_route_padding": Route("ff.moe.route_padding"),
    # Memorizing Transformer (attention/knn_memory.py): top-k retrieval from a per-row memory of past keys / values
    "knn_memory_layers": Route("knn_memory", knn_layers),
    "knn_memory_size": Route("knn_memory.size"),
    "knn_topk": Route("knn_memory.topk"),
    "knn_index": Route("knn_memory.index"),
    "knn_index_backend": Route("knn_memory.backend"),
    "knn_memory_write": Route("knn_memory.write"),
    # multi-latent attention (attention/latent.py; x-transformers' spellings): q / kv through latents, decoupled rotary
    "attn_use_latent_q": Route("attention.latent.use_q"),
    "attn_dim_latent_q": Route("attention.latent.dim_q"),
    "attn_use_latent_kv": Route("attention.latent.use_kv"),
    "attn_dim_latent_kv": Route("attention.latent.dim_kv"),
    "attn_latent_rope_subheads": RopeSubheads("attention.latent.rope_subheads"),
    # attention scores, x-transformers 2.x spellings (attention/scoring.py, attention/gates.py)
    "attn_qk_norm": ScoreRoute("attention.scores.qk_norm"),
    "attn_qk_norm_groups": ScoreRoute("attention.scores.qk_norm_groups", same),
    "attn_qk_norm_scale": ScoreRoute("attention.scores.qk_norm_scale", same),
    "attn_qk_norm_dim_scale": ScoreRoute("attention.scores.qk_norm_dim_scale"),
    "attn_sigmoid": ScoreRoute("attention.scores.sigmoid"),
    "attn_sigmoid_bias": ScoreRoute("attention.scores.sigmoid_bias", same),
    "attn_softclamp_logits": ScoreRoute("attention.scores.softclamp"),
    "attn_logit_softclamp_value": ScoreRoute("attention.scores.softclamp_value", same),
    "attn_head_learned_sink": ScoreRoute("attention.scores.head_sink"),
    "attn_add_zero_kv": ScoreRoute("attention.scores.zero_kv"),
    "attn_pre_talking_heads": ScoreRoute("attention.scores.pre_talking_heads"),
    "attn_post_talking_heads": ScoreRoute("attention.scores.post_talking_heads"),
    "attn_max_attend_past": AttendPast("attention.scores.max_attend_past"),
    "attn_z_loss_weight": ScoreRoute("attention.scores.z_loss_weight", same),
    "attn_gate_value_heads": ScoreRoute("attention.scores.gate_value_heads"),
    "attn_output_gate": ScoreRoute("attention.scores.output_gate"),
    "attn_output_gate_headwise": ScoreRoute("attention.scores.output_gate_headwise"),
    "attn_output_gate_rank": ScoreRoute("attention.scores.output_gate_rank", same),
    "attn_gate_values_headwise": ScoreRoute("attention.scores.gate_values_headwise"),
    "attn_gate_values_rank": ScoreRoute("attention.scores.gate_values_rank", same),
    "attn_swiglu_values": ScoreRoute("attention.scores.swiglu_values"),
    "attn_low_rank_silu_gates": ScoreRoute("attention.scores.low_rank_silu_gates"),
    # x-transformers' residual / norm / feedforward keywords (hyper.py, layerscale.py, conditioning.py, dyt.py,
    # feedforward_norm.py; wired by residual_extras.py)
    "num_residual_streams": Route("residual_streams"),
    "hyper_conn_sinkhorn_iters": Route("streams_sinkhorn"),
    "use_layerscale": flag(layerscale=LayerScaleOptions()),
    "layerscale_init_value": Route("layerscale.init"),
    "use_adaptive_layerscale": flag(layerscale=LayerScaleOptions(adaptive=True), condition=ConditionOptions()),
    "use_dynamic_tanh": flag(norm="dyt"),
    "dynamic_tanh_init_alpha": Route("dyt_alpha"),
    "use_adaptive_layernorm": flag(norm="adaptive_layer", condition=ConditionOptions()),
    "use_adaptive_rmsnorm": flag(norm="adaptive_rms", condition=ConditionOptions()),
    "dim_condition": Route("condition.dim"),
    "adaptive_condition_mlp": Route("condition.mlp"),
    "adaptive_condition_mlp_expansion": Route("condition.mlp_expansion"),
    "pre_norm_has_final_norm": Route("keep_final_norm"),
    "ff_post_act_ln": Route("ff.post_act_ln"),
    "ff_solu": flag(ff__activation="solu"),
    # x-transformers' position keywords (position/rotary.py, rotary_scaling.py, dynamic_bias.py, cope.py)
    "rotary_xpos": flag(attention__position="rotary", attention__rotary_xpos=True),
    "rotary_xpos_scale_base": Route("attention.rotary_xpos_scale_base", float),
    "rotary_base_rescale_factor": Route("attention.rotary_scaling", ntk_keyword),
    "rotate_num_heads": Route("attention.rotary_heads"),
    "dynamic_pos_bias": flag(attention__bias="dynamic", dynamic_pos_bias=DynamicBiasOptions()),
    "dynamic_pos_bias_mlp_depth": Route("dynamic_pos_bias.depth"),
    "dynamic_pos_bias_log_distance": Route("dynamic_pos_bias.log_distance"),
    "dynamic_pos_bias_norm": Route("dynamic_pos_bias.norm"),
    "attn_use_cope": flag(attention__relative__cope={}),
    "attn_cope_max_pos": Route("attention.relative.cope.max_pos"),
    "attn_cope_soft_onehot_pos": Route("attention.relative.cope.soft_onehot"),
    "attn_cope_talking_heads": Route("attention.relative.cope.talking_heads"),
    # x-transformers' stack policies (stack_policies.py, stack_order.py, attention/value_residual.py); weight tying is
    # the Universal Transformer's one shared unit
    "weight_tie_layers": Route("universal"),
    "layers_execute_order": Route("execute_order", sequence("a sequence of block indices")),
    "par_ratio": Route("par_ratio"),
    "layer_dropout": Route("layer_dropout", _ints),
    "unet_skips": Route("unet_skips"),
    "reinject_input": flag(reinject=ReinjectOptions()),
    "learned_reinject_input_gate": Route("reinject.gate"),
    "add_value_residual": flag(value_residual=ValueResidualOptions()),
    "learned_value_residual_mix": Route("value_residual.learned"),
    "cross_attn_tokens_dropout": Route("cross_attn_tokens_dropout"),
    # Forgetting Transformer (attention/forgetting.py), x-transformers' data-dependent ALiBi and its per-row form
    "attn_data_dependent_alibi": flag(attention__forgetting=ForgettingOptions()),
    "attn_data_dependent_alibi_per_row": Route("attention.forgetting.per_row"),
    "attn_data_dependent_alibi_per_row_dim_head": Route("attention.forgetting.per_row_dim_head"),
    "attn_data_dependent_alibi_kwargs": ForgetKwargs("attention.forgetting.post_log_scale"),
    # x-transformers' norm / residual extras (residual_scale.py, resi_dual.py,
    # attention/head_scale.py, attention/topk_straight.py); their attention z-loss spellings: attention/z_loss.py
    "use_simple_rmsnorm": flag(norm="simple_rms"),
    "scale_residual": ScaleRoute("residual_scale.learned"),
    "scale_residual_constant": ScaleRoute("residual_scale.constant"),
    "resi_dual": flag(placement="post", resi_dual=ResiDualOptions()),
    "resi_dual_scale": Route("resi_dual.scale"),
    "attn_head_scale": Route("attention.head_scale"),
    "attn_sparse_topk_straight_through": Route("attention.topk_straight_through"),
    # hard and Gumbel-softmax attention (attention/hard_attention.py): normalisers that pick one key
    "attn_hard": flag(attention__normalize="hard"),
    "attn_gumbel_softmax": flag(attention__normalize="gumbel", attention__gumbel=GumbelOptions()),
    "attn_gumbel_softmax_temp": Route("attention.gumbel.temp"),
    "attn_gumbel_softmax_hard": Route("attention.gumbel.hard"),
}
