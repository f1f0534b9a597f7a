"""What a sequence wrapper does to its input before the stack, beyond embedding and positions: l2-normalised
token and position embeddings (fixnorm), a reduced gradient into the embedding, embeddings summed in from
outside, front tokens (class tokens, prepended embeddings) and left padding given as start positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks
from ..embedding import LearnedPositions, TokenEmbedding


class L2NormTokenEmbedding(TokenEmbedding):
    """Token embeddings scaled to unit l2 norm (fixnorm, arXiv:1710.01329), from a small init (std 1e-5)."""

    def __init__(self, num_tokens: int, dim: int):
        super().__init__(num_tokens, dim)
        nn.init.normal_(self.weight, std=1e-5)

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(super().forward(x), dim=-1)


class L2NormLearnedPositions(LearnedPositions):
    """Learned absolute positions scaled to unit l2 norm, from a small init (std 1e-5), as the tokens."""

    def __init__(self, max_seq_len: int, dim: int):
        super().__init__(max_seq_len, dim)
        nn.init.normal_(self.emb.weight, std=1e-5)

    def forward(self, pos: Tensor) -> Tensor:
        return F.normalize(super().forward(pos), dim=-1)


def l2norm_positions(pos_emb: nn.Module | None) -> nn.Module | None:
    """The l2-normalised counterpart of learned positions (other kinds are kept as they are)."""
    if type(pos_emb) is LearnedPositions:
        return L2NormLearnedPositions(*pos_emb.emb.weight.shape)
    return pos_emb


def check_fraction(owner: str, emb_frac_gradient: object) -> float:
    if isinstance(emb_frac_gradient, bool) or not isinstance(emb_frac_gradient, (int, float)) \
            or not 0 < emb_frac_gradient <= 1:
        raise ValueError(f"{owner}: emb_frac_gradient must be a number in (0, 1], got {emb_frac_gradient!r}")
    return float(emb_frac_gradient)


def shrink_gradient(h: Tensor, fraction: float) -> Tensor:
    """h unchanged in value; only `fraction` of the gradient flows back through it (CogView,
    arXiv:2105.13290; GLM-130B uses 0.1)."""
    if fraction == 1.0:
        return h
    frozen = h.detach()
    return frozen + (h - frozen) * fraction          # exactly h in value


def summed(h: Tensor, sum_embeds: Tensor | None) -> Tensor:
    """h (b, n, d) plus embeddings given from outside (b, n, d) (e.g. self-conditioning)."""
    if sum_embeds is None:
        return h
    sum_embeds = checks.tensor("sum_embeds", sum_embeds)
    if sum_embeds.shape != h.shape:
        raise ValueError(f"sum_embeds must have the embedding's shape {tuple(h.shape)}, got {tuple(sum_embeds.shape)}")
    return h + sum_embeds


def left_padding(seq_start_pos: Tensor | None, mask: Tensor | None, pos: Tensor | None, b: int, n: int,
                 device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """seq_start_pos (b,): each row's first real token of a left-padded batch -> (mask that drops the
    padding, positions counted from each row's start), combined with a given mask; a given pos stays."""
    if seq_start_pos is None:
        return mask, pos
    start = checks.tensor("seq_start_pos", seq_start_pos)
    if start.shape != (b,) or start.dtype.is_floating_point or start.dtype == torch.bool:
        raise ValueError(f"seq_start_pos must hold {b} integer start positions (batch,), got "
                         f"{tuple(start.shape)} {start.dtype}")
    steps = torch.arange(n, device=device)[None]
    keep = steps >= start.to(device)[:, None]                          # (b, n)
    mask = keep if mask is None else mask & keep
    if pos is None:
        pos = (steps - start.to(device)[:, None]).clamp(min=0)
    return mask, pos


@dataclass
class Front:
    """Embeddings placed before the text: `h` (b, p, dim), `mask` (b, p) or None; the first `cls` of them are
    class tokens, taken out as the output."""

    h: Tensor
    mask: Tensor | None
    cls: int = 0


def front(cls_tokens: Tensor | None, prepend_embeds: Tensor | None, prepend_mask: Tensor | None,
          b: int, dim: int) -> Front | None:
    """Class tokens (k, dim), then embeddings given to the forward (b, p, dim) with their mask (b, p)."""
    if prepend_mask is not None and prepend_embeds is None:
        raise ValueError("prepend_mask was given without prepend_embeds")
    parts, masks, cls = [], [], 0
    if cls_tokens is not None:
        cls = cls_tokens.shape[0]
        parts.append(cls_tokens[None].expand(b, -1, -1))
        masks.append(None)
    if prepend_embeds is not None:
        checks.floats("prepend_embeds", prepend_embeds, 3, "(batch, prepended, dim)")
        if prepend_embeds.shape[0] != b or prepend_embeds.shape[2] != dim:
            raise ValueError(f"prepend_embeds must have shape ({b}, prepended, {dim}), got {tuple(prepend_embeds.shape)}")
        if prepend_mask is not None:
            checks.bool_mask("prepend_mask", prepend_mask, tuple(prepend_embeds.shape[:2]), "(batch, prepended)")
        parts.append(prepend_embeds)
        masks.append(prepend_mask)
    if not parts:
        return None
    h = torch.cat([p.to(parts[-1].dtype) for p in parts], dim=1)
    mask = None
    if any(m is not None for m in masks):
        mask = torch.cat([m if m is not None else torch.ones(p.shape[:2], dtype=torch.bool, device=h.device)
                          for p, m in zip(parts, masks)], dim=1)
    return Front(h, mask, cls)


def fronted(front: Front, h: Tensor, mask: Tensor | None, tok_pos: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
    """The front embeddings before the text h (b, n, dim): (b, p + n, dim), the joined mask, and the positions
    (b|1, p + n): the front at 0 .. p - 1, the text's tok_pos moved up by p."""
    p = front.h.shape[1]
    mask = joined_mask(front, mask, h.shape[0], h.shape[1], h.device)
    first = torch.arange(p, device=h.device)[None].expand(tok_pos.shape[0], -1)
    return torch.cat((front.h.to(h.dtype), h), dim=1), mask, torch.cat((first, tok_pos + p), dim=1)


def class_tokens(owner: str, use_cls_token: object, num_cls_tokens: object, dim: int) -> nn.Parameter | None:
    """Learned class tokens (num_cls_tokens, dim) placed in front of every sequence (BERT's [CLS]), or None."""
    if not isinstance(use_cls_token, bool):
        raise TypeError(f"{owner}: use_cls_token must be True or False, got {use_cls_token!r}")
    checks.count(num_cls_tokens, f"{owner}: num_cls_tokens")
    if not use_cls_token:
        return None
    return nn.Parameter(torch.randn(num_cls_tokens, dim) * 0.02)


def joined_mask(front: Front | None, mask: Tensor | None, b: int, n: int, device: torch.device) -> Tensor | None:
    """The keep-mask over the front embeddings and the n text positions, (b, p + n), or None when nothing is masked."""
    if front is None or (mask is None and front.mask is None):
        return mask
    ones = lambda m: torch.ones(b, m, dtype=torch.bool, device=device)     # noqa: E731
    return torch.cat((front.mask if front.mask is not None else ones(front.h.shape[1]),
                      mask if mask is not None else ones(n)), dim=1)
