"""The sorting half of Sparse Sinkhorn attention (Tay et al. 2020, arXiv:2002.11296): block summaries,
the learned sorting network (SortNet) that scores pairs of blocks, and Sinkhorn balancing of those
scores, in log space, into a soft permutation P of the blocks.

SortNet. The paper passes each block's summary (the sum of its tokens) through a two-layer network
whose last layer has one output per block, which ties a model to one number of blocks. Ours keeps the
two-layer network, one per key head, and scores pairs instead:

    R[c, j] = f(s_c) · s_j / √d,     f(s) = W₂ relu(W₁ s + b₁) + b₂,

s_j the mean of block j's kept keys (the paper's sum over the block, divided by its count, so the
scale does not grow with the block size and a partly padded block is summarised by its kept keys).
Any length works, and a pair of blocks scores the same in every sequence.

Balancing. Sinkhorn's operator: S⁰ = (R + ε) / τ, ε Gumbel noise (training only), then each iteration
normalises the rows, then the columns, by logsumexp (F_c(F_r(S))), and P = exp(S). Only blocks holding a
kept key take part; a block without one has an empty row and column.

- Bidirectional: rows and columns over every pair of blocks; after enough iterations P's rows and
  columns sum to 1 (a doubly stochastic matrix).
- Causal: row r sorts for query block r + 1 and may take the blocks j <= r, all complete before that
  query block starts. Rows are normalised over those entries; column j over the entries (r', j) with
  r' <= j: the transpose of the row mask, as the authors' own code does (google-research/long-range-arena,
  sinkhorn_attention.py). Then every sum that reaches row r reads blocks <= r only: a later block never
  changes an earlier sort, and the rows of a prefix's P are the first rows of the whole sequence's P (what
  the decode step relies on). Normalising columns over the rows below the diagonal instead would let every
  later row reach row r; and rows and columns cannot share one triangular support, since the only lower
  triangular matrix whose rows and columns all sum to 1 is the identity. At convergence the rows sum to 1
  over j <= r and the columns to 1 over r' <= j.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def block_means(x: Tensor, keep: Tensor, size: int) -> Tensor:
    """Per block of `size` slots, the mean of the kept rows of x (b, h, L * size, d), keep (b, L * size)
    bool: (b, h, L, d); 0 for a block without a kept row."""
    b, h, n, d = x.shape
    w = keep.to(x.dtype).view(b, 1, n // size, 1, size)
    total = (w @ x.reshape(b, h, n // size, size, d)).squeeze(-2)            # (b, h, L, d)
    return total / w.sum(-1).clamp(min=1)


class SortNet(nn.Module):
    """Block-pair sort scores R (b, hk, L, L) from the block means s (b, hk, L, d), one two-layer
    network per key head: R[c, j] = f(s_c) · s_j / √d."""

    def __init__(self, heads: int, dim: int):
        super().__init__()
        bound = 1 / math.sqrt(dim)
        self.w1 = nn.Parameter(torch.empty(heads, dim, dim).uniform_(-bound, bound))
        self.b1 = nn.Parameter(torch.empty(heads, 1, dim).uniform_(-bound, bound))
        self.w2 = nn.Parameter(torch.empty(heads, dim, dim).uniform_(-bound, bound))
        self.b2 = nn.Parameter(torch.empty(heads, 1, dim).uniform_(-bound, bound))

    def forward(self, s: Tensor) -> Tensor:
        w1, b1, w2, b2 = (p.to(s.dtype) for p in (self.w1, self.b1, self.w2, self.b2))
        rows = F.relu(s @ w1 + b1) @ w2 + b2                                  # (b, hk, L, d)
        return rows @ s.transpose(-1, -2) / math.sqrt(s.shape[-1])


def supports(filled: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """Which entries of the (L, L) sort matrix each normalisation sums over, from the blocks holding a
    kept key, filled (b, L): (rows (b, 1, L, L), columns (b, 1, L, L)) bool; see the module docstring."""
    pair = (filled[:, :, None] & filled[:, None, :])[:, None]
    if not causal:
        return pair, pair
    L = filled.shape[-1]
    lower = torch.ones(L, L, dtype=torch.bool, device=filled.device).tril()
    return pair & lower, pair & lower.T


def gumbel(shape: torch.Size, like: Tensor) -> Tensor:
    """Standard Gumbel noise -log(-log U), U uniform in (0, 1)."""
    tiny = torch.finfo(like.dtype).tiny
    u = torch.rand(shape, dtype=like.dtype, device=like.device).clamp(tiny, 1 - 1e-7)
    return -torch.log(-torch.log(u))


def _lse(s: Tensor, keep: Tensor, dim: int) -> Tensor:
    """logsumexp of s over `dim`, entries where keep is True only; 0 where there is none."""
    empty = ~keep.any(dim, keepdim=True)
    s = s.masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0)
    return torch.logsumexp(s, dim, keepdim=True).masked_fill(empty, 0.0)


def balance(scores: Tensor, rows: Tensor, cols: Tensor, iters: int) -> Tensor:
    """`iters` rounds of row then column normalisation of log-space scores (b, h, L, L), each over its
    support (rows, cols: bool, broadcastable): the balanced log scores S."""
    s = scores
    for _ in range(iters):
        s = s - _lse(s, rows, -1)
        s = s - _lse(s, cols, -2)
    return s


def sinkhorn(scores: Tensor, rows: Tensor, cols: Tensor, iters: int) -> Tensor:
    """The soft permutation P = exp(S) of the balanced scores, 0 outside the rows' support."""
    return balance(scores, rows, cols, iters).masked_fill(~rows, float("-inf")).exp()
