"""Frozen, typed configs, one per pipeline stage, with a JSON round-trip.

Configs are plain data: every choice is a name (resolved through `registry`) or a number, so a
model can be rebuilt from the JSON saved next to its weights.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from .act import ActOptions
from .early_exit import ExitOptions
from .hourglass import HourglassOptions
from .moe.options import MoeOptions
from .attention.knn_memory import KnnMemoryOptions
from .conditioning import ConditionOptions
from .layerscale import LayerScaleOptions
from .position.dynamic_bias import DynamicBiasOptions
from .attention.latent import LatentOptions
from .attention.value_residual import ValueResidualOptions
from .stack_policies import ReinjectOptions, par_layout
from .attention.score_options import ScoreOptions
from .attention.forgetting import ForgettingOptions
from .residual_scale import ResidualScaleOptions
from .resi_dual import ResiDualOptions
from .attention.hard_attention import GumbelOptions


@dataclass(frozen=True)
class Choice:
    """A stage's variant by name with its own options, a frozen dataclass beside its code (e.g.
    `Choice("pattern", "window", WindowOptions(size=256))`). The stage config holds choices, not a
    field per knob; JSON: {"stage", "name", "options"}, the options class found in the registry."""

    stage: str
    name: str
    options: Any = None


# the keyword that switches on each score bias (AttentionConfig.bias), for messages
BIAS_KEYWORD = {"t5": "rel_pos_bias", "alibi": "alibi_pos_emb", "dynamic": "dynamic_pos_bias"}


@dataclass(frozen=True)
class AttentionConfig:
    heads: int = 8
    dim_head: int = 64
    kv_heads: int | None = None         # None: one kv head per query head; 1: multi-query
    dropout: float = 0.0                # on the attention weights
    num_mem_kv: int = 0                 # persistent memory key / values (arXiv:1907.01470)
    position: str = "none"              # "rotary", "infused"            (registry.POSITION)
    rotary_dim: int | None = None       # None: rotate the whole head
    rotary_base: float = 10000.0
    rotary_interleaved: bool = False    # pairs (0,1),(2,3)... as RoFormer; False pairs i, i + d/2
    rotary_interpolation: float = 1.0   # positions / factor (position interpolation, arXiv:2306.15595)
    rotary_llama3: tuple[float, float, float, float] | None = None   # (factor, low_freq_factor,
                                        # high_freq_factor, original context): Llama 3's frequency scaling
    rotary_scaling: Choice | None = None   # YaRN, dynamic NTK, LongRoPE with options (registry.ROTARY_SCALING)
    rotary_xpos: bool = False           # xPos decay on the rotary (arXiv:2212.10554; position/rotary.py), causal only
    rotary_xpos_scale_base: float | None = None   # xPos's gamma; None: 512
    rotary_heads: int | None = None     # rotate_num_heads: rotate only the last n heads; None: every head
    bias: str = "none"                  # "t5", "alibi"                 (registry.SCORE_BIAS)
    alibi_num_heads: int | None = None  # None: every head
    rel_pos_num_buckets: int = 32
    rel_pos_max_distance: int = 128
    normalize: str = "softmax"          # "topk", "entmax15"            (registry.NORMALIZE)
    topk: int | None = None
    talking_heads: bool = False
    collab_heads: bool = False
    collab_compression: float = 0.3
    on_attn: bool = False
    gate_values: bool = False
    qkv_bias: bool = False              # biases on the q, k, v projections (GPT-2, BERT)
    out_bias: bool = False              # a bias on the output projection (GPT-2, BERT)
    kernel: Choice = Choice("kernel", "dense")   # how queries meet keys (registry.KERNEL): dense softmax
                                        # attention, or a kernel of its own (Performer, linear, ...) with options
    pattern: tuple[Choice, ...] = ()    # which keys each query sees: pieces from registry.PATTERN
    fused: bool | None = None           # None: fused SDPA path when possible; True: demand it; False: never
    relative: Choice | None = None      # q-dependent relative position terms (registry.RELATIVE): Shaw, Transformer-XL
    latent: LatentOptions | None = None   # multi-latent attention (attention/latent.py): attn_use_latent_q / _kv
    scores: ScoreOptions | None = None    # qk norm, sigmoid, soft-capping, sinks, z-loss, head gates (attention/scoring.py)
    forgetting: ForgettingOptions | None = None   # attn_data_dependent_alibi (attention/forgetting.py)
    head_scale: bool = False            # attn_head_scale: a learned scale per head's output (attention/head_scale.py)
    topk_straight_through: bool = False   # top-k forward, full softmax gradient (attention/topk_straight.py)
    gumbel: GumbelOptions | None = None   # attn_gumbel_softmax's tau and hard switch (attention/hard_attention.py)


@dataclass(frozen=True)
class FeedForwardConfig:
    mult: float = 4
    activation: str = "gelu"            # "relu", "relu_squared", "swish", "gelu_tanh" (registry.ACTIVATION)
    glu: bool = False
    dropout: float = 0.0
    bias: bool = True
    chunks: int = 1                     # computed in this many pieces along the sequence (ff_chunks)
    moe: MoeOptions | None = None       # a mixture of experts (moe/): ff_moe=True and its ff_moe_* options
    post_act_ln: bool = False           # ff_post_act_ln: LayerNorm after the activation (NormFormer; feedforward_norm.py)


@dataclass(frozen=True)
class LayersConfig:
    dim: int
    depth: int
    causal: bool = False
    cross_attend: bool = False
    dim_context: int | None = None      # feature size of the cross-attention context; None: dim
    only_cross: bool = False
    custom_layers: tuple[str, ...] | None = None   # explicit layout, e.g. ("a", "f", "a", "f")
    sandwich_coef: int | None = None
    macaron: bool = False
    norm: str = "layer"                 # "layer", "scale", "rms", "none"  (registry.NORM)
    norm_eps: float = 1e-5
    placement: str = "pre"              # "pre", "post", "sandwich"
    residual: str = "add"               # "add", "rezero", "gru", "deepnorm" (registry.RESIDUAL)
    residual_attn: bool = False
    cross_residual_attn: bool = False
    shift_tokens: int | tuple[int, ...] = 0
    gradient_checkpointing: bool = False
    deepnorm_depths: tuple[int, int] | None = None   # DeepNet (deepnet.py): (N encoder, M decoder layers) of the
                                        # encoder-decoder this stack is part of (XTransformer sets it); None: on its own
    reversible: bool = False            # two streams, inputs recomputed in the backward (reversible.py)
    reversible_merge: str = "mean"      # the two streams -> the output: "mean" (dim) or "concat" (2 dim,
                                        # Hugging Face's Reformer; the final norm and the head take 2 dim)
    mixer: Choice | None = None         # what an 'a' block runs instead of attention (registry.MIXER: FNet)
    universal: bool = False             # Universal Transformer (universal.py): one unit's weights applied depth times
    ut_timestep_emb: bool = False       # its coordinate embedding (position and step sinusoids) before every step
    act: ActOptions | None = None       # ACT halting per position over the universal steps (act.py)
    hourglass: HourglassOptions | None = None   # Hourglass (hourglass.py): middle layers on a shortened sequence
    early_exit: ExitOptions | None = None   # early exit (early_exit.py): exit_layers, exit_confidence, exit_threshold
    knn_memory: KnnMemoryOptions | None = None   # Memorizing Transformer (attention/knn_memory.py): kNN memory blocks
    # x-transformers 2.x stack policies (stack_policies.py, stack_order.py, attention/value_residual.py)
    par_ratio: int | None = None        # PAR layout: attention in the first two thirds, par_ratio layers per attention
    execute_order: tuple[int, ...] | None = None   # layers_execute_order: built blocks run in this order, repeats allowed
    layer_dropout: float | tuple[float, ...] = 0.0   # stochastic depth: training skips a whole block (per block)
    unet_skips: bool = False            # U-Net long skips: unit D-1-k starts from W [x_k ; x]
    reinject: ReinjectOptions | None = None   # reinject_input: W x0 joins every branch input
    value_residual: ValueResidualOptions | None = None   # add_value_residual: later blocks mix in the first's values
    cross_attn_tokens_dropout: float = 0.0   # training: each row keeps a random (1 - p) of its context tokens
    residual_streams: int = 1           # num_residual_streams: hyper-connections over n streams (hyper.py)
    streams_sinkhorn: int | None = None  # hyper_conn_sinkhorn_iters: their manifold-constrained form (hyper_manifold.py)
    layerscale: LayerScaleOptions | None = None   # use_layerscale / use_adaptive_layerscale (layerscale.py)
    condition: ConditionOptions | None = None     # adaptive norms / layerscale read the forward's condition (conditioning.py)
    dyt_alpha: float = 1.0              # dynamic_tanh_init_alpha: use_dynamic_tanh's initial alpha (dyt.py)
    keep_final_norm: bool = True        # pre_norm_has_final_norm: a pre-norm stack's norm after the last block
    residual_scale: ResidualScaleOptions | None = None   # scale_residual / scale_residual_constant (residual_scale.py)
    resi_dual: ResiDualOptions | None = None   # ResiDual: Post-LN blocks and an accumulating stream (resi_dual.py)
    dynamic_pos_bias: DynamicBiasOptions | None = None   # dynamic_pos_bias's MLP (position/dynamic_bias.py)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    attention_layers: tuple[AttentionConfig, ...] | None = None   # one per self-attention block (attn_per_layer,
                                        # per_layer.py): the stack's `attention` with the block's own keywords on top
    ff: FeedForwardConfig = field(default_factory=FeedForwardConfig)

    def attention_of(self, layer: int) -> AttentionConfig:
        """The attention config of self-attention block `layer` (its index among the stack's 'a' blocks)."""
        return self.attention if self.attention_layers is None else self.attention_layers[layer]

    @property
    def self_attention(self) -> tuple[AttentionConfig, ...]:
        """The self-attention blocks' configs: one per block with attn_per_layer, else the stack's own alone."""
        return self.attention_layers if self.attention_layers is not None else (self.attention,)

    @property
    def layout(self) -> tuple[str, ...]:
        """The block kinds in order: 'a' self-attention, 'c' cross-attention, 'f' feedforward."""
        if self.custom_layers is not None:
            return tuple(self.custom_layers)
        if self.mixer is not None:      # a mixer that is its own feedforward (FLASH's GAU) stands alone
            from .registry import MIXER

            if getattr(MIXER[self.mixer.name].build, "replaces_feedforward", False):
                return ("a",) * self.depth
        if self.only_cross:
            block: tuple[str, ...] = ("c", "f")
        elif self.cross_attend:
            block = ("a", "c", "f")
        else:
            block = ("a", "f")
        if self.macaron:
            block = ("f",) + block
        if self.par_ratio is not None:      # stack_policies.py; an invalid ratio is refused by name
            return par_layout(block, self.depth, self.par_ratio) or block * self.depth
        if self.sandwich_coef:
            s = self.sandwich_coef
            return ("a",) * s + block * (self.depth - s) + ("f",) * s
        return block * self.depth

    @property
    def layout_keyword(self) -> str:
        """The keyword that made `layout` what it is, for messages: "custom_layers", "gau=True", ..."""
        if self.custom_layers is not None:
            return "custom_layers"
        if self.mixer is not None and "f" not in self.layout:
            from .attention.kernels.direct import switch

            return f"{switch('mixer.', self.mixer.name)}=True"
        for name in ("only_cross", "cross_attend", "macaron"):
            if getattr(self, name):
                return f"{name}=True"
        return f"sandwich_coef={self.sandwich_coef}" if self.sandwich_coef else "the layout"


def stack_options(cls: type | None = None, prefix: str = "") -> dict[str, type]:
    """The options dataclass of every optional stack piece, by its config path ("act", "ff.moe",
    "knn_memory", ...): the fields typed `Options | None` of LayersConfig and of its sections."""
    found: dict[str, type] = {}
    for name, hint in typing.get_type_hints(cls or LayersConfig).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if dataclasses.is_dataclass(hint) and hint is not Choice:
            found |= stack_options(hint, f"{prefix}{name}.")      # a section (ff, attention)
        elif len(args) == 1 and dataclasses.is_dataclass(args[0]) and args[0] is not Choice:
            found[prefix + name] = args[0]
    return found


def to_dict(cfg: Any) -> dict:
    """A JSON-ready dict of a config (nested configs become nested dicts)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def from_dict(cls: type, data: dict) -> Any:
    """Rebuild a config of type `cls` from `to_dict` output; unknown fields fail by name."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {unknown}")
    kwargs = {}
    for name, value in data.items():
        if hints[name] is Choice and isinstance(value, str):    # saved before the kernel had options
            value = {"stage": name, "name": value}
        kwargs[name] = _revive(hints[name], value)
    return cls(**kwargs)


def _choice(data: dict) -> Choice:
    from .registry import entry      # the registry imports the stages, which import this module

    options = entry(data["stage"], data["name"]).options
    value = data.get("options")
    return Choice(data["stage"], data["name"], from_dict(options, value) if options and value is not None else value)


def _tuple(hint: Any, value: list) -> tuple:
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_revive(args[0], v) for v in value)
    return tuple(value)


def _revive(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    if hint is Choice:
        return _choice(value)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg is type(None):
                continue
            if arg is Choice and isinstance(value, dict):
                return _choice(value)
            if typing.get_origin(arg) is tuple and isinstance(value, list):
                return _tuple(arg, value)
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):
                return from_dict(arg, value)
        return value
    if origin is tuple and isinstance(value, list):
        return _tuple(hint, value)
    return value


def flatten(tree: dict, head: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested dicts (a config's, a run's settings) as dotted keys."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{head}{key}."))
        else:
            flat[f"{head}{key}"] = value
    return flat


def dumps(cfg: Any) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True)
