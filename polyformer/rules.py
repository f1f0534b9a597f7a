"""Which options conflict or are out of range, as data, checked once when a stack is built.

Each rule is a predicate that is True when the config is invalid, and a message that names the
public keywords involved (fields of the config may be interpolated with `{attention.heads}`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

from .attention.hard_attention import keyword as normalizer_keyword
from .config import LayersConfig
from .registry import ACTIVATION, NORM, NORMALIZE, POSITION, RESIDUAL, SCORE_BIAS


@dataclass(frozen=True)
class Rule:
    broken: Callable[[LayersConfig], bool]
    message: str


def _shift_len_wrong(c: LayersConfig) -> bool:
    return isinstance(c.shift_tokens, tuple) and len(c.shift_tokens) != len(c.layout)


def _shifts(c: LayersConfig) -> tuple[int, ...]:
    return c.shift_tokens if isinstance(c.shift_tokens, tuple) else (c.shift_tokens,)


def needs_explicit_path(c: LayersConfig) -> list[str]:
    """The options that the fused SDPA kernel cannot express (they need the reference path)."""
    a = c.attention
    reasons = []
    if a.normalize == "topk":
        reasons.append(f"attn_sparse_topk={a.topk}")
    elif a.normalize == "entmax15":
        reasons.append("attn_use_entmax15=True")
    elif a.normalize != "softmax":
        reasons.append(f"{normalizer_keyword(a.normalize)}=True")
    if a.talking_heads:
        reasons.append("attn_talking_heads=True")
    if a.relative is not None and getattr(a.relative.options, "values", False):
        reasons.append("rel_pos_shaw with rel_pos_shaw_values=True (its value term reads the weights)")
    if c.residual_attn:
        reasons.append("residual_attn=True")
    if c.cross_residual_attn:
        reasons.append("cross_residual_attn=True")
    return reasons


RULES: list[Rule] = [
    Rule(lambda c: not isinstance(c.dim, int) or c.dim < 1, "dim must be a positive integer, got {dim!r}"),
    Rule(lambda c: not isinstance(c.depth, int) or c.depth < 1, "depth must be a positive integer, got {depth!r}"),
    Rule(lambda c: c.attention.heads < 1, "heads must be >= 1, got {attention.heads}"),
    Rule(lambda c: c.attention.dim_head < 1, "attn_dim_head must be >= 1, got {attention.dim_head}"),
    Rule(lambda c: c.attention.kv_heads is not None and c.attention.kv_heads < 1,
         "attn_kv_heads must be >= 1, got {attention.kv_heads}"),
    Rule(lambda c: c.attention.kv_heads is not None and c.attention.kv_heads >= 1
         and c.attention.heads % c.attention.kv_heads != 0,
         "heads ({attention.heads}) must be a multiple of attn_kv_heads ({attention.kv_heads})"),
    Rule(lambda c: c.attention.collab_heads and c.attention.kv_heads is not None,
         "attn_collab_heads=True shares one key projection already; it cannot be combined with attn_kv_heads"),
    Rule(lambda c: not 0 < c.attention.collab_compression <= 1,
         "attn_collab_compression must be in (0, 1], got {attention.collab_compression}"),
    Rule(lambda c: not 0 <= c.attention.dropout < 1, "attn_dropout must be in [0, 1), got {attention.dropout}"),
    Rule(lambda c: not 0 <= c.ff.dropout < 1, "ff_dropout must be in [0, 1), got {ff.dropout}"),
    Rule(lambda c: c.ff.mult <= 0, "ff_mult must be > 0, got {ff.mult}"),
    Rule(lambda c: isinstance(c.ff.chunks, bool) or not isinstance(c.ff.chunks, int) or c.ff.chunks < 1,
         "ff_chunks must be an integer >= 1, got {ff.chunks!r}"),
    Rule(lambda c: c.attention.num_mem_kv < 0, "attn_num_mem_kv must be >= 0, got {attention.num_mem_kv}"),
    Rule(lambda c: c.attention.topk is not None and c.attention.topk < 1,
         "attn_sparse_topk must be >= 1, got {attention.topk}"),
    Rule(lambda c: c.attention.topk is not None and c.attention.normalize != "topk",
         "attn_sparse_topk and {normalizer} conflict: choose one way to normalise attention"),
    Rule(lambda c: c.attention.normalize == "topk" and c.attention.topk is None,
         "top-k attention needs attn_sparse_topk=k"),
    Rule(lambda c: c.attention.normalize == "entmax15" and importlib.util.find_spec("entmax") is None,
         "attn_use_entmax15=True needs the package 'entmax', a dependency of polyformer missing here "
         "(pip install entmax)"),
    Rule(lambda c: c.attention.alibi_num_heads is not None and c.attention.bias != "alibi",
         "alibi_num_heads is set but alibi_pos_emb is not True"),
    Rule(lambda c: c.attention.alibi_num_heads is not None
         and not 1 <= c.attention.alibi_num_heads <= c.attention.heads,
         "alibi_num_heads must be in [1, heads={attention.heads}], got {attention.alibi_num_heads}"),
    Rule(lambda c: c.attention.rotary_dim is not None and c.attention.position != "rotary",
         "rotary_emb_dim is set but rotary_pos_emb is not True"),
    Rule(lambda c: c.attention.rotary_dim is not None
         and (c.attention.rotary_dim % 2 or not 2 <= c.attention.rotary_dim <= c.attention.dim_head),
         "rotary_emb_dim must be even and in [2, attn_dim_head={attention.dim_head}], got {attention.rotary_dim}"),
    Rule(lambda c: c.attention.position == "rotary" and c.attention.rotary_dim is None
         and c.attention.dim_head % 2 and not c.attention.collab_heads,
         "rotary_pos_emb=True needs an even attn_dim_head, got {attention.dim_head} (or set rotary_emb_dim)"),
    Rule(lambda c: c.attention.rel_pos_num_buckets < 2 or c.attention.rel_pos_max_distance < c.attention.rel_pos_num_buckets,
         "rel_pos_num_buckets must be >= 2 and <= rel_pos_max_distance, got "
         "{attention.rel_pos_num_buckets} and {attention.rel_pos_max_distance}"),
    Rule(lambda c: not c.causal and c.attention.bias == "t5" and c.attention.rel_pos_num_buckets < 4,
         "rel_pos_bias=True on a bidirectional stack needs rel_pos_num_buckets >= 4 (half the buckets per "
         "direction), got {attention.rel_pos_num_buckets}"),
    Rule(lambda c: c.attention.position != "rotary" and (c.attention.rotary_base != 10000.0 or c.attention.rotary_interleaved),
         "rotary_base / rotary_interleaved are set but rotary_pos_emb is not True"),
    Rule(lambda c: c.attention.position != "rotary" and (c.attention.rotary_interpolation != 1.0
                                                         or c.attention.rotary_llama3 is not None),
         "rotary_interpolation_factor / rotary_llama3_scaling are set but rotary_pos_emb is not True"),
    Rule(lambda c: not c.attention.rotary_interpolation >= 1.0,
         "rotary_interpolation_factor must be >= 1 (positions are divided by it), got {attention.rotary_interpolation}"),
    Rule(lambda c: c.attention.rotary_llama3 is not None and not (
        c.attention.rotary_llama3[0] >= 1.0 and 0 < c.attention.rotary_llama3[1] < c.attention.rotary_llama3[2]
        and c.attention.rotary_llama3[3] > 0),
         "rotary_llama3_scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
         "original_max_position_embeddings > 0, got {attention.rotary_llama3}"),
    Rule(lambda c: c.attention.rotary_interpolation != 1.0 and c.attention.rotary_llama3 is not None,
         "rotary_interpolation_factor and rotary_llama3_scaling are two rotary scalings; choose one"),
    Rule(lambda c: c.attention.bias != "t5" and (c.attention.rel_pos_num_buckets != 32 or c.attention.rel_pos_max_distance != 128),
         "rel_pos_num_buckets / rel_pos_max_distance are set but rel_pos_bias is not True"),
    Rule(lambda c: c.dim_context is not None and not (c.cross_attend or c.only_cross),
         "dim_context is set but there is no cross-attention: set cross_attend=True"),
    Rule(lambda c: c.only_cross and (c.attention.position != "none" or c.attention.bias != "none" or c.residual_attn),
         "only_cross=True has no self-attention: rotary_pos_emb / position_infused_attn / alibi_pos_emb / "
         "rel_pos_bias / dynamic_pos_bias / residual_attn would do nothing"),
    Rule(lambda c: c.custom_layers is not None and (c.sandwich_coef or c.macaron),
         "custom_layers fixes the layout; it cannot be combined with sandwich_coef or macaron"),
    Rule(lambda c: c.custom_layers is not None and (not c.custom_layers or any(t not in "acf" for t in c.custom_layers)),
         "custom_layers must be a non-empty sequence of 'a', 'c', 'f', got {custom_layers!r}"),
    Rule(lambda c: c.custom_layers is not None and "c" in c.custom_layers and not (c.cross_attend or c.only_cross),
         "custom_layers has a cross-attention block 'c' but cross_attend is not True"),
    Rule(lambda c: c.custom_layers is not None and "c" not in c.custom_layers and (c.cross_attend or c.only_cross),
         "cross_attend=True (or only_cross=True) but custom_layers={custom_layers!r} has no cross-attention block 'c'"),
    Rule(lambda c: c.sandwich_coef is not None and not 0 < c.sandwich_coef <= c.depth,
         "sandwich_coef must be in [1, depth={depth}], got {sandwich_coef}"),
    Rule(lambda c: c.sandwich_coef is not None and (c.cross_attend or c.only_cross),
         "sandwich_coef reorders self-attention and feedforward blocks; it cannot be combined with cross_attend "
         "or only_cross"),
    Rule(lambda c: c.only_cross and c.causal, "only_cross=True has no self-attention to make causal"),
    Rule(_shift_len_wrong, "shift_tokens as a tuple needs one entry per block: {n_blocks} blocks {layout} (from depth, "
         "macaron, sandwich_coef, cross_attend, only_cross, custom_layers), got {n_shift}"),
    Rule(lambda c: any(s < 0 for s in _shifts(c)), "shift_tokens must be >= 0, got {shift_tokens!r}"),
    Rule(lambda c: c.cross_residual_attn and not (c.cross_attend or c.only_cross),
         "cross_residual_attn=True needs cross_attend=True"),
    Rule(lambda c: c.norm == "none" and c.placement != "pre",
         "use_rezero=True removes the norms; it cannot be combined with pre_norm=False, sandwich_norm=True or "
         "resi_dual=True"),
    Rule(lambda c: c.attention.fused is True and bool(needs_explicit_path(c)),
         "attn_flash=True asks for the fused kernel, which cannot run {explicit}"),
    Rule(lambda c: c.attention.normalize not in NORMALIZE, "unknown attention normaliser {attention.normalize!r}"),
    Rule(lambda c: c.attention.position not in POSITION, "unknown position scheme {attention.position!r}"),
    Rule(lambda c: c.attention.bias not in SCORE_BIAS, "unknown score bias {attention.bias!r}"),
    Rule(lambda c: c.norm not in NORM, "unknown norm {norm!r}"),
    Rule(lambda c: c.residual not in RESIDUAL, "unknown residual {residual!r}"),
    Rule(lambda c: c.ff.activation not in ACTIVATION, "unknown feedforward activation {ff.activation!r}"),
    Rule(lambda c: c.placement not in ("pre", "post", "sandwich"), "unknown norm placement {placement!r}"),
]


class _Fields(dict):
    """Formats '{attention.heads}' against a config, plus a few derived values."""

    def __init__(self, cfg: LayersConfig):
        super().__init__()
        self.cfg = cfg

    def __missing__(self, key: str) -> object:
        if key == "n_blocks":
            return len(self.cfg.layout)
        if key == "n_shift":
            return len(self.cfg.shift_tokens) if isinstance(self.cfg.shift_tokens, tuple) else 1
        if key == "normalizer":
            return normalizer_keyword(self.cfg.attention.normalize)
        if key == "explicit":
            return ", ".join(needs_explicit_path(self.cfg))
        return getattr(self.cfg, key)


def check(cfg: LayersConfig, owner: str = "AttentionLayers") -> None:
    """Raise ValueError for the first broken rule, with a message naming the keywords."""
    for rule in RULES:
        if rule.broken(cfg):
            raise ValueError(f"{owner}: " + rule.message.format_map(_Fields(cfg)))
    from . import deepnet, hourglass, moe, resi_dual, residual_extras, reversible, stack_policies, universal
    from .attention import forgetting, hard_attention, knn_memory, latent, scoring
    from .attention.kernels import direct
    from .position import dynamic_bias, relative, rotary, rotary_scaling

    found = [problem for piece in (direct, resi_dual, reversible, deepnet, universal, hourglass, moe, relative, rotary_scaling,
                                   knn_memory, latent, scoring, residual_extras, rotary, dynamic_bias,
                                   stack_policies, forgetting, hard_attention)
             for problem in piece.problems(cfg)]      # each variant's own checks, in this order
    if found:
        raise ValueError(f"{owner}: " + found[0])
    if cfg.attention.pattern:
        from .attention.patterns import problems

        found = problems(cfg.attention.pattern, cfg.attention.heads, cfg.causal)
        if cfg.only_cross:
            from .attention.patterns import keyword

            named = " / ".join(keyword(c.name) for c in cfg.attention.pattern)
            found.append(f"{named} shape(s) self-attention; only_cross=True has none")
        if found:
            raise ValueError(f"{owner}: " + found[0])
    if cfg.attention_layers is not None:     # attn_per_layer: each block's config by these rules (per_layer.py)
        from .per_layer import check as per_layer_check

        per_layer_check(cfg, owner)
