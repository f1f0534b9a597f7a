"""Input stages: token, patch and continuous embeddings, extra embedding tables (token types),
absolute positions (learned, sinusoidal), and memory tokens (arXiv:2006.11527)."""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from . import checks
from .keywords import closest
from .position.axial import AxialPositions, axial_positions
from .position.sinusoidal import sinusoidal


class TokenEmbedding(nn.Embedding):
    def __init__(self, num_tokens: int, dim: int):
        super().__init__(num_tokens, dim)
        nn.init.normal_(self.weight, std=0.02)


class ExtraEmbeddings(nn.ModuleDict):
    """Extra tables summed with the token embedding, {name: vocabulary size}: BERT's token types
    (arXiv:1810.04805) are {"token_type": 2}. A table whose ids are not given adds its id 0 at every
    position (BERT's default segment)."""

    def __init__(self, num_tokens: dict[str, int], dim: int):
        if not isinstance(num_tokens, dict):
            raise TypeError(f"TransformerWrapper: embed_num_tokens must be a dict {{name: vocabulary size}}, "
                            f"got {type(num_tokens).__name__}")
        for name, n in num_tokens.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"TransformerWrapper: embed_num_tokens names must be identifiers, got {name!r}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"TransformerWrapper: embed_num_tokens[{name!r}] must be a positive integer, got {n!r}")
        super().__init__({name: TokenEmbedding(n, dim) for name, n in num_tokens.items()})

    def check(self, ids: object, x: Tensor) -> None:
        """`ids` must be {name: (b, n) ids} for names of these tables, in range, shaped like x."""
        if not isinstance(ids, dict):
            raise TypeError(f"embed_ids must be a dict {{name: (batch, seq) ids}}, got {type(ids).__name__}")
        names = list(self)
        for name, t in ids.items():
            if name not in names:
                raise ValueError(f"embed_ids has {name!r}, but the model's extra embeddings (embed_num_tokens) are "
                                 f"{names}" + closest(str(name), names))
            checks.token_ids(t, self[name].num_embeddings, f"embed_ids[{name!r}]")
            if t.shape != x.shape:
                raise ValueError(f"embed_ids[{name!r}] must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")

    def forward(self, h: Tensor, ids: dict[str, Tensor]) -> Tensor:
        for name, table in self.items():
            h = h + (table(ids[name]) if name in ids else table.weight[0].to(h.dtype))
        return h


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
        emb = sinusoidal(pos, self.dim, dtype=self.scale.dtype if self.scale is not None else torch.float32)
        return emb * self.scale if self.scale is not None else emb


def absolute_positions(owner: str, dim: int, max_seq_len: int, use_abs_pos_emb: bool | None,
                       scaled_sinu_pos_emb: bool, infused: bool, has_pos_emb: bool, axial: object = None,
                       axial_dims: object = None) -> nn.Module | None:
    """A wrapper's absolute positions from its keywords: learned, scaled sinusoids, axial or none (the
    default turns them off when the blocks carry positions themselves, `has_pos_emb`); clashes named."""
    if scaled_sinu_pos_emb and use_abs_pos_emb is False:
        raise ValueError(f"{owner}: scaled_sinu_pos_emb=True conflicts with use_abs_pos_emb=False")
    if infused and (use_abs_pos_emb or scaled_sinu_pos_emb):
        raise ValueError(f"{owner}: use_abs_pos_emb / scaled_sinu_pos_emb and position_infused_attn=True "
                         "are two absolute positional schemes; choose one")
    if axial is not None or axial_dims is not None:
        conflicts = [name for name, on in (("use_abs_pos_emb", use_abs_pos_emb is not None),
                                           ("scaled_sinu_pos_emb", scaled_sinu_pos_emb),
                                           ("position_infused_attn", infused)) if on]
        return axial_positions(owner, dim, max_seq_len, axial, axial_dims, conflicts)
    if use_abs_pos_emb is None:
        use_abs_pos_emb = not has_pos_emb
    if scaled_sinu_pos_emb:
        return SinusoidalPositions(dim, scaled=True)
    return LearnedPositions(max_seq_len, dim) if use_abs_pos_emb else None


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
