"""Name -> entry, per stage: the only list of variants. An entry is the constructor, the options
class a `config.Choice` of it carries (None for variants without options), and the declared
capabilities. Configs hold the names; contract tests, the compatibility matrix, the fuzzer and the
arena enumerate these tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .attention.kernels import DIRECT_KERNELS
from .attention.kernels.dense import DenseKernel
from .attention.normalize import Entmax15, Softmax, TopK
from .attention.hard_attention import GumbelSoftmax, HardMax
from .attention.patterns import PIECES
from .feedforward import GeluTanh, ReluSquared
from .interfaces import Caps
from .mixers import MIXERS
from .norm import LayerNorm, RMSNorm, ScaleNorm, SimpleRMSNorm
from .conditioning import AdaptiveLayerNorm, AdaptiveRMSNorm
from .dyt import DynamicTanh
from .feedforward_norm import SoLU
from .position.bias import AlibiBias, T5Bias
from .position.cope import CopeOptions, CopeRelative
from .position.dynamic_bias import DynamicPositionBias
from .position.rotary import Rotary
from .position.rotary_scaling import SCALINGS
from .position.shaw import ShawOptions, ShawRelative
from .position.xl_relative import XLOptions, XLRelative
from .residual import Add, GRUGate, ReZero, ScaledAdd


@dataclass(frozen=True)
class Entry:
    build: Callable[..., Any] | None    # None: the stage is absent ("none")
    options: type | None = None         # the frozen dataclass a Choice of this entry carries
    caps: Caps | None = None


def _plain(table: dict[str, Any]) -> dict[str, Entry]:
    return {name: Entry(build) for name, build in table.items()}


NORM = _plain({"layer": LayerNorm, "rms": RMSNorm, "scale": ScaleNorm, "none": None,
               "dyt": DynamicTanh, "adaptive_layer": AdaptiveLayerNorm, "adaptive_rms": AdaptiveRMSNorm,
               "simple_rms": SimpleRMSNorm})     # use_simple_rmsnorm: no gain (norm.py)
RESIDUAL = _plain({"add": Add, "rezero": ReZero, "gru": GRUGate, "deepnorm": ScaledAdd})
ACTIVATION = _plain({"gelu": nn.GELU, "gelu_tanh": GeluTanh, "relu": nn.ReLU, "relu_squared": ReluSquared,
                     "swish": nn.SiLU, "solu": SoLU})   # SoLU: built with the hidden width (feedforward_norm.py)
NORMALIZE = _plain({"softmax": Softmax, "topk": TopK, "entmax15": Entmax15,
                    "hard": HardMax, "gumbel": GumbelSoftmax})     # attn_hard, attn_gumbel_softmax (hard_attention.py)
# "infused" acts on the projection inputs (see attention/projection.py), the others on q and k
POSITION = _plain({"none": None, "rotary": Rotary.from_config, "infused": None})   # built from (qk dim, AttentionConfig)
# how rotary positions stretch past the trained context (position/rotary_scaling.py): the Rotary builds them
ROTARY_SCALING = {name: Entry(s, s.options) for name, s in SCALINGS.items()}
SCORE_BIAS = _plain({"none": None, "t5": T5Bias, "alibi": AlibiBias, "dynamic": DynamicPositionBias})
# q-dependent relative position terms of the scores (position/relative.py): Shaw et al., Transformer-XL
RELATIVE = {"shaw": Entry(ShawRelative, ShawOptions), "xl": Entry(XLRelative, XLOptions),
            "cope": Entry(CopeRelative, CopeOptions)}     # CoPE's context-counted positions (position/cope.py)
# how queries meet keys: dense softmax attention (the reference), or a kernel of form "direct"
KERNEL = {"dense": Entry(DenseKernel.from_spec, caps=DenseKernel.caps),
          **{name: Entry(k, k.options, k.caps) for name, k in DIRECT_KERNELS.items()}}
# which keys each query sees (attention/patterns/): every piece is exact, its own rule
PATTERN = {name: Entry(piece.build, piece.options, piece.caps) for name, piece in PIECES.items()}

# what an 'a' block runs instead of attention (mixers/): built from (dim, LayersConfig, layer)
MIXER = {name: Entry(m, m.options, m.caps) for name, m in MIXERS.items()}

STAGES = {"norm": NORM, "residual": RESIDUAL, "activation": ACTIVATION, "normalize": NORMALIZE,
          "position": POSITION, "rotary_scaling": ROTARY_SCALING, "bias": SCORE_BIAS, "kernel": KERNEL,
          "pattern": PATTERN, "mixer": MIXER, "relative": RELATIVE}


def names(stage: str) -> list[str]:
    return sorted(STAGES[stage])


def entry(stage: str, name: str) -> Entry:
    from .keywords import closest

    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}{closest(stage, STAGES)}")
    table = STAGES[stage]
    if name not in table:
        raise ValueError(f"unknown {stage} {name!r}{closest(name, table)}")
    return table[name]
