"""polyformer: one PyTorch library for the transformer family."""

from .build import build_model, model_config
from .config import AttentionConfig, FeedForwardConfig, LayersConfig
from .dpo import DPO
from .encoder_decoder import XTransformer
from .generate.continuous import ContinuousAutoregressiveWrapper
from .generate.beam import BeamResult, beam_search
from .generate.decode import AutoregressiveWrapper
from .generate.maskgit import NonAutoregressiveWrapper
from .generate.prompt_cache import load_prompt_cache, next_token_logits, save_prompt_cache
from .generate.sampling import min_p, top_a, top_k, top_p
from .generate.speculative import SpeculativeResult, speculative_generate
from .generate.xl import XLAutoregressiveWrapper
from .generate.xval import XValAutoregressiveWrapper
from .layout import input_major
from .quantize import Int8Linear, quantize_int8
from .stack import AttentionLayers, CrossAttender, Decoder, Encoder, Intermediates
from .wrappers import ContinuousTransformerWrapper, TransformerWrapper, ViTransformerWrapper
from .xval import XValTransformerWrapper

__all__ = [
    "AttentionConfig", "AttentionLayers", "AutoregressiveWrapper", "ContinuousAutoregressiveWrapper",
    "ContinuousTransformerWrapper", "XLAutoregressiveWrapper", "min_p", "top_a", "top_k", "top_p",
    "BeamResult", "SpeculativeResult", "beam_search", "speculative_generate", "load_prompt_cache",
    "next_token_logits", "save_prompt_cache",
    "CrossAttender", "Decoder", "Encoder", "FeedForwardConfig", "Intermediates", "LayersConfig",
    "Int8Linear", "quantize_int8", "input_major",
    "TransformerWrapper", "ViTransformerWrapper", "XTransformer", "build_model", "model_config",
    "NonAutoregressiveWrapper", "DPO",
    "XValTransformerWrapper", "XValAutoregressiveWrapper",
]
__version__ = "0.1.0"
