"""Name -> constructor, per stage. Configs hold the names; these tables resolve them."""

from __future__ import annotations

from torch import nn

from .attention.kernels.dense import DenseKernel
from .attention.normalize import Entmax15, Softmax, TopK
from .feedforward import GeluTanh, ReluSquared
from .norm import LayerNorm, RMSNorm, ScaleNorm
from .position.bias import AlibiBias, T5Bias
from .position.rotary import Rotary
from .residual import Add, GRUGate, ReZero

NORM = {"layer": LayerNorm, "rms": RMSNorm, "scale": ScaleNorm, "none": None}
RESIDUAL = {"add": Add, "rezero": ReZero, "gru": GRUGate}
ACTIVATION = {"gelu": nn.GELU, "gelu_tanh": GeluTanh, "relu": nn.ReLU, "relu_squared": ReluSquared,
              "swish": nn.SiLU}
NORMALIZE = {"softmax": Softmax, "topk": TopK, "entmax15": Entmax15}
# "infused" acts on the projection inputs (see attention/projection.py), the others on q and k
POSITION = {"none": None, "rotary": Rotary, "infused": None}
SCORE_BIAS = {"none": None, "t5": T5Bias, "alibi": AlibiBias}
KERNEL = {"dense": DenseKernel}


def names(stage: str) -> list[str]:
    table = {"norm": NORM, "residual": RESIDUAL, "activation": ACTIVATION, "normalize": NORMALIZE,
             "position": POSITION, "bias": SCORE_BIAS, "kernel": KERNEL}[stage]
    return sorted(table)
