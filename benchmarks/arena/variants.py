"""The arena's variants: one row each, a name mapped to polyformer keywords.

A row says which keywords go on the layer stack (`Encoder` / `Decoder`), which on the wrapper
(`TransformerWrapper`), which environment switches hold while it runs, and which tasks it joins by
default. Adding a variant to the arena is adding a row here; every task builds its models from these
rows alone, so two variants of one task differ only in their keywords.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TASK_NAMES = ("extrapolation", "mqar", "efficiency", "listops", "long_text")


@dataclass(frozen=True)
class Variant:
    name: str
    summary: str                                              # one line for tables and --list
    paper: str                                                # arXiv id or reference
    layers: dict[str, Any] = field(default_factory=dict)      # keywords for Encoder / Decoder
    wrapper: dict[str, Any] = field(default_factory=dict)     # keywords for TransformerWrapper
    env: dict[str, str] = field(default_factory=dict)         # environment while it runs
    tasks: tuple[str, ...] = ()                               # tasks it joins by default
    causal_only: bool = False                                 # cannot run in an Encoder
    encoder_only: bool = False                                # cannot run in a Decoder
    min_len: int = 0                                          # the shortest input it takes
    min_depth: int = 1                                        # the fewest layers it builds with (a chosen layer)
    runner: str = ""                                          # a task's own procedure for it (long_text: retrieval)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tasks) - set(TASK_NAMES))
        if unknown:
            raise ValueError(f"variant {self.name!r}: unknown task(s) {unknown}; tasks are {TASK_NAMES}")


POSITIONS = ("extrapolation",)
ATTENTION = ("mqar", "listops", "efficiency")
SPARSE = ("listops", "efficiency")
LINEAR = ("mqar", "listops", "efficiency", "long_text")

VARIANTS: dict[str, Variant] = {v.name: v for v in [
    # --- attention (the dense kernel and its normalisers) --------------------------------------
    Variant("dense", "exact softmax attention, the default fast path (our CPU kernel / SDPA)",
            "arXiv:1706.03762", layers=dict(rotary_pos_emb=True), tasks=ATTENTION),
    Variant("dense_sdpa", "exact softmax attention on torch's scaled_dot_product_attention only",
            "arXiv:1706.03762", layers=dict(rotary_pos_emb=True), env={"POLYFORMER_CPU_ATTENTION": "0"},
            tasks=("efficiency",)),
    Variant("topk", "softmax over each query's 8 largest scores only (explicit sparse transformer)",
            "arXiv:1912.11637", layers=dict(rotary_pos_emb=True, attn_sparse_topk=8),
            tasks=("mqar", "listops")),
    Variant("entmax15", "sparse entmax-1.5 instead of softmax", "arXiv:1909.00015",
            layers=dict(rotary_pos_emb=True, attn_use_entmax15=True), tasks=()),
    Variant("hard", "one key per query, its largest score; softmax's gradient (x-transformers' attn_hard)",
            "arXiv:2410.01104", layers=dict(rotary_pos_emb=True, attn_hard=True), tasks=()),
    Variant("gumbel", "one key per query drawn by Gumbel-max (in eval too); the soft draw's gradient",
            "arXiv:1611.01144", layers=dict(rotary_pos_emb=True, attn_gumbel_softmax=True), tasks=()),
    # --- positions ---------------------------------------------------------------------------
    Variant("abs_learned", "learned absolute positions (one vector per position)", "arXiv:1706.03762",
            wrapper=dict(use_abs_pos_emb=True), tasks=POSITIONS),   # mqar gives every row learned positions
    Variant("sinusoidal", "fixed sinusoidal absolute positions, scaled by a learned scalar",
            "arXiv:1706.03762", wrapper=dict(scaled_sinu_pos_emb=True), tasks=POSITIONS),
    Variant("rotary", "rotary position embedding on q and k", "arXiv:2104.09864",
            layers=dict(rotary_pos_emb=True), tasks=POSITIONS),
    Variant("rotary_dynamic_ntk", "rotary trained at 128; past 128 tokens dynamic NTK scaling raises the base with "
            "the length (factor 8, Hugging Face's rope_type 'dynamic')", "arXiv:2309.00071",
            layers=dict(rotary_pos_emb=True, rotary_dynamic_ntk=(8, 128)), tasks=POSITIONS),
    Variant("rotary_yarn", "rotary with YaRN's frequencies and attention temperature for factor 8 over 128 tokens, "
            "trained with them", "arXiv:2309.00071",
            layers=dict(rotary_pos_emb=True, rotary_yarn=(8, 128)), tasks=POSITIONS),
    Variant("rotary_interpolation", "rotary with positions divided by 8 (position interpolation), trained with them",
            "arXiv:2306.15595", layers=dict(rotary_pos_emb=True, rotary_interpolation_factor=8), tasks=POSITIONS),
    Variant("alibi", "ALiBi: a linear distance penalty per head", "arXiv:2108.12409",
            layers=dict(alibi_pos_emb=True), tasks=POSITIONS),
    Variant("t5_bias", "T5's learned bucketed relative bias", "arXiv:1910.10683",
            layers=dict(rel_pos_bias=True), tasks=POSITIONS),
    Variant("dynamic_bias", "a per-head bias from an MLP of the log-spaced offset (x-transformers' dynamic_pos_bias)",
            "arXiv:2111.09883", layers=dict(dynamic_pos_bias=True, dynamic_pos_bias_log_distance=True), tasks=POSITIONS),
    Variant("nope", "no positional information at all (causal masking alone)", "arXiv:2305.19466",
            wrapper=dict(use_abs_pos_emb=False), tasks=POSITIONS, causal_only=True),
    Variant("infused", "sinusoids added to the q / k inputs of every layer (Shortformer)",
            "arXiv:2012.15832", layers=dict(position_infused_attn=True), tasks=()),
    Variant("abs_per_layer", "learned absolute positions, a table of its own added to every layer's input",
            "arXiv:1808.04444", wrapper=dict(abs_pos_per_layer=True), tasks=POSITIONS),
    Variant("randomized_learned", "learned absolute positions of [0, 1024), trained at sorted random samples of them",
            "arXiv:2305.16843", wrapper=dict(randomized_pos=1024), tasks=POSITIONS),
    Variant("randomized_rotary", "rotary positions trained at sorted random samples of [0, 1024)",
            "arXiv:2305.16843", layers=dict(rotary_pos_emb=True), wrapper=dict(randomized_pos=1024), tasks=POSITIONS),
    Variant("shaw", "Shaw et al.: learned key and value embeddings of the distance clipped to ±16",
            "arXiv:1803.02155", layers=dict(rel_pos_shaw=16), tasks=POSITIONS),
    Variant("xl_relative", "Transformer-XL relative encoding: sinusoids of i - j through W_R, learned u and v",
            "arXiv:1901.02860", layers=dict(rel_pos_xl=True), tasks=POSITIONS),
    Variant("cope", "CoPE: positions counted by sigmoid gates on q . k, interpolated embeddings (x-transformers' "
            "attn_use_cope)", "arXiv:2405.18719", layers=dict(attn_use_cope=True), tasks=(), causal_only=True),
    Variant("distance_aware", "DA-Transformer: ReLU scores scaled per head by a learned function of |i - j|",
            "arXiv:2010.06925", layers=dict(attn_distance_aware=True), tasks=POSITIONS),
    # YaRN / dynamic NTK rows join POSITIONS with their code (issue 20: rotary scaling); randomized_pos=1024 covers the
    # extrapolation task's longest evaluation (8 x 128).
    # --- sparse patterns (attention/patterns/): cost n x visible keys, computed sparse ---------
    Variant("window", "sliding window: each query sees the last 256 keys (both sides: 128 each)",
            "arXiv:2004.05150", layers=dict(rotary_pos_emb=True, attn_window=256), tasks=SPARSE),
    Variant("window_sinks", "sliding window of 64 keys plus 4 attention sinks (StreamingLLM)",
            "arXiv:2309.17453", layers=dict(rotary_pos_emb=True, attn_window=64, attn_sink_tokens=4),
            tasks=("extrapolation",), causal_only=True),
    Variant("dilated_window", "a window of 128 keys spaced 2 apart (Longformer's dilation)", "arXiv:2004.05150",
            layers=dict(rotary_pos_emb=True, attn_window=128, attn_window_dilation=2), tasks=SPARSE),
    Variant("longformer", "window of 256 keys, the first token global (sees and is seen by all)",
            "arXiv:2004.05150", layers=dict(rotary_pos_emb=True, attn_window=256, attn_global_tokens=1),
            tasks=SPARSE),
    Variant("bigbird", "window of 3 blocks of 32, the first block global, 3 random blocks per query block",
            "arXiv:2007.14062", layers=dict(rotary_pos_emb=True, attn_window=96, attn_global_tokens=32,
                                            attn_random_blocks=3, attn_block_size=32), tasks=SPARSE, min_len=96),
    Variant("bigbird_hf", "BigBird's blocks of 64 as Hugging Face lays them out: first / last block global, 3 blocks "
            "of window, block 0 weighted 1 + 3 times (its eval-mode random blocks)", "arXiv:2007.14062",
            layers=dict(rotary_pos_emb=True, attn_bigbird_blocks=dict(block_size=64, random_blocks=3)),
            tasks=SPARSE, encoder_only=True),
    Variant("strided", "Sparse Transformer strided: the last 64 keys and every 64th, merged in every head",
            "arXiv:1904.10509", layers=dict(rotary_pos_emb=True, attn_sparse="strided", attn_sparse_stride=64,
                                            attn_sparse_mode="union"), tasks=SPARSE),
    Variant("fixed", "Sparse Transformer fixed: the own block of 64 and the last 8 of every block",
            "arXiv:1904.10509", layers=dict(rotary_pos_emb=True, attn_sparse="fixed", attn_sparse_stride=64,
                                            attn_sparse_summary=8, attn_sparse_mode="union"), tasks=SPARSE),
    Variant("blockwise", "the sequence in 2 blocks; half the heads see their block, half the other",
            "arXiv:1911.02972", layers=dict(rotary_pos_emb=True, attn_blockwise=2), tasks=SPARSE,
            encoder_only=True),
    Variant("block_local", "blocks of 128 queries see their block and the 128 positions before",
            "arXiv:1802.05751", layers=dict(rotary_pos_emb=True, attn_block_local=(128, 128)), tasks=SPARSE),
    Variant("local_2d", "the sequence as 128-wide raster rows: 8 x 16 query blocks, 8 rows / 16 columns memory",
            "arXiv:1802.05751", layers=dict(rotary_pos_emb=True, attn_local_2d=dict(image=(128, 128), query=(8, 16),
                                                                                   memory=(8, 16))),
            tasks=SPARSE),
    Variant("longnet", "LongNet dilated attention: (w, r) = (128, 1), (512, 2), (2048, 4), (8192, 8)",
            "arXiv:2307.02486", layers=dict(rotary_pos_emb=True, attn_dilated=((128, 1), (512, 2), (2048, 4),
                                                                               (8192, 8))), tasks=SPARSE),
    # --- linear-time attention (attention/kernels/, mixers/): no n x n matrix --------------------
    Variant("linear", "linear transformer: φ(q)ᵀ Σ φ(k) vᵀ with φ = elu + 1", "arXiv:2006.16236",
            layers=dict(rotary_pos_emb=True, attn_linear="elu"), tasks=LINEAR),
    Variant("performer", "Performer FAVOR+: 64 positive orthogonal random features for softmax", "arXiv:2009.14794",
            layers=dict(rotary_pos_emb=True, attn_performer=True, attn_performer_features=64), tasks=LINEAR),
    Variant("rfa_gate", "Random Feature Attention with its gate: 32 random Fourier frequencies", "arXiv:2103.02143",
            layers=dict(rotary_pos_emb=True, attn_rfa=True, attn_rfa_features=32, attn_rfa_gate=True),
            tasks=LINEAR, causal_only=True),
    Variant("linformer", "Linformer: keys and values projected along the sequence to 256 rows (E, F learned)",
            "arXiv:2006.04768", layers=dict(rotary_pos_emb=True, attn_linformer_k=256, attn_linformer_seq_len=32768),
            tasks=("listops", "efficiency"), encoder_only=True),
    Variant("nystrom", "Nyströmformer: 64 segment-mean landmarks, 6-step pseudo-inverse, conv residual 33",
            "arXiv:2102.03902", layers=dict(rotary_pos_emb=True, attn_nystrom_landmarks=64, attn_nystrom_conv=33),
            tasks=("listops", "efficiency"), encoder_only=True),
    Variant("fnet", "FNet: Re(FFT2) over sequence and features replaces attention (no parameters)",
            "arXiv:2105.03824", layers=dict(attn_fnet=True),
            tasks=("listops", "efficiency"), encoder_only=True),
    Variant("aft_simple", "AFT-simple: σ(Q) ⊙ Σ softmax_j(K_j) ⊙ V_j, no position biases", "arXiv:2105.14103",
            layers=dict(rotary_pos_emb=True, attn_aft="simple"), tasks=LINEAR),
    Variant("aft_conv", "AFT-conv: learned per-head position biases in a window of 64 around each query",
            "arXiv:2105.14103", layers=dict(rotary_pos_emb=True, attn_aft="conv", attn_aft_window=64), tasks=LINEAR),
    Variant("gau", "FLASH: gated attention units (relu² attention, e = 2·dim, s = 128) in place of attention + FF",
            "arXiv:2202.10447", layers=dict(rotary_pos_emb=True, gau=True), tasks=("mqar", "listops")),
    Variant("flash", "FLASH mixed chunk attention: GAU quadratic inside chunks of 256, linear across them",
            "arXiv:2202.10447", layers=dict(rotary_pos_emb=True, gau=True, gau_chunk=256), tasks=LINEAR),
    # --- content-based attention (attention/kernels/): keys found by hashing, clustering or sorting ---
    Variant("lsh", "Reformer LSH attention: shared QK, 4 hash rounds into 32 buckets, chunks of 64 keys per bucket",
            "arXiv:2001.04451", layers=dict(rotary_pos_emb=True, attn_lsh=True, attn_lsh_bucket_size=64,
                                            attn_lsh_n_hashes=4, attn_lsh_n_buckets=32), tasks=ATTENTION),
    Variant("sinkhorn", "Sparse Sinkhorn attention: blocks of 64 sorted by a learned Gumbel-Sinkhorn permutation",
            "arXiv:2002.11296", layers=dict(rotary_pos_emb=True, attn_sinkhorn=True, attn_sinkhorn_bucket_size=64),
            tasks=ATTENTION),
    Variant("routing", "Routing attention: q / k routed to 16 k-means clusters, 2 chunks of 64 keys of the own cluster",
            "arXiv:2003.05997", layers=dict(rotary_pos_emb=True, attn_routing=True, attn_routing_clusters=16,
                                            attn_routing_window=64), tasks=ATTENTION),
    # --- depth policies (universal.py, act.py): the same parameters unshared are the "dense" row ---
    Variant("universal", "Universal Transformer: one block's weights applied depth times, position + step sinusoids "
            "added before every step", "arXiv:1807.03819",
            layers=dict(rotary_pos_emb=True, universal=True, ut_timestep_emb=True), tasks=("mqar", "listops")),
    Variant("act", "Universal Transformer with ACT per position: halting at 0.99, at most depth steps, ponder "
            "cost 0.01 x mean(N + R)", "arXiv:1603.08983, 1807.03819",
            layers=dict(rotary_pos_emb=True, universal=True, ut_timestep_emb=True, act=True),
            tasks=("mqar", "listops")),
    # --- memories ----------------------------------------------------------------------------
    Variant("no_memory", "segments of 128 tokens, no memory of earlier segments", "arXiv:1901.02860",
            layers=dict(rotary_pos_emb=True), tasks=("long_text",)),
    Variant("xl", "Transformer-XL memory of the previous segment's hidden states (128 per layer)",
            "arXiv:1901.02860", layers=dict(rotary_pos_emb=True), wrapper=dict(max_mem_len=128),
            tasks=("long_text",), causal_only=True),
    Variant("xl_paper", "Transformer-XL as the paper: its relative encoding (sinusoids of i - j, learned u, v) "
            "with the memory of the previous segment (128 per layer)", "arXiv:1901.02860",
            layers=dict(rel_pos_xl=True), wrapper=dict(max_mem_len=128, use_abs_pos_emb=False),
            tasks=("long_text",), causal_only=True),
    Variant("xl_shaw", "Shaw et al.'s clipped relative distances (±16) with the XL memory of the previous segment",
            "arXiv:1803.02155, 1901.02860", layers=dict(rel_pos_shaw=16),
            wrapper=dict(max_mem_len=128, use_abs_pos_emb=False), tasks=("long_text",), causal_only=True),
    Variant("xl_alibi", "ALiBi's distance penalties with the XL memory of the previous segment",
            "arXiv:2108.12409, 1901.02860", layers=dict(alibi_pos_emb=True),
            wrapper=dict(max_mem_len=128, use_abs_pos_emb=False), tasks=("long_text",), causal_only=True),
    Variant("xl_t5", "T5's learned bucketed relative bias with the XL memory of the previous segment",
            "arXiv:1910.10683, 1901.02860", layers=dict(rel_pos_bias=True),
            wrapper=dict(max_mem_len=128, use_abs_pos_emb=False), tasks=("long_text",), causal_only=True),
    Variant("xl_distance_aware", "DA-Transformer's distance-weighted ReLU scores with the XL memory of the previous "
            "segment", "arXiv:2010.06925, 1901.02860", layers=dict(attn_distance_aware=True),
            wrapper=dict(max_mem_len=128, use_abs_pos_emb=False), tasks=("long_text",), causal_only=True),
    Variant("spalm", "SPALM: the XL row's model (tied embedding) trained half the budget, then with a datastore of "
            "the text read so far (keyed by a frozen copy), each position's 4 nearest entries' next bytes embedded, "
            "attended with the last state and gated in", "arXiv:2102.02557",
            layers=dict(rotary_pos_emb=True), wrapper=dict(max_mem_len=128, tie_embedding=True),
            tasks=("long_text",), causal_only=True, runner="spalm"),
    Variant("knn_lm", "kNN-LM: the no_memory row's model; then a datastore on text of another kind (the stdlib's "
            ".txt / .rst / .html files) and p = λ p_kNN + (1 - λ) p_LM on other such files (domain adaptation)",
            "arXiv:1911.00172",
            layers=dict(rotary_pos_emb=True), tasks=("long_text",), causal_only=True, runner="knn_lm"),
    Variant("memorizing", "Memorizing Transformer: block 1 also attends to its top 32 of a kNN memory of the last "
            "2048 keys / values per stream (exact search), gated per head; with the XL memory of 128",
            "arXiv:2203.08913", layers=dict(rotary_pos_emb=True, knn_memory_layers=(1,), knn_memory_size=2048,
                                            knn_topk=32), wrapper=dict(max_mem_len=128), tasks=("long_text",),
            causal_only=True, min_depth=2),
    Variant("compressive", "Compressive Transformer: XL memory of 64 plus a compressed memory of 64 (mean pooling, "
            "c 3): the memory budget and parameters of `xl` (128 states per layer), reaching back 64 + 3 x 64 = 256",
            "arXiv:1911.05507", layers=dict(rotary_pos_emb=True),
            wrapper=dict(max_mem_len=64, max_cmem_len=64, cmem_ratio=3, cmem_fn="mean_pool"),
            tasks=("long_text",), causal_only=True),
    Variant("landmark", "Landmark attention: a landmark token after every 16 tokens, grouped softmax (each block "
            "gated by its landmark's score); evaluation retrieves each query's top 2 earlier blocks; no XL memory",
            "arXiv:2305.16300", layers=dict(rotary_pos_emb=True, landmark_block=16, landmark_topk=2),
            tasks=("long_text",), causal_only=True),
    Variant("infini", "Infini-attention: causal softmax attention inside segments of 32 and a compressive memory "
            "(d x d per head, linear rule) of every earlier segment, carried from forward to forward (detached at "
            "the boundary; rotary positions restart per 128-token forward), gated per head; no XL memory",
            "arXiv:2404.07143",
            layers=dict(rotary_pos_emb=True, attn_infini=True, attn_infini_segment=32), tasks=("long_text",),
            causal_only=True),
    Variant("infini_delta", "Infini-attention as `infini` with the delta rule: a segment writes into the memory only "
            "what the memory does not already retrieve for its keys", "arXiv:2404.07143",
            layers=dict(rotary_pos_emb=True, attn_infini=True, attn_infini_segment=32, attn_infini_delta=True),
            tasks=("long_text",), causal_only=True),
    # --- mixture of experts: `no_memory` is the dense row of equal active parameters ------------
    Variant("moe", "8 experts of ff_mult 2, top-2, Switch balance loss 0.01: the active feedforward parameters of "
            "`no_memory` (ff_mult 4), 4x its total", "arXiv:2101.03961, 2006.16668",
            layers=dict(rotary_pos_emb=True, ff_moe=True, ff_num_experts=8, ff_moe_top_k=2, ff_mult=2),
            tasks=("long_text",)),
    Variant("dense_wide", "dense feedforward of ff_mult 16: the total parameters of `moe` (within its routers')",
            "arXiv:2101.03961", layers=dict(rotary_pos_emb=True, ff_mult=16), tasks=("long_text",)),
    # --- adaptive computation ----------------------------------------------------------------
    Variant("adaptive_span", "adaptive attention span: a learned soft span per head, up to 224 + ramp 32 keys "
            "(the XL memory of 128 and the segment)", "arXiv:1905.07799",
            layers=dict(rotary_pos_emb=True, attn_adaptive_span=224, attn_adaptive_span_ramp=32),
            wrapper=dict(max_mem_len=128), tasks=("long_text",), causal_only=True),
    Variant("hourglass", "Hourglass: the middle layers on the sequence shortened 3x (shift by 2, linear pooling), "
            "linear upsampling plus the residual; depth split evenly (4: 1@1, 2@3, 1@1)", "arXiv:2110.13711",
            layers=dict(rotary_pos_emb=True, hourglass=3), tasks=("long_text",)),
    Variant("early_exit", "CALM early exit: every layer may exit (softmax-margin confidence, threshold 0.9), trained "
            "on the layer-weighted average of the exit losses; no XL memory (as `no_memory`); speed / quality "
            "curve over thresholds", "arXiv:2207.07061, 1910.10073",
            layers=dict(rotary_pos_emb=True, exit_layers=True, exit_confidence="softmax_margin", exit_threshold=0.9),
            tasks=("long_text",), causal_only=True, min_depth=2),
]}


def variant(name: str) -> Variant:
    if name not in VARIANTS:
        import difflib

        close = difflib.get_close_matches(name, VARIANTS, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown variant {name!r}{hint} (see python -m benchmarks.arena --list)")
    return VARIANTS[name]


def for_task(task: str) -> list[str]:
    """The variants that join `task` by default, in table order."""
    return [name for name, v in VARIANTS.items() if task in v.tasks]
