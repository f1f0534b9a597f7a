"""What x-transformers 2.x does to attention scores, as two stages of the dense path.

`QKNorm`: cosine-similarity attention (query-key normalisation, arXiv:2010.04245): q and k are l2-normalised
(per group of features), the score scale becomes a fixed `qk_norm_scale`, or, with `qk_norm_dim_scale`, learned
per-feature scales (init d ** 0.25 each, so d ** 0.5 on the product) with the usual d ** -0.5 (arXiv:2302.05442).

`ScoreStage`, around the normaliser (scores (b, h, i, j) after scale, bias and residual scores):
pre-softmax talking heads (arXiv:2003.02436), tanh soft-capping s -> c tanh(s / c) (Gemma 2), sink logits (a
learned one per head, gpt-oss; a zero key with a zero value, "attention is off by one") that take weight and
give nothing, sigmoid attention w = sigmoid(s + b) (arXiv:2409.04431), post-softmax talking heads, and the
z-loss of the normaliser, mean over queries of sum over heads of (log sum_j exp s_ij) ** 2 (PaLM; ST-MoE).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks
from ..interfaces import KV
from ..losses import AuxLosses
from ..precision import upcast
from .hard_attention import keyword as normalizer_keyword
from . import topk_straight
from .mixing import TalkingHeads
from .normalize import fill_masked, zero_masked
from .gates import hybrid, problems as gate_problems
from .score_options import ScoreOptions

if TYPE_CHECKING:
    from ..config import AttentionConfig, LayersConfig

LOSS = "attn_z_loss"


def l2norm(t: Tensor, groups: int) -> Tensor:
    """(..., d) -> each of `groups` feature groups scaled to unit length, in at least float32."""
    g = upcast(t).unflatten(-1, (groups, -1))
    return F.normalize(g, dim=-1).flatten(-2).to(t.dtype)


class QKNorm(nn.Module):
    """Normalises q (b, h, i, d) and every key (b, hk, j, d) just before the kernel, after rotary and the key
    sources (memory key / values, the decode state), so cached keys are stored raw and normalised once per use.
    The kernel multiplies q.k by d ** -0.5; the queries carry the rest of the chosen scale."""

    def __init__(self, opts: ScoreOptions, heads: int, kv_heads: int, dim: int):
        super().__init__()
        self.groups = opts.qk_norm_groups
        self.q_scale = self.k_scale = None
        if opts.qk_norm_dim_scale:
            self.q_scale = nn.Parameter(torch.full((heads, 1, dim), dim ** 0.25))
            self.k_scale = nn.Parameter(torch.full((kv_heads, 1, dim), dim ** 0.25))
        self.factor = 1.0 if opts.qk_norm_dim_scale else opts.qk_norm_scale * dim ** 0.5

    def forward(self, q: Tensor, kv: KV) -> tuple[Tensor, KV]:
        q, k = l2norm(q, self.groups), l2norm(kv.k, self.groups)
        if self.q_scale is not None:
            q, k = q * self.q_scale.to(q.dtype), k * self.k_scale.to(k.dtype)
        return q * self.factor, replace(kv, k=k)


class ScoreStage(nn.Module):
    """The normaliser with the score transforms around it: (scores (b, h, i, j), keep-mask) -> weights."""

    fusable = False     # the fused kernels compute plain softmax attention

    def __init__(self, opts: ScoreOptions, heads: int, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.pre_mix = TalkingHeads(heads) if opts.pre_talking_heads else None
        self.post_mix = TalkingHeads(heads) if opts.post_talking_heads else None
        self.clamp = opts.softclamp_value if opts.softclamp else None
        self.sink = nn.Parameter(torch.zeros(heads)) if opts.head_sink else None
        self.zero_kv = opts.zero_kv
        self.sigmoid_bias = opts.sigmoid_bias if opts.sigmoid else None
        self.z_weight = opts.z_loss_weight
        self.loss_names = (LOSS,) if self.z_weight > 0 else ()
        self.losses: AuxLosses | None = None     # where the z-loss goes: the forward's, set by `bind`

    def sinks(self, scores: Tensor) -> Tensor | None:
        """(b, h, i, s) the sink logits, learned sink first, or None."""
        cols = [self.sink.to(scores.dtype)[:, None, None]] if self.sink is not None else []
        cols += [scores.new_zeros(scores.shape[1], 1, 1)] if self.zero_kv else []
        if not cols:
            return None
        return torch.cat(cols, dim=-1).expand(scores.shape[0], -1, scores.shape[2], -1)

    def forward(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        if self.pre_mix is not None:
            scores = self.pre_mix(scores)
        if self.clamp is not None:
            scores = torch.tanh(scores / self.clamp) * self.clamp
        if self.sigmoid_bias is not None:
            weights = zero_masked(torch.sigmoid(upcast(scores) + self.sigmoid_bias), mask).to(scores.dtype)
        else:
            sinks = self.sinks(scores)
            if sinks is not None:
                s = sinks.shape[-1]
                scores = torch.cat((sinks, scores), dim=-1)
                mask = F.pad(mask, (s, 0), value=True) if mask is not None else None
            if self.z_weight > 0 and self.losses is not None:
                self.losses.report(LOSS, z_loss(scores, mask), self.z_weight)
                self.losses = None
            weights = self.inner(scores, mask)
            weights = weights[..., sinks.shape[-1]:] if sinks is not None else weights
        if self.post_mix is not None:
            weights = self.post_mix(weights)
        return weights


def z_loss(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Mean over (batch, query) of the sum over heads of (logsumexp of the kept scores) ** 2; a query that
    keeps no key adds nothing."""
    s = upcast(scores)
    lse = fill_masked(s, mask).logsumexp(dim=-1)                         # (b, h, i)
    if mask is not None:
        lse = lse.masked_fill(~mask.expand_as(s).any(dim=-1), 0.0)
    return lse.square().sum(dim=1).mean()


def stage(opts: ScoreOptions | None, heads: int, normalize: nn.Module) -> ScoreStage | None:
    """The score stage around `normalize`, or None when no score option is on."""
    if opts is None:
        return None
    on = (opts.pre_talking_heads or opts.post_talking_heads or opts.softclamp or opts.head_sink or opts.zero_kv
          or opts.sigmoid or opts.z_loss_weight > 0)
    return ScoreStage(opts, heads, normalize) if on else None


def normalizer(cfg: "AttentionConfig") -> nn.Module:
    """The block's normalise stage: registry.NORMALIZE's choice with its options (attn_sparse_topk's k,
    attn_gumbel_softmax's), its straight-through gradient (topk_straight.py), the score stage around it."""
    from ..registry import NORMALIZE

    build = NORMALIZE[cfg.normalize].build
    inner = build(cfg.topk) if cfg.normalize == "topk" else build(cfg.gumbel) if cfg.gumbel is not None else build()
    inner = topk_straight.wrap(inner, cfg)
    return stage(cfg.scores, cfg.heads, inner) or inner


def qk_norm(opts: ScoreOptions | None, heads: int, kv_heads: int, dim: int) -> QKNorm | None:
    return QKNorm(opts, heads, kv_heads, dim) if opts is not None and opts.qk_norm else None


def bind(kernel: nn.Module, losses: AuxLosses) -> None:
    """Point the kernel's score stage (if any) at this forward's auxiliary losses."""
    normalize = getattr(kernel, "normalize", None)
    if isinstance(normalize, ScoreStage):
        normalize.losses = losses


# --- checks ----------------------------------------------------------------------------------------------------

SWITCHES = {"qk_norm": ("qk_norm_groups", "qk_norm_scale", "qk_norm_dim_scale"), "sigmoid": ("sigmoid_bias",),
            "softclamp": ("softclamp_value",), "output_gate": ("output_gate_headwise", "output_gate_rank")}
SCORE_FIELDS = ("qk_norm", "sigmoid", "softclamp", "head_sink", "zero_kv", "pre_talking_heads",
                "post_talking_heads", "z_loss_weight")     # what needs the dense kernel's score matrix


def keyword(field: str) -> str:
    from ..keywords import writing

    return writing(f"attention.scores.{field}")[0]


def problems(cfg: "LayersConfig") -> list[str]:
    """What the score options cannot be, naming their keywords."""
    found: list[str] = []
    for a in dict.fromkeys(cfg.self_attention):
        found += _problems(a, cfg) if a.scores is not None else []
    return found


def _problems(a: Any, cfg: "LayersConfig") -> list[str]:
    o, default = a.scores, ScoreOptions()
    found = [f"{' / '.join(keyword(f) for f in opts if getattr(o, f) != getattr(default, f))} "
             f"need(s) {keyword(switch)}=True" for switch, opts in SWITCHES.items()
             if not getattr(o, switch) and any(getattr(o, f) != getattr(default, f) for f in opts)]
    found += [p for f in ("qk_norm", "qk_norm_dim_scale", "sigmoid", "softclamp", "head_sink", "zero_kv",
                          "pre_talking_heads", "post_talking_heads", "gate_value_heads", "output_gate",
                          "output_gate_headwise", "gate_values_headwise", "swiglu_values", "low_rank_silu_gates")
              for p in checks.flag(getattr(o, f), keyword(f))]
    found += checks.whole(o.qk_norm_groups, "attn_qk_norm_groups")
    found += gate_problems(a, cfg.dim)
    if o.qk_norm and not found and (a.dim_head % o.qk_norm_groups or a.dim_head // o.qk_norm_groups < 2):
        found.append(f"attn_qk_norm_groups must divide attn_dim_head ({a.dim_head}) into groups of at least 2 "
                     f"features, got {o.qk_norm_groups}")
    for name, value in (("attn_qk_norm_scale", o.qk_norm_scale), ("attn_logit_softclamp_value", o.softclamp_value)):
        if not checks.number(value) or value <= 0:
            found.append(f"{name} must be a number > 0, got {value!r}")
    if not checks.number(o.sigmoid_bias):
        found.append(f"attn_sigmoid_bias must be a finite number, got {o.sigmoid_bias!r}")
    if not checks.number(o.z_loss_weight) or o.z_loss_weight < 0:
        found.append(f"attn_z_loss_weight must be a number >= 0, got {o.z_loss_weight!r}")
    if o.max_attend_past is not None and not cfg.causal:
        found.append("attn_max_attend_past limits the keys behind a query, a causal window (attn_window = M + 1): "
                     "it needs a causal stack (a Decoder); on an Encoder use attn_window")
    if found:
        return found
    on = [keyword(f) if f != "z_loss_weight" else "attn_z_loss_weight" for f in SCORE_FIELDS if getattr(o, f)]
    if o.sigmoid:
        if a.normalize != "softmax":
            other = normalizer_keyword(a.normalize)
            found.append(f"attn_sigmoid and {other} conflict: each chooses how scores become weights; choose one")
        clash = [keyword(f) for f in ("head_sink", "zero_kv") if getattr(o, f)]
        clash += ["attn_z_loss_weight"] if o.z_loss_weight > 0 else []
        if clash:
            found.append(f"attn_sigmoid has no normaliser, so {' / '.join(clash)} would do nothing; drop it")
    if a.talking_heads and (o.pre_talking_heads or o.post_talking_heads):
        found.append("attn_talking_heads=True is attn_pre_talking_heads and attn_post_talking_heads together; "
                     "give one spelling")
    replaced = (f"the mixer {cfg.mixer.name!r}" if cfg.mixer is not None else
                f"the attention kernel {a.kernel.name!r}" if a.kernel.name != "dense" else None)
    gates = [keyword(f) for f in ("gate_value_heads", "output_gate") if getattr(o, f)]
    gates += ["attn_gate_values (as the fused gate's input)"] if a.gate_values and hybrid(a) else []
    if replaced is not None and on + gates:
        found.append(f"{' / '.join(on + gates)} act(s) on dense attention; {replaced} replaces it")
    unfused = [k for k in on if k != keyword("qk_norm")]       # qk_norm only changes q and k
    if a.fused is True and unfused:
        found.append(f"attn_flash=True asks for the fused kernel, which cannot run {' / '.join(unfused)}")
    return found
