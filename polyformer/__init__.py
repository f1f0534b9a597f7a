"""polyformer: one PyTorch library for the transformer family."""

from .build import build_model, model_config
from .config import AttentionConfig, FeedForwardConfig, LayersConfig
from .encoder_decoder import XTransformer
from .generate.decode import AutoregressiveWrapper
from .stack import AttentionLayers, CrossAttender, Decoder, Encoder, Intermediates
from .wrappers import ContinuousTransformerWrapper, TransformerWrapper, ViTransformerWrapper

__all__ = [
    "AttentionConfig", "AttentionLayers", "AutoregressiveWrapper", "ContinuousTransformerWrapper",
    "CrossAttender", "Decoder", "Encoder", "FeedForwardConfig", "Intermediates", "LayersConfig",
    "TransformerWrapper", "ViTransformerWrapper", "XTransformer", "build_model", "model_config",
]
__version__ = "0.1.0"
