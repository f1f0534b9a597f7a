"""`XTransformer`: an encoder `TransformerWrapper` and a cross-attending decoder, trained with the
decoder's next-token loss. Keywords take `enc_` / `dec_` prefixes."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import deepnet
from .generate.decode import AutoregressiveWrapper
from .keywords import KEYWORDS, closest
from .losses import AuxLosses, forward_with_losses, with_aux
from .stack import Decoder, Encoder
from .wrappers import TransformerWrapper

WRAPPER_KEYWORDS = tuple(name for name in inspect.signature(TransformerWrapper.__init__).parameters
                         if name not in ("self", "attn_layers"))     # every wrapper keyword, on either side
OWN_KEYWORDS = ("dim", "tie_token_emb", "ignore_index", "pad_value")


def _split(prefix: str, keywords: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    wrapper, layers = {}, {}
    for name, value in keywords.items():
        key = name[len(prefix):]
        if key in WRAPPER_KEYWORDS:
            wrapper[key] = value
        else:
            layers[key] = value
    return wrapper, layers


def _valid_names() -> list[str]:
    inner = list(WRAPPER_KEYWORDS) + [k for k in KEYWORDS if k != "dim"]
    return list(OWN_KEYWORDS) + [p + k for p in ("enc_", "dec_") for k in inner]


class XTransformer(nn.Module):
    """Encoder-decoder. forward(src (b, n), tgt (b, m), mask, attn_mask, src_prepend_embeds, src_mask=,
    tgt_mask=) -> the decoder's next-token loss on tgt, attending to the encoded src.

    Args:
        dim: model width of both stacks.
        tie_token_emb: encoder and decoder share one token embedding (needs equal num_tokens).
        enc_* / dec_*: any `TransformerWrapper` or layer keyword, for that side
            (e.g. enc_num_tokens, enc_depth, enc_heads, dec_cross_residual_attn). enc_deepnorm and
            dec_deepnorm go together: each stack gets deepnorm_depths = (N, M) (deepnet.py).
    """

    def __init__(self, *, dim: int, tie_token_emb: bool = False, ignore_index: int = -100,
                 pad_value: int = 0, **keywords: Any):
        super().__init__()
        valid = _valid_names()
        for name in keywords:
            inner = name[4:]
            if not name.startswith(("enc_", "dec_")) or (inner not in WRAPPER_KEYWORDS and inner not in KEYWORDS) \
                    or inner == "dim":
                raise TypeError(f"XTransformer got an unknown keyword {name!r}{closest(name, valid)}")
        enc_wrap, enc_layers = _split("enc_", {k: v for k, v in keywords.items() if k.startswith("enc_")})
        dec_wrap, dec_layers = _split("dec_", {k: v for k, v in keywords.items() if k.startswith("dec_")})
        for side, wrap in (("enc", enc_wrap), ("dec", dec_wrap)):
            for needed in ("num_tokens", "max_seq_len"):
                if needed not in wrap:
                    raise TypeError(f"XTransformer needs {side}_{needed}")
        if "cross_attend" in dec_layers:
            raise TypeError("XTransformer sets dec_cross_attend=True itself")
        for side, layers in (("enc", enc_layers), ("dec", dec_layers)):
            if "deepnorm_depths" in layers:
                raise TypeError(f"XTransformer sets {side}_deepnorm_depths itself (from the two stacks' depths)")
        if enc_layers.get("deepnorm") or dec_layers.get("deepnorm"):     # DeepNet's alpha / beta need both depths
            depths = deepnet.pair_depths(dim, enc_layers, dec_layers)
            enc_layers, dec_layers = ({**layers, "deepnorm_depths": depths} for layers in (enc_layers, dec_layers))
        if dec_layers.get("dim_context") not in (None, dim):     # the context is the encoder's output
            raise ValueError(f"XTransformer: dec_dim_context ({dec_layers['dim_context']}) must equal dim ({dim}): "
                             "the decoder attends to the encoder's output")
        if tie_token_emb and enc_wrap["num_tokens"] != dec_wrap["num_tokens"]:
            raise ValueError(f"tie_token_emb=True needs enc_num_tokens == dec_num_tokens, got "
                             f"{enc_wrap['num_tokens']} and {dec_wrap['num_tokens']}")
        self.encoder = TransformerWrapper(**{"return_only_embed": True, **enc_wrap},    # its output is the context
                                          attn_layers=Encoder(dim=dim, **enc_layers))
        if self.encoder.attn_layers.out_dim != dim:      # reversible_merge="concat": 2 dim features
            raise ValueError(f"XTransformer: enc_reversible_merge='concat' makes the encoder's output "
                             f"{self.encoder.attn_layers.out_dim} features wide; the decoder attends to dim ({dim})")
        decoder = TransformerWrapper(**dec_wrap, attn_layers=Decoder(dim=dim, cross_attend=True, **dec_layers))
        if tie_token_emb:
            decoder.token_emb = self.encoder.token_emb
        self.decoder = AutoregressiveWrapper(decoder, ignore_index=ignore_index, pad_value=pad_value)
        self.init_args = dict(dim=dim, tie_token_emb=tie_token_emb, ignore_index=ignore_index,
                              pad_value=pad_value, **keywords)

    def forward(self, src: Tensor, tgt: Tensor, mask: Tensor | None = None, attn_mask: Tensor | None = None,
                src_prepend_embeds: Tensor | None = None, *, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, return_losses: bool = False) -> Tensor | tuple[Tensor, AuxLosses]:
        """The decoder's next-token loss on tgt plus both stacks' weighted auxiliary losses; with
        `return_losses`, (that loss, the merged `AuxLosses`).

        Args:
            src: (b, n) source ids; tgt: (b, m) target ids.
            mask / src_mask (one or the other): (b, n) bool source padding, True = keep.
            attn_mask: (n, n), (h, n, n) or (b, h, n, n) bool, the encoder's (query, key) mask.
            src_prepend_embeds: (b, p, dim) vectors the encoder reads before src (`prepend_embeds`); the
                decoder attends to them too.
            tgt_mask: (b, m) bool target padding.
        """
        src_mask = _source_mask(mask, src_mask)
        encoded, aux = self.encode(src, src_mask, attn_mask, src_prepend_embeds)
        if src_prepend_embeds is not None and src_mask is not None:     # the prepended vectors stay visible
            src_mask = F.pad(src_mask, (src_prepend_embeds.shape[1], 0), value=True)
        loss, decoder_aux = self.decoder(tgt, mask=tgt_mask, context=encoded, context_mask=src_mask,
                                         return_losses=True)
        loss = with_aux(loss, aux)
        aux.merge(decoder_aux)
        return (loss, aux) if return_losses else loss

    def encode(self, src: Tensor, src_mask: Tensor | None = None, attn_mask: Tensor | None = None,
               prepend_embeds: Tensor | None = None) -> tuple[Tensor, AuxLosses]:
        """(the encoder's output (b, p + n, dim), its auxiliary losses)."""
        extra = {} if prepend_embeds is None else {"prepend_embeds": prepend_embeds}
        return forward_with_losses(self.encoder, src, mask=src_mask, attn_mask=attn_mask, return_embeddings=True,
                                   **extra)

    @torch.no_grad()
    def generate(self, seq_in: Tensor, seq_out_start: Tensor, seq_len: int, mask: Tensor | None = None,
                 attn_mask: Tensor | None = None, *, src_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        """Encode seq_in once (with `mask` / `src_mask` and `attn_mask` as in forward), then sample seq_len
        decoder tokens after seq_out_start (`AutoregressiveWrapper.generate`'s keywords)."""
        src_mask = _source_mask(mask, src_mask)
        encoded = self.encoder(seq_in, mask=src_mask, attn_mask=attn_mask, return_embeddings=True)
        return self.decoder.generate(seq_out_start, seq_len, context=encoded, context_mask=src_mask, **kwargs)


def _source_mask(mask: Tensor | None, src_mask: Tensor | None) -> Tensor | None:
    """x-transformers' `mask` and polyformer's `src_mask` are one argument under two names."""
    if mask is not None and src_mask is not None:
        raise TypeError("XTransformer: give the source mask once, as mask= or as src_mask=, not both")
    return mask if mask is not None else src_mask
