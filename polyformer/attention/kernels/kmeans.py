"""Online spherical k-means, the router of routing attention (Roy et al. 2021, arXiv:2003.05997).

Queries and keys are unit-normalised (the paper keeps them on the sphere so that the nearest centroid
is the one of largest dot product), and so are the centroids μ (heads, k, d). In training each
centroid moves toward the mean of the vectors assigned to it,

    μ <- normalise(λ μ + (1 - λ) mean{x : μ(x) = μ}),      λ = decay (the paper's 0.999),

without gradient; a centroid with no member stays. The commitment loss mean ||x - μ(x)||² (μ
detached) pulls the vectors toward their centroids (VQ-VAE's term; the paper relies on the moving
average alone). Centroids start as random unit vectors from a generator seeded by the layer, so an
untrained model routes (evaluates, generates) deterministically.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...precision import upcast
from ...reversible import differentiated_forward


BLOCK = 1024        # positions assigned at a time: the (b, h, block, k) similarities stay small


def unit(x: Tensor) -> Tensor:
    """x / ||x|| along the last dim, in float32 at least."""
    return F.normalize(upcast(x), dim=-1)


def assign(x: Tensor, centroids: Tensor) -> Tensor:
    """Cluster ids (b, h, n) of vectors x (b, h, n, d) under unit centroids (h, k, d): the nearest centroid
    to x / ||x||, i.e. the largest x · μ (a positive scale keeps the argmax). No gradient; computed
    BLOCK positions at a time, so no (n, k) tensor is kept."""
    with torch.no_grad():
        c = centroids.to(x.dtype)
        return torch.cat([torch.einsum("bhnd,hkd->bhnk", x[:, :, s:s + BLOCK], c).argmax(-1)
                          for s in range(0, x.shape[2], BLOCK)], dim=2)


def member_sums(x: Tensor, ids: Tensor, keep: Tensor | None, clusters: int) -> tuple[Tensor, Tensor]:
    """Per head and cluster, the sum (h, k, d) of the unit vectors x / ||x|| (x (b, h, n, d)) with ids
    (b, h, n) where keep (b, n) holds (None: all), and their count (h, k). No gradient."""
    with torch.no_grad():
        x = unit(x)
        weight = torch.ones_like(ids, dtype=x.dtype) if keep is None else keep[:, None, :].to(x.dtype).expand(ids.shape)
        if keep is not None:
            x = x * weight[..., None]
        b, h, _, d = x.shape
        sums = x.new_zeros(b, h, clusters, d).scatter_add_(2, ids[..., None].expand(-1, -1, -1, d), x).sum(0)
        counts = x.new_zeros(b, h, clusters).scatter_add_(2, ids, weight).sum(0)
    return sums, counts


def ema_step(centroids: Tensor, sums: Tensor, counts: Tensor, decay: float) -> Tensor:
    """μ <- normalise(decay μ + (1 - decay) mean of members), for clusters with members; others stay."""
    means = sums / counts.clamp(min=1)[..., None]
    moved = F.normalize(decay * centroids + (1 - decay) * means, dim=-1)
    return torch.where(counts[..., None] > 0, moved, centroids)


def commitment(x: Tensor, ids: Tensor, centroids: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """(sum, count) over the kept vectors x (b, h, n, d) of ||x / ||x|| - μ(x)||² = 2 - 2 x · μ(x) / ||x||
    (unit vectors), μ detached: the gradient is the same as the squared distance's (normalisation
    projects its radial part out) at the cost of one dot product per vector."""
    x = upcast(x)
    routed = centroids.detach().to(x.dtype)[torch.arange(x.shape[1], device=x.device)[:, None], ids]  # (b, h, n, d)
    dist = 2 - 2 * (x * routed).sum(-1) / x.norm(dim=-1).clamp(min=1e-12)                          # (b, h, n)
    if keep is None:
        return dist.sum(), dist.new_tensor(float(dist.numel()))
    weight = keep[:, None, :].to(dist.dtype)
    return (dist * weight).sum(), weight.sum() * dist.shape[1]


class OnlineKmeans(nn.Module):
    """Centroids (heads, clusters, dim) as a persistent buffer, the assignment and the training update."""

    def __init__(self, heads: int, clusters: int, dim: int, decay: float, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("centroids", F.normalize(torch.randn(heads, clusters, dim, generator=g), dim=-1))
        self.decay = decay
        self.clusters = clusters
        self._before: Tensor | None = None     # the centroids the last moving forward routed with

    def _apply(self, fn, recurse: bool = True) -> "OnlineKmeans":
        """Casts keep the centroids in float32 at least: a moving-average step of 1 - decay = 1e-3 is
        below bfloat16's resolution, so centroids stored in it would never move."""
        super()._apply(fn, recurse)
        self.centroids = upcast(self.centroids)
        return self

    def forward(self, q: Tensor, k: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Cluster ids (b, h, i) of queries q (b, h, i, d) and (b, h, j) of keys k (b, h, j, d), and the
        commitment loss of this forward's own tokens, the queries and the last i keys (not cached or
        remembered keys), where keep (b, i) holds. In training the centroids then move by one EMA step
        toward those tokens, in a forward that autograd will differentiate, run for the first time
        (`reversible.differentiated_forward`). Any other training forward (a recomputation inside backward:
        gradient checkpointing, reversible layers; one under no_grad) moves nothing and routes with the
        centroids the last moving forward routed with (the current ones would differ from the original
        forward's; so would those of the forward before it, with several forwards before one backward)."""
        move = self.training and differentiated_forward()
        again = self.training and not move and self._before is not None
        centroids = self._before if again else self.centroids
        q_ids, k_ids = assign(q, centroids), assign(k, centroids)
        i = q.shape[2]
        own = ((q, q_ids), (k[:, :, -i:], k_ids[:, :, -i:]))
        terms = [commitment(x, ids, centroids, keep) for x, ids in own]
        loss = (terms[0][0] + terms[1][0]) / (terms[0][1] + terms[1][1]).clamp(min=1)
        if move:
            sums = [member_sums(x, ids, keep, self.clusters) for x, ids in own]
            self._before = self.centroids.clone()
            with torch.no_grad():
                self.centroids.copy_(ema_step(upcast(self.centroids), sums[0][0] + sums[1][0],
                                              sums[0][1] + sums[1][1], self.decay))
        return q_ids, k_ids, loss
