"""FLASH's gated attention unit (Hua et al. 2022, "Transformer Quality in Linear Time",
arXiv:2202.10447): one block that is attention and feedforward at once, so a stack of them replaces
both (`replaces_feedforward`). With U = φ(X W_u), V = φ(X W_v) of size e = expansion · dim, Z = φ(X W_z)
of size s (φ = SiLU), and Q, K per-dimension scales and offsets of Z (rotated when rotary_pos_emb=True):

    A_ij = relu²(Q_i·K_j / N_i),    O = (U ⊙ A V) W_o

over the keys j query i sees (j ≤ i in a Decoder; kept keys only). The paper's pseudo-code divides the
scores by the length n inside relu²; N_i, the count of keys query i sees, is that n in an unpadded
Encoder and, unlike n, known to a decoder at every step. No further score scale, as in the paper.
gau_chunk switches to FLASH's mixed chunk attention (gau_chunked.py). The paper's relative position
bias is not carried (rel_pos_bias is refused); rotary_pos_emb gives the positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks
from ..config import LayersConfig
from ..interfaces import AttnOut, Caps, Context
from ..position.rotary import Rotary
from ..precision import upcast
from . import gau_chunked as chunked


@dataclass(frozen=True)
class GauOptions:
    chunk: int | None = None        # mixed chunk attention with chunks of this many positions; None: one quadratic
    qk_dim: int = 128               # s, the size of the shared query / key representation Z
    expansion: float = 2            # e = expansion · dim, the size of U and V


# attention fields the unit has no use for (the stack's others are refused in attention/kernels/direct.py)
_UNUSED = ("num_mem_kv", "kv_heads", "dropout", "collab_heads", "collab_compression", "on_attn", "gate_values",
           "qkv_bias", "out_bias")


def width(dim: int, expansion: float) -> int:
    """e, the size of U and V."""
    return int(round(expansion * dim))


def quadratic(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, k_mask: Tensor | None,
              causal: bool) -> tuple[Tensor, Tensor]:
    """q (b, i, s), k (b, j, s), v (b, j, e), positions (b|1, i) and (b|1, j), k_mask (b, j) bool ->
    (A V (b, i, e), A (b, i, j)) with A_ij = relu²(q_i·k_j / N_i) over the kept keys (pos_j <= pos_i if causal)."""
    seen = k_mask[:, None, :] if k_mask is not None else torch.ones(1, 1, k.shape[1], dtype=torch.bool, device=q.device)
    if causal:
        seen = seen & (k_pos[:, None, :] <= q_pos[:, :, None])
    seen = seen.expand(q.shape[0], q.shape[1], k.shape[1])
    count = seen.sum(-1, keepdim=True).clamp(min=1)
    weights = torch.where(seen, F.relu(q @ k.transpose(-1, -2) / count).square(), 0.0)
    return weights @ v, weights


class GatedAttentionUnit(nn.Module):
    """A gated attention unit: single-head relu² attention gating an expanded SiLU branch."""

    options = GauOptions
    # decode: "keys" unchunked; a chunked unit keeps a recurrent summary instead (`decode_kind`)
    caps = Caps(exact=True, bias=False, causal=True, bidirectional=True, padding=True, decode="keys", form="direct",
                memories=False)
    replaces_feedforward = True

    def __init__(self, dim: int, cfg: LayersConfig, layer: int = 0):
        super().__init__()
        options: GauOptions = cfg.mixer.options
        self.layer, self.causal, self.chunk = layer, cfg.causal, options.chunk
        self.qk_dim = s = options.qk_dim
        self.expand = e = width(dim, options.expansion)
        self.hidden = nn.Linear(dim, 2 * e + s)          # [U, V, Z] before φ
        parts = 2 if options.chunk is None else 4        # Q, K; or quadratic Q, K and linear Q, K
        self.gamma = nn.Parameter(torch.ones(parts, s))
        self.beta = nn.Parameter(torch.zeros(parts, s))
        self.out = nn.Linear(e, dim)
        a = cfg.attention
        self.rotary = (Rotary(s, a.rotary_dim, a.rotary_base, a.rotary_interleaved, a.rotary_interpolation,
                              a.rotary_llama3) if a.position == "rotary" else None)

    @staticmethod
    def check(options: GauOptions, cfg: LayersConfig) -> list[str]:
        from ..attention.kernels.direct import changed

        found = checks.whole(options.chunk, "gau_chunk", optional=True) + checks.whole(options.qk_dim, "gau_qk_dim")
        x = options.expansion
        if not checks.number(x) or x <= 0 or width(cfg.dim, x) < 1:
            found.append(f"gau_expansion must be a number > 0 with expansion · dim >= 1, got {x!r}")
        if cfg.custom_layers is not None or cfg.macaron or cfg.sandwich_coef:
            found.append("gau stacks gated attention units alone (each is attention and feedforward in one): it "
                         "cannot combine with custom_layers / macaron / sandwich_coef")
        if cfg.cross_attend or cfg.only_cross:
            found.append("gau stacks gated attention units alone: it has no cross-attention block for "
                         "cross_attend / only_cross")
        a = cfg.attention
        ff = changed("ff", cfg.ff, vars(cfg.ff))
        if ff:
            found.append(f"gau replaces the feedforward blocks: {' / '.join(ff)} would do nothing")
        unused = changed("attention", a, _UNUSED)
        if unused:
            found.append(f"gau has one head of its own: {' / '.join(unused)} would do nothing with it")
        if a.position not in ("none", "rotary"):
            found.append("gau takes its positions from rotary_pos_emb only: position_infused_attn does nothing with it")
        r = a.rotary_dim or options.qk_dim
        if a.position == "rotary" and not checks.whole(options.qk_dim, "") and (r % 2 or r > options.qk_dim):
            found.append(f"rotary_pos_emb=True with gau rotates up to gau_qk_dim={options.qk_dim} features, an even "
                         f"number of them (rotary_emb_dim), got {r}")
        return found

    @property
    def decode_kind(self) -> str:
        """Quadratic: every key ("keys"); chunked: the summary of gau_chunked.py ("recurrent")."""
        return "keys" if self.chunk is None else "recurrent"

    @property
    def decode_dims(self) -> tuple[int, int, int, int]:
        """(key heads, key size, value heads, value size) of a "keys" decode state."""
        return 1, self.qk_dim, 1, self.expand

    def forward(self, x: Tensor, ctx: Context, prev_scores: Tensor | None = None) -> AttnOut:
        """x (b, n, dim) -> AttnOut(out=(b, n, dim), weights=(b, 1, i, j) when asked, quadratic form only)."""
        if ctx.mems is not None:
            raise ValueError("gau attends within the segment: it cannot take XL memories (mems)")
        if ctx.prefix_span is not None:
            raise ValueError("prefix_len cannot combine with gau")
        if ctx.need_weights and self.chunk is not None:
            raise ValueError("return_attn=True: gau_chunk reaches other chunks through linear attention and forms "
                             "no attention weights to return")
        hidden = self.hidden(x)
        grad = torch.is_grad_enabled() and hidden.requires_grad      # else φ in place: one (b, n, 2e + s) buffer
        u, v, z = F.silu(hidden, inplace=not grad).split((self.expand, self.expand, self.qk_dim), -1)
        parts = list((upcast(z)[..., None, :] * self.gamma + self.beta).unbind(-2))     # each (b, n, s)
        if self.rotary is not None:
            for i in range(0, len(parts), 2):
                q, k = self.rotary(parts[i][:, None], parts[i + 1][:, None], ctx.pos, ctx.pos)
                parts[i], parts[i + 1] = q[:, 0], k[:, 0]
        weights = None
        if self.chunk is None:
            out, weights = self.attend(parts[0], parts[1], upcast(v), ctx)
        else:
            out = self.mixed(*parts, upcast(v), ctx)
        y = self.out(u * out.to(u.dtype))
        return AttnOut(y, weights=weights[:, None].to(y.dtype) if ctx.need_weights else None)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
        """The quadratic form over this step's keys and, while decoding, every cached one."""
        k_pos, k_mask = ctx.pos, ctx.mask
        if ctx.state is not None:
            state = ctx.state
            k, v = (t[:, 0] for t in state.write(self.layer, k[:, None], v[:, None]))
            end = state.length + state.pending
            k_pos, k_mask = state.pos[:, :end], state.mask[:, :end] if state.padded else None
        return quadratic(q, upcast(k), upcast(v), ctx.pos, k_pos, k_mask, self.causal)

    def mixed(self, qq: Tensor, kq: Tensor, ql: Tensor, kl: Tensor, v: Tensor, ctx: Context) -> Tensor:
        """Mixed chunk attention; while decoding, from and into the block's recurrent summary."""
        if ctx.state is not None:
            return chunked.decode(qq, ql, kq, kl, v, ctx.pos, ctx.mask, self.chunk, ctx.state.recurrent(self.layer))
        return chunked.mixed_chunk(qq, ql, kq, kl, v, ctx.pos, ctx.mask, self.chunk, self.causal)[0]
