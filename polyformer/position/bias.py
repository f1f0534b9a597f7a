"""Additive score biases: T5 relative buckets (arXiv:1910.10683) and ALiBi (arXiv:2108.12409)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def alibi_slopes(heads: int) -> Tensor:
    """The paper's geometric slopes: 2^(-8/n), 2^(-16/n), ... for n a power of two; otherwise the
    slopes of the closest smaller power of two, then every other slope of twice that."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(heads).is_integer():
        return torch.tensor(power_of_two(heads))
    closest = 2 ** math.floor(math.log2(heads))
    extra = power_of_two(2 * closest)[0::2][: heads - closest]
    return torch.tensor(power_of_two(closest) + extra)


class AlibiBias(nn.Module):
    """ALiBi: a per-head linear penalty on query-key distance; heads past `alibi_heads` get none."""

    def __init__(self, heads: int, alibi_heads: int | None = None):
        super().__init__()
        n = alibi_heads or heads
        slopes = torch.cat((alibi_slopes(n), torch.zeros(heads - n)))
        self.register_buffer("slopes", slopes.view(heads, 1, 1), persistent=False)

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        distance = (k_pos[..., None, :] - q_pos[..., :, None]).abs().float()   # (b|1, i, j)
        return -self.slopes * distance.unsqueeze(-3)                            # (b|1, h, i, j)

    def aligned(self, q_pos: Tensor, k_pos: Tensor, heads: Tensor) -> Tensor:
        """Positions that already carry a head axis: q_pos (..., H, G, i), k_pos (..., H, G, j) with
        H 1 or len(heads) -> the bias of `heads`, (..., len(heads), G, i, j) (the block-sparse kernel's
        gathered keys)."""
        distance = (k_pos[..., None, :] - q_pos[..., :, None]).abs().float()
        return -self.slopes.view(-1)[heads].view(-1, 1, 1, 1) * distance


def t5_buckets(relative: Tensor, causal: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bucketing of relative = k_pos - q_pos: exact buckets for small distances, logarithmic
    ones up to max_distance; bidirectional models spend half the buckets on each direction."""
    n = -relative
    bucket = torch.zeros_like(n)
    if not causal:
        num_buckets //= 2
        bucket = (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, n, large)


class T5Bias(nn.Module):
    """T5's learned relative position bias: one scalar per (bucket, head), shared by all layers."""

    def __init__(self, heads: int, causal: bool, num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        self.causal = causal
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.embedding = nn.Embedding(num_buckets, heads)

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        relative = k_pos[..., None, :] - q_pos[..., :, None]                  # (b|1, i, j)
        buckets = t5_buckets(relative.long(), self.causal, self.num_buckets, self.max_distance)
        return self.embedding(buckets).permute(0, 3, 1, 2)                     # (b|1, h, i, j)

    def aligned(self, q_pos: Tensor, k_pos: Tensor, heads: Tensor) -> Tensor:
        """As `AlibiBias.aligned`: (..., H, G, i), (..., H, G, j) -> (..., len(heads), G, i, j)."""
        relative = k_pos[..., None, :] - q_pos[..., :, None]
        buckets = t5_buckets(relative.long(), self.causal, self.num_buckets, self.max_distance)
        table = self.embedding.weight.t()[heads]                                # (hp, buckets)
        return table[torch.arange(len(heads), device=buckets.device).view(-1, 1, 1, 1), buckets]
