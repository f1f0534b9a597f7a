"""Images in, class logits out (arXiv:2010.11929)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import checks
from ..embedding import PatchEmbedding
from ..keywords import checked_keywords
from ..stack import AttentionLayers
from .sequence import _stack


class ViTransformerWrapper(nn.Module):
    """Images (b, channels, image_size, image_size) -> class logits (b, num_classes) from a class
    token, or the encoded patches (b, 1 + patches, dim) with `return_embeddings=True` or no head
    (arXiv:2010.11929). num_register_tokens: learned tokens that join the patches in the stack, without positions,
    and are dropped from its output (registers, arXiv:2309.16588).
    """

    @checked_keywords
    def __init__(self, *, image_size: int, patch_size: int, attn_layers: AttentionLayers,
                 num_classes: int | None = None, channels: int = 3, dropout: float = 0.0,
                 emb_dropout: float = 0.0, allow_nonfinite: bool = False, num_register_tokens: int = 0):
        super().__init__()
        stack = _stack(attn_layers, "ViTransformerWrapper")
        if patch_size < 1 or image_size % patch_size:
            raise ValueError(f"ViTransformerWrapper: patch_size ({patch_size}) must divide image_size ({image_size})")
        if stack.causal:
            raise ValueError("ViTransformerWrapper: attn_layers must be bidirectional (an Encoder), not a Decoder")
        if stack.has_cross:         # forward has no context to give them
            raise ValueError("ViTransformerWrapper: attn_layers must not have cross-attention blocks "
                             "(cross_attend / only_cross / custom_layers with 'c'): an image model has no context")
        dim = stack.dim
        self.image_size, self.channels = image_size, channels
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = PatchEmbedding(image_size, patch_size, channels, dim)
        self.pos_emb = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.dropout = nn.Dropout(emb_dropout)
        self.attn_layers = stack
        self.allow_nonfinite = allow_nonfinite
        checks.count(num_register_tokens, "ViTransformerWrapper: num_register_tokens", 0)
        self.register_tokens = nn.Parameter(torch.randn(num_register_tokens, dim) * 0.02) if num_register_tokens else None
        self.mlp_head = None
        if num_classes is not None:
            self.mlp_head = nn.Sequential(nn.Dropout(dropout), nn.Linear(stack.out_dim, num_classes))

    def forward(self, img: Tensor, return_embeddings: bool = False,
                return_logits_and_embeddings: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """img -> logits (b, num_classes), the embeddings (b, 1 + patches, dim), or with
        return_logits_and_embeddings both as a pair."""
        if return_logits_and_embeddings and (return_embeddings or self.mlp_head is None):
            raise ValueError("return_logits_and_embeddings needs num_classes and cannot combine with return_embeddings")
        checks.floats("img", img, 4, "(batch, channels, image_size, image_size)")
        expected = (self.channels, self.image_size, self.image_size)
        if tuple(img.shape[1:]) != expected:
            raise ValueError(f"img must have shape (batch, {', '.join(map(str, expected))}), got {tuple(img.shape)}")
        if not self.allow_nonfinite:
            checks.finite("img", img)
        x = self.patch_embed(img)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_emb
        x = self.dropout(x)
        if self.register_tokens is not None:          # registers after the patches, dropped after the stack
            x = torch.cat((x, self.register_tokens[None].expand(x.shape[0], -1, -1).to(x.dtype)), dim=1)
        x = self.attn_layers(x)
        if self.register_tokens is not None:
            x = x[:, :-self.register_tokens.shape[0]]
        if self.mlp_head is None or return_embeddings:
            return x
        logits = self.mlp_head(x[:, 0])
        return (logits, x) if return_logits_and_embeddings else logits
