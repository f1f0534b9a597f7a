"""Input stages: token, patch and continuous embeddings, absolute positions (learned,
sinusoidal), and memory tokens (arXiv:2006.11527)."""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from .position.sinusoidal import sinusoidal


class TokenEmbedding(nn.Embedding):
    def __init__(self, num_tokens: int, dim: int):
        super().__init__(num_tokens, dim)
        nn.init.normal_(self.weight, std=0.02)


class LearnedPositions(nn.Module):
    """One learned vector per absolute position in [0, max_seq_len)."""

    def __init__(self, max_seq_len: int, dim: int):
        super().__init__()
        self.emb = nn.Embedding(max_seq_len, dim)
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, pos: Tensor) -> Tensor:
        return self.emb(pos)                       # (b|1, n, dim)


class SinusoidalPositions(nn.Module):
    """Fixed sinusoids (arXiv:1706.03762); `scaled` multiplies them by one learned scalar, dim^-0.5 at init."""

    def __init__(self, dim: int, scaled: bool = False):
        super().__init__()
        self.dim = dim
        self.scale = nn.Parameter(torch.tensor(dim ** -0.5)) if scaled else None

    def forward(self, pos: Tensor) -> Tensor:
        emb = sinusoidal(pos, self.dim)
        return emb * self.scale if self.scale is not None else emb


class MemoryTokens(nn.Module):
    """`num` learned tokens placed before the sequence; they pass through every layer and are
    dropped from the output."""

    def __init__(self, num: int, dim: int):
        super().__init__()
        self.tokens = nn.Parameter(torch.randn(num, dim) * 0.02)

    def forward(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        b, num = x.shape[0], self.tokens.shape[0]
        x = torch.cat((self.tokens.to(x.dtype).expand(b, -1, -1), x), dim=1)
        if mask is not None:
            mask = torch.cat((mask.new_ones(b, num), mask), dim=1)
        return x, mask


class PatchEmbedding(nn.Module):
    """Cuts (b, c, H, W) images into p x p patches and projects each to `dim` (ViT, arXiv:2010.11929)."""

    def __init__(self, image_size: int, patch_size: int, channels: int, dim: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Linear(channels * patch_size ** 2, dim)

    def forward(self, img: Tensor) -> Tensor:
        p = self.patch_size
        patches = rearrange(img, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=p, p2=p)
        return self.proj(patches)
