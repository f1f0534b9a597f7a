"""Adaptive attention span (Sukhbaatar et al. 2019, "Adaptive Attention Span in Transformers",
arXiv:1905.07799), a kernel of form "direct", causal only (the paper's language-model form; an Encoder
is refused rather than given an unpublished |i - j| variant).

Each head h learns a span z_h = S clamp(p_h, 0, 1) in [0, S] and weighs the key at distance
x = i - j >= 0 by the soft mask m_z(x) = clamp((R + z - x) / R, 0, 1) before normalising, as the
paper does: a_ij = m_z(i - j) exp(s_ij) / sum_r m_z(i - r) exp(s_ir). The paper clamps p into
[0, 1] after every optimiser step; here the clamp is in the forward and its gradient is the
projected one (kept where a descent step moves p into the box or keeps it there), so a head whose
span reached 0 can still grow back. The L1 term (lambda / heads) sum_h z_h is reported as
"adaptive_span" with weight lambda (the paper's lambda / M sum over every head of every layer).

Only keys at distance < w = floor(max_h z_h + R) + 1 (at most S + R) can weigh anything, so the
kernel reads only those: queries in groups of Q, each against the Q + w - 1 keys within reach
(strided views, no gather), O(n w) time and memory, never n x n. A decode state keeps the last
S + R keys alone (`decode_window`: a ring of them, memory/window_state.py, as for a window pattern), and each
step reads only the last w of them. Keys without a position (memory key / values) are seen by
every query with weight 1. When the keys are not one run of positions (or weights are asked
for), the same formula runs on the full (i, j) distances: the reference path.
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
from ...losses import AuxLosses
from ...precision import HIDDEN, upcast
from ..patterns.layout import Geometry
from .dense import match_heads

LOSS = "adaptive_span"


@dataclass(frozen=True)
class AdaptiveSpanOptions:
    span: int                       # S: the largest span a head can learn
    ramp: int = 32                  # R: the soft mask falls from 1 to 0 over R positions (the paper's)
    loss: float = 2e-6              # lambda, the weight of the L1 term on the spans (the paper's)
    init: float = 0.0               # z / S at initialisation (the paper starts its spans at 0)


@dataclass(frozen=True)
class DecodeWindow:
    """What a decode state must keep (read by the stack as of a window pattern): the last `span` keys."""

    span: int
    sinks: int = 0
    decode: str = "window"


class _Projected(torch.autograd.Function):
    """clamp(p, 0, 1) with the projected gradient: zero only where descent would push p further out."""

    @staticmethod
    def forward(ctx, p: Tensor) -> Tensor:
        ctx.save_for_backward(p)
        return p.clamp(0, 1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (p,) = ctx.saved_tensors
        inward = ((p >= 0) | (grad < 0)) & ((p <= 1) | (grad > 0))
        return grad * inward


def soft_mask(z: Tensor, distance: Tensor, ramp: int) -> Tensor:
    """m_z(x) = clamp((R + z - x) / R, 0, 1) for x >= 0, 0 for x < 0 (a later key):
    z (h,), distance (..., i, j) -> (..., h, i, j)."""
    x = distance.unsqueeze(-3).to(z.dtype)
    m = ((ramp + z.view(-1, 1, 1) - x) / ramp).clamp(0, 1)
    return m.masked_fill(x < 0, 0.0)


def log_weight(m: Tensor) -> Tensor:
    """log m, with HIDDEN where m = 0 (no NaN gradient through the hidden entries)."""
    return torch.where(m > 0, m.clamp_min(1e-30).log(), torch.full_like(m, HIDDEN))


def bands(t: Tensor, start: int, groups: int, size: int, width: int) -> Tensor:
    """Rows of t (..., n, d) for each group g: rows start + g size ... start + g size + width - 1
    (zeros outside [0, n)), as a strided view (..., groups, d, width)."""
    front = max(0, -start)
    t = t[..., max(0, start):, :]
    back = max(0, (groups - 1) * size + width - front - t.shape[-2])
    t = F.pad(t, (0, 0, front, back))
    return t.unfold(-2, width, size)[..., :groups, :, :]


class AdaptiveSpan(nn.Module):
    """Adaptive-span heads on q (b, h, i, d), kv.k / kv.v (b, hk, j, d): out (b, h, i, dv)."""

    caps = Caps(exact=True, bias=False, causal=True, bidirectional=False, padding=True, decode="window",
                form="direct")
    options: type = AdaptiveSpanOptions
    loss_names = (LOSS,)

    def __init__(self, spec: KernelSpec):
        super().__init__()
        o: AdaptiveSpanOptions = spec.options
        self.max_span, self.ramp, self.weight, self.scale = o.span, o.ramp, o.loss, spec.scale
        self.fraction = nn.Parameter(torch.full((spec.heads,), float(o.init)))     # p; z = S clamp(p, 0, 1)
        self.dropout = nn.Dropout(spec.dropout)
        self.decode_window = DecodeWindow(o.span + o.ramp)

    @staticmethod
    def check(options: AdaptiveSpanOptions, cfg: LayersConfig) -> list[str]:
        found = checks.whole(options.span, "attn_adaptive_span")
        found += checks.whole(options.ramp, "attn_adaptive_span_ramp")
        if not checks.number(options.loss) or options.loss < 0:
            found.append(f"attn_adaptive_span_loss must be a number >= 0, got {options.loss!r}")
        if not checks.number(options.init) or not 0 <= options.init <= 1:
            found.append(f"attn_adaptive_span_init must be a number in [0, 1] (a fraction of the span), "
                         f"got {options.init!r}")
        return found

    def spans(self) -> Tensor:
        """z (h,): each head's current span, in positions, float32 at least."""
        return self.max_span * _Projected.apply(upcast(self.fraction))

    def reach(self, z: Tensor | None = None) -> int:
        """w: how many positions back (the query's own included) any head can see now."""
        z = self.spans() if z is None else z
        return min(math.floor(float(z.detach().max()) + self.ramp) + 1, self.max_span + self.ramp)

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        h = q.shape[1]
        z = self.spans()
        losses = AuxLosses()
        losses.report(LOSS, z.sum() / h, self.weight)
        kv = KV(match_heads(kv.k, h), match_heads(kv.v, h), kv.pos, kv.mask, kv.free)
        run = not need_weights and Geometry.of(q_pos, kv.pos, kv.mask, True, h).run
        if run:
            out, weights = self.banded(q, kv, z), None
        else:
            out, weights = self.full(q, kv, q_pos, z)
        return AttnOut(out, weights=weights if need_weights else None, losses=losses)

    def banded(self, q: Tensor, kv: KV, z: Tensor) -> Tensor:
        """Keys one run of positions, the queries their last i: group g of Q queries reads the
        K = Q + w - 1 keys from g Q + shift - (w - 1) on. -> (b, h, i, dv)"""
        b, h, i, _ = q.shape
        free = kv.free
        k, v = kv.k[:, :, free:], kv.v[:, :, free:]
        nk = k.shape[2]
        w = self.reach(z)
        size = min(i, max(16, min(128, w // 2)))                           # Q queries per group
        groups, width = -(-i // size), size + w - 1
        start = nk - i - (w - 1)                                            # the first key of group 0
        qg = F.pad(q * self.scale, (0, 0, 0, groups * size - i)).unflatten(2, (groups, size))   # (b, h, G, Q, d)
        kg = bands(k, start, groups, size, width)                           # (b, h, G, d, K)
        vg = bands(v, start, groups, size, width).transpose(-1, -2)         # (b, h, G, K, dv)
        local = torch.arange(size, device=q.device)[:, None] - torch.arange(width, device=q.device) + (w - 1)
        logits = log_weight(soft_mask(z, local, self.ramp))                 # (h, Q, K): one for every group
        scores = upcast(torch.matmul(qg, kg)).add_(logits[:, None])         # (b, h, G, Q, K), in place: the largest
        # keys before key 0 (zero rows) are hidden: in the first groups only, unless padding hides keys anywhere
        hidden = groups if kv.mask is not None else min(groups, -(-max(0, -start) // size))
        if hidden:
            seen = torch.ones(b, nk, dtype=torch.bool, device=q.device) if kv.mask is None else kv.mask
            seen = bands(seen[..., None], start, hidden, size, width)[:, None, :, 0, None, :]   # (b, 1, G', 1, K)
            scores[:, :, :hidden].masked_fill_(~seen, HIDDEN)
        if free:
            extra = upcast(torch.matmul(q * self.scale, kv.k[:, :, :free].transpose(-1, -2)))   # (b, h, i, f)
            extra = F.pad(extra, (0, 0, 0, groups * size - i)).unflatten(2, (groups, size))
            scores = torch.cat((extra, scores), -1)
        visible = scores.amax(-1, keepdim=True) > HIDDEN / 2                # a query that sees no key: zeros
        weights = self.dropout(scores.softmax(-1)).to(v.dtype)
        out = torch.matmul(weights[..., free:], vg)
        if free:
            out = out + torch.matmul(weights[..., :free], kv.v[:, :, :free].unsqueeze(2))   # values (b, h, 1, f, dv)
        out = out * visible
        return out.flatten(2, 3)[:, :, :i].to(q.dtype)

    def full(self, q: Tensor, kv: KV, q_pos: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
        """The formula on every (query, key) pair, from positions: (out (b, h, i, dv), weights (b, h, i, j))."""
        free = kv.free
        distance = q_pos[..., :, None] - kv.pos[..., None, :]              # (b|1, i, j - free)
        logits = log_weight(soft_mask(z, distance, self.ramp))             # (b|1, h, i, j - free)
        if kv.mask is not None:
            logits = logits.masked_fill(~kv.mask[:, None, None, :], HIDDEN)
        logits = F.pad(logits, (free, 0))
        scores = upcast(torch.matmul(q, kv.k.transpose(-1, -2))) * self.scale + logits
        weights = scores.softmax(-1) * (scores > HIDDEN / 2).any(-1, keepdim=True)
        out = torch.matmul(self.dropout(weights).to(kv.v.dtype), kv.v)
        return out.to(q.dtype), weights.to(q.dtype)
