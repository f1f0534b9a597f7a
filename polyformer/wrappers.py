"""Wrappers around a layer stack: tokens (`TransformerWrapper`), vectors
(`ContinuousTransformerWrapper`) and images (`ViTransformerWrapper`); each lives in polyformer/wrap/."""

from .wrap.continuous import ContinuousTransformerWrapper
from .wrap.sequence import SequenceWrapper, _stack
from .wrap.tokens import TransformerWrapper
from .wrap.vit import ViTransformerWrapper

__all__ = ["SequenceWrapper", "TransformerWrapper", "ContinuousTransformerWrapper", "ViTransformerWrapper", "_stack"]
