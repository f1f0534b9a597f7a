"""Manifold-constrained hyper-connections (mHC, arXiv:2512.24880): hyper.py's n residual streams, with the
stream mixing held on the doubly stochastic matrices (`hyper_conn_sinkhorn_iters = t` beside
num_residual_streams = n; x-transformers 2.31's form of num_residual_streams).

From the streams X (n x d) of a token, flattened and RMS-normalised to x' (1 x n d):

    H_pre  = sigmoid(a_pre  * x' W_pre  + b_pre)         (1 x n)   the block's input  h0 = H_pre X
    H_post = 2 sigmoid(a_post * x' W_post + b_post)      (1 x n)   its output into each stream
    H_res  = SinkhornKnopp(a_res * mat(x' W_res) + b_res) (n x n)  X' = H_res X + H_post^T F(h0)

SinkhornKnopp(M) starts from exp(M) and alternately makes every row and then every column sum to 1, t times:
the columns of H_res sum to 1 exactly, its rows to within the iteration's error, so the mixing neither creates
nor destroys signal (the streams' sum is carried unchanged) and products over depth stay bounded, unlike plain
hyper-connections' free A_r. Initialisation: W at zero, a = 0.01, b_pre = b_post = b_res = 0: every stream
starts as the plain residual stream (H_res averages identical streams, H_post = 1, and the block's pre-norm
does not see H_pre's factor n / 2), so a pre-norm stack starts as the plain one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .norm import RMSNorm
from .precision import upcast


def sinkhorn_knopp(logits: Tensor, iters: int) -> Tensor:
    """exp(logits) (..., n, n) made doubly stochastic by `iters` row-then-column normalisations, in float32
    and in log space (dividing by a sum is subtracting its logsumexp): large logits neither overflow nor leave
    a row of zeros."""
    m = upcast(logits)
    for _ in range(iters):
        m = m - m.logsumexp(dim=-1, keepdim=True)
        m = m - m.logsumexp(dim=-2, keepdim=True)
    return m.exp()


class ManifoldHyperConnection(nn.Module):
    """The residual of one block over n streams, as hyper.HyperConnection: `read(H)` -> h0, `forward(H, y)` ->
    H'. H (b, i, n, d), h0 and y (b, i, d)."""

    def __init__(self, dim: int, streams: int, iters: int):
        super().__init__()
        self.streams, self.iters = streams, iters
        self.norm = RMSNorm(streams * dim)
        self.dynamic = nn.Parameter(torch.zeros(streams * dim, 2 * streams + streams * streams))  # W_pre|post|res
        self.scale = nn.Parameter(torch.full((3,), 0.01))                    # a_pre, a_post, a_res
        self.bias_pre = nn.Parameter(torch.zeros(streams))
        self.bias_post = nn.Parameter(torch.zeros(streams))
        self.bias_res = nn.Parameter(torch.zeros(streams, streams))

    def logits(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The pre-activation H~_pre (b, i, n), H~_post (b, i, n), H~_res (b, i, n, n) of streams h."""
        n = self.streams
        x = self.norm(h.flatten(-2)) @ self.dynamic.to(h.dtype)
        pre, post, res = x.split((n, n, n * n), dim=-1)
        a = self.scale.to(h.dtype)
        return (a[0] * pre + self.bias_pre, a[1] * post + self.bias_post,
                a[2] * res.unflatten(-1, (n, n)) + self.bias_res)

    def read(self, h: Tensor) -> Tensor:
        """h0 = H_pre X: the block's input, (b, i, d)."""
        pre = torch.sigmoid(self.logits(h)[0])
        return torch.einsum("bis,bisd->bid", pre.to(h.dtype), h)

    def forward(self, h: Tensor, y: Tensor) -> Tensor:
        """X' = H_res X + H_post^T y: (b, i, n, d)."""
        _, post, res = self.logits(h)
        mix = sinkhorn_knopp(res, self.iters).to(h.dtype)                  # (b, i, n, n): row s reads streams t
        carried = torch.einsum("bist,bitd->bisd", mix, h)
        return carried + (2 * torch.sigmoid(post)).to(h.dtype)[..., None] * y[:, :, None]
