"""Kernel attention of form "direct": linear transformers (Katharopoulos et al. 2020), Performer's
FAVOR+ (Choromanski et al. 2021) and Random Feature Attention with its gate (Peng et al. 2021). Each
is a feature map (features.py) on the shared algebra (linear_core.py): cost linear in length, and in
a decode state a fixed-size summary per block instead of keys and values."""

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
from . import linear_core as core
from .dense import match_heads
from .features import Elementwise, Favor, Fourier


@dataclass(frozen=True)
class LinearOptions:
    feature: str                     # "elu" (φ = elu + 1) or "relu"
    chunk: int = 64                  # causal form: quadratic inside chunks of this many positions


@dataclass(frozen=True)
class PerformerOptions:
    features: int | None = None      # m random features; None: d·ln(d) of the head size d, as the paper
    kernel: str = "softmax"          # "softmax" (positive features) or "relu"
    redraw: int = 0                  # draw new features every this many training forwards; 0: never
    orthogonal: bool = True
    seed: int = 0
    chunk: int = 64


@dataclass(frozen=True)
class RfaOptions:
    features: int | None = None      # D random frequencies (2D features); None: the head size
    gate: bool = False               # RFA-Gate: the summary decays by a learned gate per position
    seed: int = 0
    chunk: int = 64


RUN_CHUNKS = 8          # chunks per run of positions when nothing needs gradients (see KernelAttention.forward)


class KernelAttention(nn.Module):
    """out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j) over the keys query i sees (all of them, or
    j <= i in a causal stack), computed without the (i, j) matrix."""

    caps = Caps(exact=True, bias=False, causal=True, bidirectional=True, padding=True, decode="recurrent",
                form="direct")
    options: type = LinearOptions

    def __init__(self, spec: KernelSpec):
        super().__init__()
        self.chunk = spec.options.chunk
        self.feature = self.feature_map(spec, spec.options)

    def feature_map(self, spec: KernelSpec, options: LinearOptions) -> nn.Module:
        return Elementwise(options.feature)

    @staticmethod
    def check(options: LinearOptions, cfg: LayersConfig) -> list[str]:
        found = []
        if options.feature not in ("elu", "relu"):
            found.append(f"attn_linear must be 'elu' or 'relu', got {options.feature!r}")
        return found + checks.whole(options.chunk, "attn_linear_chunk")

    decays = False          # a gate decays the summary (RFA-Gate)

    def decay(self, k: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """(log-weight added per key, log-decay per position) of a gate; (None, None) without one."""
        return None, None

    def keys(self, k: Tensor, v: Tensor, keep: Tensor | None, heads: int
             ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(ψ(k), a, v, log-decay) of keys (b, hk, j, d), each key head repeated for its `heads` // hk
        query heads; keep (b, j) bool marks the keys that are not padding."""
        fk, a = self.feature.key(k)
        added, decay = self.decay(k)
        if added is not None:
            a = a + added
        if keep is not None:              # padded keys weigh nothing, and a gate does not close on them
            a = a.masked_fill(~keep[:, None, :], float("-inf"))
            decay = None if decay is None else decay.masked_fill(~keep[:, None, :], 0.0)
        a = match_heads(a[..., None], heads)[..., 0]
        decay = None if decay is None else match_heads(decay[..., None], heads)[..., 0]
        return match_heads(fk, heads), a, match_heads(v, heads), decay

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        self.feature.advance()
        dtype, eps, h, n = q.dtype, self.feature.eps, q.shape[1], q.shape[2]
        floor = self.feature.floor(h)
        q, k, v = upcast(q), upcast(kv.k), upcast(kv.v)
        keep = None if kv.mask is None else F.pad(kv.mask, (kv.free, 0), value=True)

        def keys(lo: int, hi: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
            return self.keys(k[:, :, lo:hi], v[:, :, lo:hi], None if keep is None else keep[:, lo:hi], h)

        if need_weights:
            if memory is not None:
                raise ValueError("return_attn cannot show a recurrent decode state's attention (it keeps no keys)")
            fk, a, vk, decay = keys(0, k.shape[2])
            out, weights = core.quadratic(self.feature.query(q), fk, a, vk, decay, eps, causal=causal,
                                          floor=floor)
            return AttnOut(out.to(dtype), weights=weights.to(dtype))
        # without autograd, runs of positions one after another (exact: summaries combine, and a causal
        # summary carries over), so features and chunks of one run only are held at a time
        run = max(n, k.shape[2]) if torch.is_grad_enabled() else self.chunk * RUN_CHUNKS
        if not causal:
            summary = None
            for lo in range(0, k.shape[2], run):
                part = core.summarise(*keys(lo, lo + run)[:3])
                summary = part if summary is None else core.combine(summary, part)
            outs = [core.read(self.feature.query(q[:, :, lo:lo + run]), summary, eps, floor) for lo in range(0, n, run)]
            return AttnOut(torch.cat(outs, 2).to(dtype))
        pre = k.shape[2] - n               # keys every query sees (memory key / values, XL memories)
        if pre and self.decays:
            raise ValueError("attn_rfa_gate decays the keys of the sequence; keys before it (XL memories) have "
                             "no place in that order")
        prefix = core.summarise(*keys(0, pre)[:3]) if pre else None
        state = memory.summary if memory is not None else None
        trail = memory.wanted if memory is not None else 0
        outs = []
        for lo in range(0, n, run):
            hi = min(lo + run, n)
            fk, a, vk, decay = keys(pre + lo, pre + hi)
            out, state, trailing = core.chunked(self.feature.query(q[:, :, lo:hi]), fk, a, vk, decay=decay,
                                                start=state, chunk=self.chunk, prefix=prefix,
                                                trail=trail if hi == n else 0, eps=eps, floor=floor)
            outs.append(out)
        if memory is not None:
            memory.write(state, trailing)
        return AttnOut(torch.cat(outs, 2).to(dtype))


class Performer(KernelAttention):
    """FAVOR+: softmax attention estimated with positive orthogonal random features."""

    caps = Caps(exact=False, bias=False, causal=True, bidirectional=True, padding=True, decode="recurrent",
                form="direct", tolerance=0.1)
    options = PerformerOptions

    def feature_map(self, spec: KernelSpec, options: PerformerOptions) -> nn.Module:
        d = spec.dim_qk
        m = options.features if options.features is not None else max(1, int(d * math.log(d)))
        return Favor(d, m, options.kernel, options.orthogonal, options.redraw, options.seed, spec.layer)

    @staticmethod
    def check(options: PerformerOptions, cfg: LayersConfig) -> list[str]:
        found = []
        if options.kernel not in ("softmax", "relu"):
            found.append(f"attn_performer_kernel must be 'softmax' or 'relu', got {options.kernel!r}")
        return (found + checks.whole(options.redraw, "attn_performer_redraw", 0)
                + checks.whole(options.features, "attn_performer_features", optional=True)
                + checks.whole(options.chunk, "attn_performer_chunk"))


class Rfa(KernelAttention):
    """Random Feature Attention: random Fourier features with a learned σ; RFA-Gate decays the summary
    by g_t = σ(w·k_t + b) per head (the gate reads the head's key, a linear function of the input):
    S_t = g_t S_(t-1) + (1 - g_t) φ(k_t) v_tᵀ, and alike for Σ φ(k)."""

    caps = Caps(exact=False, bias=False, causal=True, bidirectional=True, padding=True, decode="recurrent",
                form="direct", tolerance=0.1)
    options = RfaOptions

    def __init__(self, spec: KernelSpec):
        super().__init__(spec)
        self.decays = spec.options.gate
        if self.decays:
            self.gate_weight = nn.Parameter(torch.zeros(spec.kv_heads, spec.dim_qk))
            self.gate_bias = nn.Parameter(torch.full((spec.kv_heads,), 2.0))     # starts near g = 0.88

    def feature_map(self, spec: KernelSpec, options: RfaOptions) -> nn.Module:
        m = options.features if options.features is not None else spec.dim_qk
        return Fourier(spec.dim_qk, spec.kv_heads, m, options.seed, spec.layer)

    @staticmethod
    def check(options: RfaOptions, cfg: LayersConfig) -> list[str]:
        found = (checks.whole(options.features, "attn_rfa_features", optional=True)
                 + checks.whole(options.chunk, "attn_rfa_chunk"))
        if options.gate and not cfg.causal:
            found.append("attn_rfa_gate decays a causal summary; an Encoder has none (use it in a Decoder)")
        if options.gate and cfg.attention.num_mem_kv:
            found.append("attn_rfa_gate decays the keys of the sequence; attn_num_mem_kv keys have no place in that "
                         "order")
        return found

    def decay(self, k: Tensor) -> tuple[Tensor | None, Tensor | None]:
        if not self.decays:
            return None, None
        z = torch.einsum("bhjd,hd->bhj", k, self.gate_weight.to(k.dtype)) + self.gate_bias.to(k.dtype)[:, None]
        return -F.softplus(z), -F.softplus(-z)         # log(1 - g), log g


KERNELS = {"linear": KernelAttention, "performer": Performer, "rfa": Rfa}
