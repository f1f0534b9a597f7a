"""Tiny randomly initialised Hugging Face models of every supported family, in several shapes, with
weights spread out (normal, not the 0.02 init) so that a wrong mapping cannot hide in tiny numbers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

NO_SPECIALS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

GPT2_SHAPES = {
    "heads3_tied": dict(vocab_size=64, n_positions=32, n_embd=12, n_layer=2, n_head=3),
    "heads5_untied_exact_gelu": dict(vocab_size=61, n_positions=24, n_embd=20, n_layer=2, n_head=5, n_inner=36,
                                     activation_function="gelu", tie_word_embeddings=False),
    "one_head_eps": dict(vocab_size=40, n_positions=16, n_embd=8, n_layer=3, n_head=1, layer_norm_epsilon=1e-3,
                         activation_function="gelu_pytorch_tanh"),
}
BERT_SHAPES = {
    "heads3": dict(vocab_size=64, hidden_size=12, num_hidden_layers=2, num_attention_heads=3, intermediate_size=20,
                   max_position_embeddings=32),
    "heads5_types3": dict(vocab_size=50, hidden_size=20, num_hidden_layers=2, num_attention_heads=5, intermediate_size=44,
                          max_position_embeddings=24, type_vocab_size=3, layer_norm_eps=1e-5),
    "one_head_tanh_gelu": dict(vocab_size=40, hidden_size=8, num_hidden_layers=3, num_attention_heads=1,
                               intermediate_size=16, max_position_embeddings=16, hidden_act="gelu_new"),
}
LLAMA_SHAPES = {
    "plain_untied": dict(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4),
    "gqa_tied_theta": dict(vocab_size=64, hidden_size=24, intermediate_size=44, num_hidden_layers=2, num_attention_heads=6,
                           num_key_value_heads=2, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "mqa_heads5": dict(vocab_size=48, hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=5,
                       num_key_value_heads=1, rms_norm_eps=1e-5),
    "heads3_head_dim4_biases": dict(vocab_size=32, hidden_size=18, intermediate_size=24, num_hidden_layers=2,
                                    num_attention_heads=3, num_key_value_heads=3, head_dim=4, attention_bias=True,
                                    mlp_bias=True),
    # scaled rotary: wavelengths of head_dim 16 straddle both Llama 3 bands (16 and 64 positions)
    "llama3_rope": dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}),
    "linear_rope": dict(vocab_size=40, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, rope_parameters={"rope_type": "linear", "rope_theta": 1000.0,
                                                                 "factor": 2.5}),
}


def spread(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Norm weights 1 + N(0, 0.1), biases N(0, 0.1), matrices N(0, 0.3); eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                is_norm_weight = name.endswith("weight") and any(k in name.lower() for k in ("norm", "ln_"))
                p.copy_((1.0 if is_norm_weight else 0.0) + 0.1 * noise)
            else:
                p.copy_(0.3 * noise)
    return model.eval()


def gpt2(shape: str = "heads3_tied", seed: int = 0, **extra: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**GPT2_SHAPES[shape], **NO_SPECIALS, **extra)
    return spread(transformers.GPT2LMHeadModel(config), seed)


def bert(shape: str = "heads3", seed: int = 0, pooler: bool = False, **extra: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(**BERT_SHAPES[shape], **extra)
    return spread(transformers.BertModel(config, add_pooling_layer=pooler), seed)


def llama(shape: str = "plain_untied", seed: int = 0, **extra: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**LLAMA_SHAPES[shape], **NO_SPECIALS, **extra)
    return spread(transformers.LlamaForCausalLM(config), seed)


def ids(vocab: int, b: int = 3, n: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def left_padding(b: int = 3, n: int = 9) -> torch.Tensor:
    """Row r keeps its last n - 2r positions (row 0 unpadded)."""
    mask = torch.ones(b, n, dtype=torch.bool)
    for r in range(b):
        mask[r, : 2 * r] = False
    return mask


def right_padding(b: int = 3, n: int = 9) -> torch.Tensor:
    return left_padding(b, n).flip(-1)


# ---- encoder-decoders (T5, Switch Transformers) ----------------------------------------------------

def seq2seq(config: Any, cls: str, seed: int = 0, untie: bool = False) -> torch.nn.Module:
    """A tiny T5-shaped transformers model (`cls` of `config`: T5, Switch) with transformers' own
    initialisation (unit-variance activations, queries d_kv ** -0.5 smaller, so scores stay
    well-conditioned in float32), norm weights spread around 1, the shared embedding 0.2 times its size
    (else it dominates the stream and a tied head echoes its input) and, `untie`, a head of its own."""
    torch.manual_seed(seed)
    hf = getattr(transformers, cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        hf.shared.weight.mul_(0.2)
    if untie and hasattr(hf, "lm_head"):     # a Parameter of its own: transformers 5.x ties T5's head to `shared`
        head = torch.randn(hf.lm_head.weight.shape, generator=g) * config.d_model ** -0.5
        hf.lm_head.weight = torch.nn.Parameter(head)
    return hf


def source(vocab: int, b: int = 3, n: int = 11, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder ids and their mask: row 0 whole, row 1 right-padded, row 2 left-padded."""
    x = torch.randint(1, vocab, (b, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, n - 4:] = False
    mask[2, :3] = False
    return x, mask


def target(vocab: int, b: int = 3, n: int = 7, seed: int = 2) -> torch.Tensor:
    """Decoder ids."""
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def seq2seq_logits(model: Any, src: torch.Tensor, mask: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """An XTransformer's logits of `tgt` given the masked source, as transformers computes them."""
    encoded = model.encoder(src, mask=mask, return_embeddings=True)
    return model.decoder.net(tgt, context=encoded, context_mask=mask)


def hf_seq2seq_logits(hf: torch.nn.Module, src: torch.Tensor, mask: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt).logits


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()
