"""Nyströmformer (Xiong et al. 2021, arXiv:2102.03902): softmax attention S = softmax(q kᵀ) through m
landmarks q̃, k̃, the segment means of the queries and keys,

    Ŝ = softmax(q k̃ᵀ) · softmax(q̃ k̃ᵀ)⁺ · softmax(q̃ kᵀ),

the pseudo-inverse ⁺ from the paper's iteration Z ← ¼ Z (13I - AZ (15I - AZ (7I - AZ))) started at
Z₀ = Aᵀ / (‖A‖₁ ‖A‖∞) (‖A‖∞ = 1: A's rows are softmax rows), and optionally the paper's skip
connection, a depthwise convolution of the values along the sequence, added to the output. O(n m)
instead of O(n²). When every key is its own landmark (m >= keys), Ŝ is S (S S⁺ S = S): computed
directly.

Segments: position t of n lies in segment ⌊t m / n⌋ (m contiguous segments, sizes differing by at
most one; exactly n / m each when m divides n). Padded positions are left out of the means, and a
segment with no kept position gives no landmark: its row and column of A are zero, which keeps the
iteration on the other landmarks exactly what it would be without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import checks
from ...config import LayersConfig
from ...interfaces import KV, AttnOut, Caps, KernelSpec
from ...precision import upcast
from ..normalize import masked_softmax
from .dense import match_heads

PINV_INITS = ("row", "batch")


@dataclass(frozen=True)
class NystromOptions:
    landmarks: int                  # m
    pinv_iters: int = 6             # iterations of the pseudo-inverse (the paper's 6)
    conv: int = 0                   # kernel size of the values' depthwise convolution (odd); 0: none
    pinv_init: str = "row"          # ‖A‖₁ of Z₀: "row" per sample and head; "batch": the largest in the
                                    # batch (Hugging Face's, which makes a sample depend on its batch-mates)


def segment_means(x: Tensor, keep: Tensor | None, m: int) -> tuple[Tensor, Tensor]:
    """The landmarks (b, h, m, d) of x (b, h, n, d): the mean of each segment's kept positions (keep (b, n)
    or None); and which landmarks have any position (b, m)."""
    b, n = x.shape[0], x.shape[2]
    if keep is None and n % m == 0:         # equal segments: a mean over a view, no (m, n) weights
        return x.unflatten(2, (m, n // m)).mean(3), torch.ones(b, m, dtype=torch.bool, device=x.device)
    segment = torch.arange(n, device=x.device) * m // n
    w = (segment == torch.arange(m, device=x.device)[:, None]).to(x.dtype).expand(b, m, n)   # (b, m, n)
    if keep is not None:
        w = w * keep[:, None, :].to(x.dtype)
    count = w.sum(-1)
    # one (m, n) @ (n, h d) product per row: a broadcast matmul would copy w once per head
    return torch.einsum("bmn,bhnd->bhmd", w / count.clamp(min=1)[..., None], x), count > 0


def iterative_pinv(a: Tensor, iters: int, init: str = "row") -> Tensor:
    """The pseudo-inverse of non-negative (b, h, m, m) matrices with rows summing to 1 or 0, by the
    paper's iteration (third order once ‖I - AZ‖ < 1). init: Z₀'s ‖A‖₁ per matrix ("row") or the
    batch's largest ("batch")."""
    norm = a.sum(-2).amax(-1)[..., None, None]                                 # (b, h, 1, 1): ‖A‖₁
    if init == "batch":
        norm = norm.amax().expand_as(norm)
    z = a.transpose(-1, -2) / torch.where(norm > 0, norm, torch.ones_like(norm))     # all-zero A: Z = 0
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, m: int, iters: int, init: str = "row",
            need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """Ŝ v for scaled queries q (b, h, i, d), keys k (b, h, j, d), values v (b, h, j, dv) and the keys'
    keep-mask (b, j) or None (the queries are the last i keys); (out (b, h, i, dv), Ŝ (b, h, i, j) when
    need_weights)."""
    i = q.shape[2]
    q_keep = keep[:, -i:] if keep is not None else None
    q_marks, q_ok = segment_means(q, q_keep, m)                                # (b, h, m, d), (b, m)
    k_marks, k_ok = segment_means(k, keep, m)
    seen = None if keep is None else k_ok[:, None, None, :]      # without padding every landmark has positions
    kernel_1 = masked_softmax(q @ k_marks.transpose(-1, -2), seen)             # (b, h, i, m)
    a = masked_softmax(q_marks @ k_marks.transpose(-1, -2), seen)
    if keep is not None:
        a = a * q_ok[:, None, :, None]
    kernel_3 = masked_softmax(q_marks @ k.transpose(-1, -2), None if keep is None else keep[:, None, None, :])
    left = kernel_1 @ iterative_pinv(a, iters, init)    # (b, h, i, m): 0 in a missing landmark's column (A's row is 0)
    if need_weights:
        weights = left @ kernel_3
        return weights @ v, weights
    return left @ (kernel_3 @ v), None


class Nystrom(nn.Module):
    """Nyström attention: the output (b, h, i, dv) of queries (b, h, i, d) against every key in `kv`."""

    caps = Caps(exact=False, bias=False, causal=False, bidirectional=True, padding=True, decode="none",
                form="direct", tolerance=0.1)   # m = n with the default 6 iterations; exact in the limit
    options: type = NystromOptions

    def __init__(self, spec: KernelSpec):
        super().__init__()
        o: NystromOptions = spec.options
        self.scale = spec.scale
        self.landmarks, self.pinv_iters, self.pinv_init = o.landmarks, o.pinv_iters, o.pinv_init
        self.conv = None
        if o.conv:      # one filter of `conv` taps per head, along the sequence: weight (h, 1, conv, 1)
            bound = 1 / math.sqrt(o.conv)
            self.conv = nn.Parameter(torch.empty(spec.heads, 1, o.conv, 1).uniform_(-bound, bound))

    @staticmethod
    def check(options: NystromOptions, cfg: LayersConfig) -> list[str]:
        found = []
        for name, value, low in (("landmarks", options.landmarks, 1), ("pinv_iters", options.pinv_iters, 1),
                                 ("conv", options.conv, 0)):
            found += checks.whole(value, f"attn_nystrom_{name}", low)
        if isinstance(options.conv, int) and options.conv > 0 and options.conv % 2 == 0:
            found.append(f"attn_nystrom_conv must be 0 or odd (a kernel centred on each position), got {options.conv}")
        if options.pinv_init not in PINV_INITS:
            found.append(f"attn_nystrom_pinv_init must be one of {PINV_INITS}, got {options.pinv_init!r}")
        if cfg.attention.dropout:
            found.append("attn_dropout cannot combine with attn_nystrom_landmarks: the approximation has no "
                         "attention weights to drop")
        return found

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        dtype, h, i = q.dtype, q.shape[1], q.shape[2]
        q, k, v = upcast(q) * self.scale, match_heads(upcast(kv.k), h), match_heads(upcast(kv.v), h)
        keep = None if kv.mask is None else F.pad(kv.mask, (kv.free, 0), value=True)      # (b, j)
        if keep is not None:
            v = v * keep[:, None, :, None]          # padded values reach nothing, not even the convolution
        if self.landmarks >= k.shape[2]:
            weights = masked_softmax(q @ k.transpose(-1, -2), None if keep is None else keep[:, None, None, :])
            out = weights @ v
        else:
            out, weights = nystrom(q, k, v, keep, self.landmarks, self.pinv_iters, self.pinv_init, need_weights)
        if self.conv is not None:       # over the keys with positions; the queries are the last i of them
            size = self.conv.shape[2]
            out = out + F.conv2d(v[:, :, kv.free:], self.conv.to(v.dtype), padding=(size // 2, 0),
                                 groups=h)[:, :, -i:]
        return AttnOut(out.to(dtype), weights=weights.to(dtype) if need_weights else None)
