"""FNet (Lee-Thorp et al. 2021, arXiv:2105.03824): the real part of a 2D discrete Fourier transform,
along the sequence and along the features, replaces self-attention. No parameters; every position
sees every other one, so it runs in an Encoder only.

Padding: padded positions are zeroed before the transform, so a padded token's content never reaches
a kept position; the transform's length is still the padded length n (Hugging Face's FNet takes no
mask at all, so there padding changes every output)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import LayersConfig
from ..interfaces import AttnOut, Caps, Context
from ..precision import upcast

# attention fields a mixer's block would silently ignore (the others are refused in attention/kernels/direct.py);
# cross-attention blocks read all but the positional ones
_POSITIONAL = ("position", "rotary_dim", "rotary_base", "rotary_interleaved", "rotary_interpolation", "rotary_llama3")
_UNUSED = _POSITIONAL + ("num_mem_kv", "kv_heads", "dropout", "alibi_num_heads", "rel_pos_num_buckets",
                         "rel_pos_max_distance", "collab_heads", "collab_compression", "on_attn", "gate_values",
                         "qkv_bias", "out_bias")


def fourier_mix(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Re(DFT_seq(DFT_features(x))) of x (b, n, dim) -> (b, n, dim), positions where mask (b, n) is
    False zeroed first. Computed in float32 at least (torch.fft takes no bfloat16 on CPU), cast back."""
    h = upcast(x)
    if mask is not None:
        h = h.masked_fill(~mask[..., None], 0.0)
    return torch.fft.fft2(h).real.to(x.dtype)


class FNet(nn.Module):
    """The Fourier mixing sublayer: y = Re(FFT2(x)) over (sequence, features)."""

    options = None
    caps = Caps(exact=True, bias=False, causal=False, padding=True, decode="none", form="direct", memories=False)

    def __init__(self, dim: int, cfg: LayersConfig, layer: int = 0):
        super().__init__()
        self.dim = dim
        self.layer = layer

    @staticmethod
    def check(options: None, cfg: LayersConfig) -> list[str]:
        """Attention keywords FNet would ignore (unless cross-attention blocks use them)."""
        from ..attention.kernels.direct import changed

        cross = "c" in cfg.layout
        names = changed("attention", cfg.attention, _POSITIONAL if cross else _UNUSED)
        if not names:
            return []
        return [f"attn_fnet has no queries, keys or values: {' / '.join(names)} would do nothing with it"
                + (" (cross-attention reads no positions)" if cross else "")]

    @property
    def decode_kind(self) -> str:
        return "none"

    def forward(self, x: Tensor, ctx: Context, prev_scores: Tensor | None = None) -> AttnOut:
        """x (b, n, dim) -> AttnOut(out=(b, n, dim))."""
        if ctx.need_weights:
            raise ValueError("return_attn=True: attn_fnet forms no attention weights to return")
        if ctx.mems is not None:
            raise ValueError("attn_fnet mixes the segment only: it cannot take XL memories (mems)")
        return AttnOut(fourier_mix(x, ctx.mask))

