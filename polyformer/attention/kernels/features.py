"""Feature maps of kernel attention: `query(x)` = ψ(q) and `key(x)` = (ψ(k), a), bounded features and
each key's log-weight (see linear_core.py), so that exp(a_k) ψ(q)·ψ(k) is the kernel's φ(q)·φ(k) up to
a factor per query; `advance()` runs once per forward (FAVOR+'s redraw schedule).

- elu / relu: Katharopoulos et al. 2020, φ(x) = elu(x) + 1 (or relu(x)); a = 0.
- FAVOR+ (Performer, Choromanski et al. 2021): φ(x) = exp(ωᵀx̃ - |x̃|²/2) / √m with x̃ = x d^(-1/4)
  and ω orthogonal random rows, so E[φ(q)·φ(k)] = exp(qᵀk / √d); ψ = φ divided by its own largest
  entry, which goes into a (keys) or cancels (queries). Its relu kernel: relu(ωᵀx̃) / √m.
- Random Fourier features (RFA, Peng et al. 2021): φ(x) = [sin(ωᵀx̂ / σ), cos(ωᵀx̂ / σ)] / √D of the
  l2-normalised x̂, ω ~ N(0, I), σ learned per head: E[φ(x)·φ(y)] = exp(-|x̂ - ŷ|² / 2σ²).

`floor(heads)`: the kernel's least value (h,), below which its estimate φ(q)·φ(k) may fall (None where
the features are positive: their estimate never does)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...reversible import differentiated_forward


def random_rows(m: int, d: int, orthogonal: bool, generator: torch.Generator) -> Tensor:
    """(m, d) Gaussian rows; orthogonal: blocks of d mutually orthogonal rows, each row's length drawn
    as a Gaussian vector's (so every row is still marginally N(0, I))."""
    if not orthogonal:
        return torch.randn(m, d, generator=generator, dtype=torch.float64)
    blocks = []
    for _ in range(-(-m // d)):
        g = torch.randn(d, d, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        blocks.append((q * torch.sign(torch.diagonal(r))).T)       # rows orthonormal, signs fixed
    rows = torch.cat(blocks)[:m]
    lengths = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=-1, keepdim=True)
    return rows * lengths


def positive_features(x: Tensor, omega: Tensor) -> Tensor:
    """FAVOR+'s φ(x) (…, m), unstabilised: for tests of the estimator. x (…, d), omega (m, d)."""
    xs = x * x.shape[-1] ** -0.25
    return (xs @ omega.T - xs.square().sum(-1, keepdim=True) / 2).exp() / math.sqrt(omega.shape[0])


class Elementwise(nn.Module):
    """φ = elu + 1 or relu, on queries and keys alike."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.eps = 0.0 if kind == "elu" else 1e-6     # relu features can vanish

    def advance(self) -> None:
        pass

    def floor(self, heads: int) -> None:
        return None

    def query(self, x: Tensor) -> Tensor:
        return F.elu(x) + 1 if self.kind == "elu" else F.relu(x)

    def key(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.query(x), x.new_zeros(x.shape[:-1])


class Favor(nn.Module):
    """FAVOR+ random features, redrawn every `redraw` training forwards (0: never). The draw is a
    function of (seed, layer, how many draws so far), kept in the state dict."""

    def __init__(self, dim: int, m: int, kind: str, orthogonal: bool, redraw: int, seed: int, layer: int):
        super().__init__()
        self.dim, self.m, self.kind, self.orthogonal = dim, m, kind, orthogonal
        self.redraw, self.seed, self.layer = redraw, seed, layer
        self.eps = 0.0 if kind == "softmax" else 1e-6
        self.register_buffer("draws", torch.zeros((), dtype=torch.long))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("omega", self.draw(0))

    def draw(self, index: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.layer * 10_007 + index)
        return random_rows(self.m, self.dim, self.orthogonal, g).float()

    def advance(self) -> None:
        """Count a training forward; draw new features when the schedule says so (never in evaluation, nor
        while a reversible stack's backward recomputes the forward: reversible.differentiated_forward)."""
        if not (self.training and differentiated_forward()):
            return
        self.calls += 1
        if self.redraw and int(self.calls) % self.redraw == 0:
            self.draws += 1
            self.omega = self.draw(int(self.draws)).to(self.omega.device)

    def floor(self, heads: int) -> None:
        return None

    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(ωᵀx̃, x̃) with x̃ = x d^(-1/4)."""
        xs = x * self.dim ** -0.25
        return xs @ self.omega.to(x.dtype).T, xs

    def query(self, x: Tensor) -> Tensor:
        u, _ = self.project(x)
        if self.kind == "relu":
            return F.relu(u)
        return (u - u.amax(-1, keepdim=True).detach()).exp()   # a shift per query cancels in the ratio

    def key(self, x: Tensor) -> tuple[Tensor, Tensor]:
        u, xs = self.project(x)
        if self.kind == "relu":
            return F.relu(u), x.new_zeros(x.shape[:-1])
        top = u.amax(-1, keepdim=True).detach()               # a shift per key is exact: it moves into a
        return (u - top).exp(), top[..., 0] - xs.square().sum(-1) / 2


class Fourier(nn.Module):
    """RFA's random Fourier features of l2-normalised inputs, with a learned σ per kv head.

    Unlike FAVOR+'s, these features are signed: the estimate φ(q)·Σ_j w_j φ(k_j) of the normaliser
    Σ_j w_j exp(-|q̂ - k̂_j|² / 2σ²) is unbiased but, with few features, can come out near zero or
    negative, where the true sum cannot: |q̂ - k̂| <= 2 puts every term in [exp(-2 / σ²), 1] times
    its weight (and |φ(x)| = 1 keeps the estimate's terms in [-1, 1]). Dividing by such an estimate
    sends the output and its gradient to infinity (the arena's long-text rfa_gate row: gradient norms of
    60 - 360 before clipping, the loss stuck near 2.5 - 3).
    The kernel attention therefore keeps the estimate at least exp(-2 / σ²) Σ_j w_j, the least value
    the normaliser can take (linear_core's `floor`): moving an estimate into the range of its target
    never moves it further from the target; inside that range the paper's ratio estimator is unchanged.
    The output is then bounded by exp(2 / σ²) max_j |v_j|. (A fairseq implementation of RFA clamps the
    normaliser at a small constant instead, a bound blind to the keys' total weight.)"""

    def __init__(self, dim: int, kv_heads: int, m: int, seed: int, layer: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 10_007)
        self.register_buffer("omega", torch.randn(m, dim, generator=g))
        self.log_sigma = nn.Parameter(torch.zeros(kv_heads))
        self.eps = 0.0

    def advance(self) -> None:
        pass

    def sigma(self, heads: int) -> Tensor:
        """σ per query head (heads,): its kv head's."""
        return self.log_sigma.exp().repeat_interleave(heads // self.log_sigma.shape[0])

    def floor(self, heads: int) -> Tensor:
        """exp(-2 / σ²) per query head (heads,): the least value of the kernel of unit vectors."""
        return (-2 / self.sigma(heads).square()).exp()

    def query(self, x: Tensor) -> Tensor:
        """φ(x) of x (b, heads, n, d), each head with its kv head's σ."""
        sigma = self.sigma(x.shape[1])[:, None, None]
        u = F.normalize(x, dim=-1) @ self.omega.to(x.dtype).T / sigma.to(x.dtype)
        return torch.cat([u.sin(), u.cos()], dim=-1) / math.sqrt(self.omega.shape[0])

    def key(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.query(x), x.new_zeros(x.shape[:-1])
