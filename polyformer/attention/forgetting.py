"""Forgetting Transformer (Lin et al. 2025, arXiv:2503.02130), x-transformers' attn_data_dependent_alibi: a
data-dependent ALiBi. Each head has a forget gate per token, f_t = σ(w · x_t + b), and query i's score of key j
gains

    bias_ij = s Σ_{t=j+1..i} log f_t = c_i - c_j,    c_i = s Σ_{t<=i} log f_t

(s: post_log_scale; b starts at bias_init = 5, gates near 1: little forgetting). In an Encoder (x-transformers'
bidirectional form) a second gate per head, g_t, weighs the keys after the query: bias_ij = s Σ_{t=i+1..j} log g_t.

per_row (x-transformers' PerRowDataDependentAlibi): token t's gate also reads the query, through a query / key
pair of per_row_dim_head (d') features: f_it = σ(q'_i · k'_t / √d'), bias_ij = s Σ_{t=j..i-1} log f_it (0 for
j >= i). Causal only, as theirs.

A padding token forgets nothing (its term is 0), so padding stays invisible to the tokens around it. The keys
are in time order and the queries are the last of them (XL memories and cached keys come first).

Decoding: c_i cancels in a softmax row but not under sigmoid attention, soft-capping or the z-loss, so the bias
is computed whole from every key's gate terms (log f_j, or k'_j). Each key carries them as extra features,
written to the decode state with it: rollback, reorder, clone, sliding and prompt caches keep them with no code
of their own. That is (heads / kv_heads) * w numbers per key and key head (w = 1; 2 in an Encoder; d' per row)
in the state's dtype; the uncached path rounds them to the keys' dtype too, so both see the same values. A step
sums the terms over its keys again: O(j) per head and query (O(j d') per row), beside attention's O(j d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .. import checks
from ..interfaces import KV, Context
from ..precision import upcast
from ..routes import Route
from .keys import self_source

if TYPE_CHECKING:
    from ..config import AttentionConfig, LayersConfig

KEYWORD = "attn_data_dependent_alibi"
KWARGS = ("bias_init", "post_log_scale")
BIAS_INIT, PER_ROW_DIM_HEAD = 5.0, 8          # x-transformers' defaults


@dataclass(frozen=True)
class ForgettingOptions:
    per_row: bool = False               # attn_data_dependent_alibi_per_row
    per_row_dim_head: int | None = None   # attn_data_dependent_alibi_per_row_dim_head; None: 8
    bias_init: float | None = None      # attn_data_dependent_alibi_kwargs' bias_init; None: 5
    post_log_scale: float = 1.0         # attn_data_dependent_alibi_kwargs' post_log_scale


@dataclass(frozen=True)
class ForgetKwargs(Route):
    """attn_data_dependent_alibi_kwargs=dict(bias_init=, post_log_scale=): each key written to its field beside
    `path` (one of them; the options need the switch keyword, like any other)."""

    def writes(self, arg: Any) -> dict[str, Any]:
        if not isinstance(arg, dict) or not set(arg) <= set(KWARGS):
            raise TypeError(f"expected a dict with keys among {list(KWARGS)}, got {arg!r}")
        section = self.path.rpartition(".")[0]
        return {f"{section}.{k}": v for k, v in arg.items()}


def _attention_problems(a: "AttentionConfig", cfg: "LayersConfig") -> list[str]:
    from ..position.relative import score_term_problems
    from .patterns.stage import keyword

    o: ForgettingOptions = a.forgetting
    found = checks.flag(o.per_row, f"{KEYWORD}_per_row")
    found += checks.whole(o.per_row_dim_head, f"{KEYWORD}_per_row_dim_head", optional=True)
    for name in KWARGS:
        value = getattr(o, name)
        if value is not None and not checks.number(value):
            found.append(f"{KEYWORD}_kwargs' {name} must be a finite number, got {value!r}")
    if o.per_row is not True and o.per_row_dim_head is not None:
        found.append(f"{KEYWORD}_per_row_dim_head is set but {KEYWORD}_per_row is not True")
    if o.per_row is True and o.bias_init is not None:
        found.append(f"{KEYWORD}_kwargs' bias_init has no use with {KEYWORD}_per_row=True: the per-row gates "
                     "have no bias (x-transformers' per-row class takes post_log_scale only)")
    if o.per_row is True and not cfg.causal:
        found.append(f"{KEYWORD}_per_row sums gates from a key up to its query: it needs causal attention (a "
                     "Decoder), as x-transformers'")
    found += score_term_problems(KEYWORD, a, cfg)
    if a.pattern:
        named = " / ".join(keyword(c.name) for c in a.pattern)
        found.append(f"{KEYWORD} cannot combine with {named}: a pattern's decode state keeps its keys out of "
                     "time order, which the gates' sums need")
    if cfg.early_exit is not None:
        found.append(f"{KEYWORD} cannot combine with exit_layers: an exit writes the skipped blocks' keys "
                     "without their gate terms")
    return found


def problems(cfg: "LayersConfig") -> list[str]:
    """What is wrong with the stack's forgetting-gate options, each naming the keywords."""
    return [p for a in cfg.self_attention if a.forgetting is not None for p in _attention_problems(a, cfg)]


class Forgetting(nn.Module):
    """The forget gates of one self-attention block and the score bias (b, h, i, j) they make."""

    def __init__(self, dim: int, heads: int, kv_heads: int, options: ForgettingOptions, causal: bool):
        super().__init__()
        self.heads, self.groups, self.causal = heads, heads // kv_heads, causal
        self.scale = float(options.post_log_scale)
        self.dim_gate = (options.per_row_dim_head or PER_ROW_DIM_HEAD) if options.per_row else None
        if self.dim_gate is not None:       # q' and k' of every head from one projection
            self.to_gates = nn.Linear(dim, 2 * heads * self.dim_gate, bias=False)
        else:                               # one gate per head; an Encoder's second for the keys after the query
            self.to_gates = nn.Linear(dim, heads * (1 if causal else 2))
            nn.init.constant_(self.to_gates.bias, BIAS_INIT if options.bias_init is None else options.bias_init)
        self.width = self.dim_gate or (1 if causal else 2)      # terms per key and head

    @property
    def columns(self) -> int:
        """Extra features per key and key head in a decode state."""
        return self.groups * self.width

    def key_terms(self, x: Tensor) -> Tensor:
        """x (b, m, dim) -> each key's terms (b, h, m, w): s log f (and s log g), or k'."""
        gates = self.to_gates(x)
        if self.dim_gate is not None:
            return rearrange(gates[..., self.heads * self.dim_gate:], "b m (h d) -> b h m d", h=self.heads)
        return rearrange(F.logsigmoid(upcast(gates)) * self.scale, "b m (w h) -> b h m w", h=self.heads)

    def forward(self, kv: KV, x: Tensor, ctx: Context, layer: int) -> tuple[KV, Tensor]:
        """The keys (through the decode state when decoding) and the bias (b, h, i, j - kv.free) of queries x."""
        if ctx.prefix_span is not None:
            raise ValueError(f"prefix_len cannot combine with {KEYWORD}: its bias is defined for keys up to the query")
        src = self_source(x, ctx, layer).x if ctx.state is None else x         # XL memories first
        terms = self.key_terms(src).to(kv.k.dtype)                              # (b, h, m, w)
        if ctx.state is not None:
            d = kv.k.shape[-1]
            packed = rearrange(terms, "b (hk g) m w -> b hk m (g w)", g=self.groups)
            kv = ctx.state.attend(layer, KV(torch.cat((kv.k, packed), -1), kv.v, kv.pos, kv.mask, kv.free))
            terms = rearrange(kv.k[..., d:], "b hk m (g w) -> b (hk g) m w", g=self.groups)
            kv = KV(kv.k[..., :d], kv.v, kv.pos, kv.mask, kv.free)
        return kv, self.bias(terms, x, kv.mask)

    def bias(self, terms: Tensor, x: Tensor, mask: Tensor | None) -> Tensor:
        """terms (b, h, m, w) of every key, mask (b, m) or None -> the bias (b, h, n, m) of the last n = x's."""
        n, m = x.shape[1], terms.shape[2]
        t = torch.arange(m, device=x.device)
        at = t[m - n:, None]                                                   # each query's index among the keys
        if self.dim_gate is not None:
            q = rearrange(self.to_gates(x)[..., :self.heads * self.dim_gate], "b n (h d) -> b h n d", h=self.heads)
            logits = upcast(q) @ upcast(terms).transpose(-1, -2) * self.dim_gate ** -0.5       # (b, h, n, m)
            keep = t < at if mask is None else (t < at) & mask[:, None, None, :]
            forget = (F.logsigmoid(logits) * self.scale).masked_fill(~keep, 0.0)
            return forget.flip(-1).cumsum(-1).flip(-1)                          # Σ_{t >= j}, t < i
        terms = upcast(terms)
        if mask is not None:
            terms = terms.masked_fill(~mask[:, None, :, None], 0.0)
        c = terms.cumsum(-2)                                                    # (b, h, m, w)
        before = c[..., m - n:, None, 0] - c[..., None, :, 0]                  # c_i - c_j
        if self.causal:
            return before
        after = c[..., None, :, 1] - c[..., m - n:, None, 1]                   # r_j - r_i
        return torch.where(t > at, after, before)


def build(dim: int, cfg: "AttentionConfig", kv_heads: int, causal: bool) -> Forgetting | None:
    """The block's forget gates when attn_data_dependent_alibi is on, else None."""
    return None if cfg.forgetting is None else Forgetting(dim, cfg.heads, kv_heads, cfg.forgetting, causal)
