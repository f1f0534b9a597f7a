"""Nyströmformer (arXiv:2102.03902) as `NystromformerModel`: BERT's post-norm encoder and links (bert.py)
with Nyström attention (`attn_nystrom_*`), positions from row 2 of the table, and the values' depthwise
convolution (`conv_kernel_size`, `attention.self.conv`). It scales q and k by d^-1/4 each, which is our
q·k / √d (the landmarks are means, linear in q and k).

Hugging Face's model, measured on transformers 5.23:
- it approximates only at one length, `segment_means_seq_len` (num_landmarks segments of equal size),
  and a padding mask crashes there; polyformer takes any length (kernels/nystrom.py's segments) and
  padding; the converted model equals Hugging Face's at that length;
- with num_landmarks == segment_means_seq_len it computes exact softmax attention at every length: the
  converted model takes max_position_embeddings landmarks, which is exact softmax at every length it
  accepts (every key is its own landmark);
- its pseudo-inverse starts from the batch's largest ‖A‖₁ (`inv_coeff_init_option=False`), so a sample's
  output depends on its batch-mates: converted as attn_nystrom_pinv_init="batch" (polyformer's default
  is "row", each sample on its own); `inv_coeff_init_option=True` (per sample and head: "row") fails
  in its forward, and `to_hf` writes only "batch";
- its convolution reads padded positions' values (polyformer zeroes them first), and an even
  conv_kernel_size gives one position too many: refused.
"""

from __future__ import annotations

from typing import Any

from ..stack import Encoder
from ..wrappers import TransformerWrapper
from . import bert
from .bert import encoder_keywords
from .family import Family, Link, Unsupported, layer_names

FIRST = 2               # the position table row of the first token
PINV_ITERS = 6          # Hugging Face's fixed iteration count

DEFAULTS = {"vocab_size": 30000, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "intermediate_size": 3072, "hidden_act": "gelu_new", "max_position_embeddings": 510,
            "type_vocab_size": 2, "segment_means_seq_len": 64, "num_landmarks": 64, "conv_kernel_size": 65,
            "inv_coeff_init_option": False, "layer_norm_eps": 1e-5, "add_cross_attention": False}


def landmarks(c: dict[str, Any]) -> int:
    """Our attn_nystrom_landmarks: Hugging Face's num_landmarks, or, where it computes exact softmax at
    every length (num_landmarks == segment_means_seq_len), one per position it accepts."""
    m = int(c["num_landmarks"])
    return max(m, int(c["max_position_embeddings"])) if m == c["segment_means_seq_len"] else m


def build(c: dict[str, Any]) -> tuple[type, dict[str, Any], dict[str, Any]]:
    if c["add_cross_attention"]:
        raise Unsupported("nystromformer: add_cross_attention is not supported")
    size = c["conv_kernel_size"]
    if size is not None and (not isinstance(size, int) or size < 1 or size % 2 == 0):
        raise Unsupported(f"nystromformer: conv_kernel_size must be None or odd (an even one gives one position "
                          f"too many, and Hugging Face's forward fails), got {size!r}")
    layers, wrap = encoder_keywords({**c, "max_position_embeddings": c["max_position_embeddings"] + FIRST},
                                    "nystromformer", FIRST)
    layers.update(attn_nystrom_landmarks=landmarks(c), attn_nystrom_pinv_iters=PINV_ITERS,
                  attn_nystrom_pinv_init="row" if c["inv_coeff_init_option"] else "batch",
                  attn_nystrom_conv=size or 0)
    return Encoder, layers, wrap


def links(c: dict[str, Any]) -> list[Link]:
    out = bert.links(c, FIRST)
    if c["conv_kernel_size"]:
        out += [Link(f"{a}.branch.kernel.conv", (f"{h}.attention.self.conv.weight",))
                for a, _, h in layer_names(c["num_hidden_layers"], "encoder.layer")]
    return out


def config_of(model: TransformerWrapper) -> dict[str, Any]:
    """The model's Hugging Face config. Not every model has one: `differences` then names what differs
    (another kernel, pinv_init="row", other pseudo-inverse iterations, ...)."""
    kernel = model.attn_layers.cfg.attention.kernel
    n = model.max_seq_len
    c = {**bert.config_of(model), "max_position_embeddings": n, "inv_coeff_init_option": False}
    if kernel.name != "nystrom":
        return {**c, **{k: DEFAULTS[k] for k in ("num_landmarks", "segment_means_seq_len", "conv_kernel_size")}}
    m, size = kernel.options.landmarks, kernel.options.conv
    # at m >= n every input is exact softmax, as Hugging Face's num_landmarks == segment_means_seq_len;
    # else the longest length it can run: a multiple of m
    return {**c, "num_landmarks": m, "segment_means_seq_len": m if m >= n else n // m * m,
            "conv_kernel_size": size or None}


NYSTROMFORMER = Family(
    model_type="nystromformer", classes={"NystromformerModel": ""}, defaults=DEFAULTS,
    derived=(r"embeddings\.(position_ids|token_type_ids)",), build=build, links=links, config_of=config_of,
    embedding="embeddings.word_embeddings.weight", base_model="nystromformer")
