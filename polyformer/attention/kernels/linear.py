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


def _positive(value: object, keyword: str) -> list[str]:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        return [f"{keyword} must be a positive integer, got {value!r}"]
    return []


class KernelAttention(nn.Module):
    """out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j) over the keys query i sees (all of them, or
    j <= i in a causal stack), computed without the (i, j) matrix."""

    caps = Caps(exact=True, bias=False, causal=True, bidirectional=True, padding=True, decode="recurrent",
                form="direct")
    options: type = LinearOptions

    def __init__(self, spec: KernelSpec):
        super().__init__()
        self.heads = spec.heads
        self.chunk = spec.options.chunk if spec.options is not None else 64
        self.feature = self.feature_map(spec, spec.options)

    def feature_map(self, spec: KernelSpec, options: LinearOptions) -> nn.Module:
        return Elementwise(options.feature)

    @staticmethod
    def check(options: LinearOptions, cfg: LayersConfig) -> list[str]:
        found = []
        if options.feature not in ("elu", "relu"):
            found.append(f"attn_linear must be 'elu' or 'relu', got {options.feature!r}")
        return found + _positive(options.chunk, "attn_linear_chunk")

    def decay(self, k: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """(log-weight added per key, log-decay per position) of a gate; (None, None) without one."""
        return None, None

    def terms(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """(ψ(q), ψ(k), a, v, log-decay) of queries (b, h, i, d) and keys (b, hk, j, d), every key head
        repeated for its query heads; keep (b, j) bool marks the keys that are not padding."""
        fq, fk, a = self.feature(q, k)
        added, decay = self.decay(k)
        if added is not None:
            a = a + added
        if keep is not None:              # padded keys weigh nothing, and a gate does not close on them
            a = a.masked_fill(~keep[:, None, :], float("-inf"))
            decay = None if decay is None else decay.masked_fill(~keep[:, None, :], 0.0)
        h = q.shape[1]
        a = match_heads(a[..., None], h)[..., 0]
        decay = None if decay is None else match_heads(decay[..., None], h)[..., 0]
        return fq, match_heads(fk, h), a, match_heads(v, h), decay

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        dtype, eps = q.dtype, self.feature.eps
        q, k, v = upcast(q), upcast(kv.k), upcast(kv.v)
        keep = None if kv.mask is None else F.pad(kv.mask, (kv.free, 0), value=True)
        # without autograd, runs of positions one after another (exact: summaries combine, and a causal
        # summary carries over), so features and chunks of one run only are held at a time
        run = q.shape[2] if torch.is_grad_enabled() else self.chunk * RUN_CHUNKS
        if not causal and not need_weights:
            summary = None
            for lo in range(0, k.shape[2], run):
                _, fk, a, vr, _ = self.terms(q[:, :, :0], k[:, :, lo:lo + run], v[:, :, lo:lo + run],
                                             None if keep is None else keep[:, lo:lo + run])
                part = core.summarise(fk, a, vr)
                summary = part if summary is None else core.combine(summary, part)
            outs = [core.read(self.terms(q[:, :, lo:lo + run], k[:, :, :0], v[:, :, :0], None)[0], summary, eps)
                    for lo in range(0, q.shape[2], run)]
            return AttnOut(torch.cat(outs, 2).to(dtype))
        if need_weights:
            fq, fk, a, v, decay = self.terms(q, k, v, keep)
            if memory is not None:
                raise ValueError("return_attn cannot show a recurrent decode state's attention (it keeps no keys)")
            out, weights = core.quadratic(fq, fk, a, v, decay, eps, causal=causal)
            return AttnOut(out.to(dtype), weights=weights.to(dtype))
        n = q.shape[2]
        pre = k.shape[2] - n               # keys every query sees (memory key / values, XL memories)
        prefix = None
        if pre:
            if hasattr(self, "gate_weight"):
                raise ValueError("attn_rfa_gate decays the keys of the sequence; keys before it (XL memories) have "
                                 "no place in that order")
            _, fk, a, vp, _ = self.terms(q[:, :, :0], k[:, :, :pre], v[:, :, :pre], None if keep is None else keep[:, :pre])
            prefix = core.summarise(fk, a, vp)
        state = memory.summary if memory is not None else None
        trail = memory.wanted if memory is not None else 0
        outs = []
        for lo in range(0, n, run):
            hi = min(lo + run, n)
            fq, fk, a, vr, decay = self.terms(q[:, :, lo:hi], k[:, :, pre + lo:pre + hi], v[:, :, pre + lo:pre + hi],
                                              None if keep is None else keep[:, pre + lo:pre + hi])
            out, state, trailing = core.chunked(fq, fk, a, vr, decay=decay, start=state, chunk=self.chunk,
                                                prefix=prefix, trail=trail if hi == n else 0, eps=eps)
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
        if not isinstance(options.redraw, int) or isinstance(options.redraw, bool) or options.redraw < 0:
            found.append(f"attn_performer_redraw must be an integer >= 0 (0: never), got {options.redraw!r}")
        return found + _positive(options.features, "attn_performer_features") + _positive(options.chunk,
                                                                                          "attn_performer_chunk")


class Rfa(KernelAttention):
    """Random Feature Attention: random Fourier features with a learned σ; RFA-Gate decays the summary
    by g_t = σ(w·k_t + b) per head (the gate reads the head's key, a linear function of the input):
    S_t = g_t S_(t-1) + (1 - g_t) φ(k_t) v_tᵀ, and alike for Σ φ(k)."""

    caps = Caps(exact=False, bias=False, causal=True, bidirectional=True, padding=True, decode="recurrent",
                form="direct", tolerance=0.1)
    options = RfaOptions

    def __init__(self, spec: KernelSpec):
        super().__init__(spec)
        options = spec.options if spec.options is not None else RfaOptions()
        if options.gate:
            self.gate_weight = nn.Parameter(torch.zeros(spec.kv_heads, spec.dim_qk))
            self.gate_bias = nn.Parameter(torch.full((spec.kv_heads,), 2.0))     # starts near g = 0.88

    def feature_map(self, spec: KernelSpec, options: RfaOptions) -> nn.Module:
        m = options.features if options.features is not None else spec.dim_qk
        return Fourier(spec.dim_qk, spec.kv_heads, m, options.seed, spec.layer)

    @staticmethod
    def check(options: RfaOptions, cfg: LayersConfig) -> list[str]:
        found = _positive(options.features, "attn_rfa_features") + _positive(options.chunk, "attn_rfa_chunk")
        if options.gate and not cfg.causal:
            found.append("attn_rfa_gate decays a causal summary; an Encoder has none (use it in a Decoder)")
        if options.gate and cfg.attention.num_mem_kv:
            found.append("attn_rfa_gate decays the keys of the sequence; attn_num_mem_kv keys have no place in that "
                         "order")
        return found

    def decay(self, k: Tensor) -> tuple[Tensor | None, Tensor | None]:
        if not hasattr(self, "gate_weight"):
            return None, None
        z = torch.einsum("bhjd,hd->bhj", k, self.gate_weight.to(k.dtype)) + self.gate_bias.to(k.dtype)[:, None]
        return -F.softplus(z), -F.softplus(-z)         # log(1 - g), log g


KERNELS = {"linear": KernelAttention, "performer": Performer, "rfa": Rfa}
