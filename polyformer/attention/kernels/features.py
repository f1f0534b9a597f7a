"""Feature maps of kernel attention: ψ(q), ψ(k) bounded, and each key's log-weight a (see
linear_core.py), so that exp(a_k) ψ(q)·ψ(k) is the kernel's φ(q)·φ(k) up to a factor per query.

- elu / relu: Katharopoulos et al. 2020, φ(x) = elu(x) + 1 (or relu(x)); a = 0.
- FAVOR+ (Performer, Choromanski et al. 2021): φ(x) = exp(ωᵀx̃ - |x̃|²/2) / √m with x̃ = x d^(-1/4)
  and ω orthogonal random rows, so E[φ(q)·φ(k)] = exp(qᵀk / √d); ψ = φ divided by its own largest
  entry, which goes into a (keys) or cancels (queries). Its relu kernel: relu(ωᵀx̃) / √m.
- Random Fourier features (RFA, Peng et al. 2021): φ(x) = [sin(ωᵀx̂ / σ), cos(ωᵀx̂ / σ)] / √D of the
  l2-normalised x̂, ω ~ N(0, I), σ learned per head: E[φ(x)·φ(y)] = exp(-|x̂ - ŷ|² / 2σ²)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        f = (lambda x: F.elu(x) + 1) if self.kind == "elu" else F.relu
        return f(q), f(k), k.new_zeros(k.shape[:-1])


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

    def step(self) -> None:
        """Count a training forward; draw new features when the schedule says so."""
        self.calls += 1
        if self.redraw and int(self.calls) % self.redraw == 0:
            self.draws += 1
            self.omega = self.draw(int(self.draws)).to(self.omega.device)

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.training and torch.is_grad_enabled():
            self.step()
        omega = self.omega.to(q.dtype)
        qs, ks = q * self.dim ** -0.25, k * self.dim ** -0.25
        uq, uk = qs @ omega.T, ks @ omega.T
        if self.kind == "relu":
            return F.relu(uq), F.relu(uk), k.new_zeros(k.shape[:-1])
        top_q = uq.amax(-1, keepdim=True).detach()          # cancels between numerator and denominator
        top_k = uk.amax(-1, keepdim=True).detach()          # any per-key shift is exact: it moves to a
        a = top_k[..., 0] - ks.square().sum(-1) / 2
        return (uq - top_q).exp(), (uk - top_k).exp(), a


class Fourier(nn.Module):
    """RFA's random Fourier features of l2-normalised inputs, with a learned σ per kv head."""

    def __init__(self, dim: int, kv_heads: int, m: int, seed: int, layer: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 10_007)
        self.register_buffer("omega", torch.randn(m, dim, generator=g))
        self.log_sigma = nn.Parameter(torch.zeros(kv_heads))
        self.eps = 0.0

    def features(self, x: Tensor, heads: int) -> Tensor:
        sigma = self.log_sigma.exp().repeat_interleave(heads // self.log_sigma.shape[0])[:, None, None]
        u = F.normalize(x, dim=-1) @ self.omega.to(x.dtype).T / sigma.to(x.dtype)
        return torch.cat([u.sin(), u.cos()], dim=-1) / math.sqrt(self.omega.shape[0])

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.features(q, q.shape[1]), self.features(k, k.shape[1]), k.new_zeros(k.shape[:-1])
