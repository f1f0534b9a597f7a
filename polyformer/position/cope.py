"""Contextual position encoding, CoPE (Golovneva et al. 2024, arXiv:2405.18719).

Positions are counted by the context: gates g_it = σ(q_i · k_t / √d) over the keys a query sees, the
position of key j for query i is p_ij = Σ_{t=j..i} g_it (clamped to max_pos - 1), and the score gains
q_i · e[p_ij], e a learned table of max_pos embeddings interpolated between its integer rows:

    e_ij = q_i · k_j / √d + (1 - f) q_i · e[⌊p_ij⌋] + f q_i · e[⌈p_ij⌉],   f = p_ij - ⌊p_ij⌋.

The keys a query sees are those at earlier or equal positions and kept by the block's mask (padding,
pattern); keys without a position (memory key / values) get no term and count no gate. Causal only, as
the paper. soft_onehot: e_ij = Σ_p softmax_p(-|p_ij - p| / 0.05) q_i · e[p] instead of the interpolation;
talking_heads: the gates read the scores mixed across heads by a learned (h, h) matrix (identity at init).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import checks
from ..config import LayersConfig
from ..interfaces import KV, AttnOut
from ..precision import upcast
from .relative import RelativeStage, pad_free

SOFT_ONEHOT_TEMPERATURE = 0.05


@dataclass(frozen=True)
class CopeOptions:
    max_pos: int = 16                   # attn_cope_max_pos: rows of the position table
    soft_onehot: bool = False           # attn_cope_soft_onehot_pos
    talking_heads: bool = False         # attn_cope_talking_heads


def counted(gates: Tensor, k_pos: Tensor) -> Tensor:
    """p_ij = Σ_t gates_it over the keys t at positions >= key j's: gates (b, h, i, j), k_pos (b|1, j). Keys
    need not be stored in position order (a decode state's window ring)."""
    order = k_pos.argsort(dim=-1, stable=True)[:, None, None, :].expand_as(gates)
    ahead = torch.take_along_dim(gates, order, dim=-1).flip(-1).cumsum(-1).flip(-1)
    return torch.empty_like(ahead).scatter_(-1, order, ahead)


class CopeRelative(RelativeStage):
    """CoPE's term on q (b, h, i, d) and keys (b, hk, j, d); the position table is the block's own."""

    def __init__(self, options: CopeOptions, *, dim: int, heads: int, dim_head: int,
                 shared: nn.Module | None = None):
        super().__init__()
        self.max_pos = options.max_pos
        self.soft_onehot = options.soft_onehot
        self.pos_emb = nn.Parameter(torch.zeros(options.max_pos, dim_head))     # CoPE starts as no position
        self.talking = nn.Parameter(torch.eye(heads)) if options.talking_heads else None

    @staticmethod
    def check(options: CopeOptions, cfg: LayersConfig) -> list[str]:
        found = checks.whole(options.max_pos, "attn_cope_max_pos")
        found += checks.flag(options.soft_onehot, "attn_cope_soft_onehot_pos")
        found += checks.flag(options.talking_heads, "attn_cope_talking_heads")
        if not cfg.causal:
            found.append("attn_use_cope counts the keys from a key up to its query: it needs causal attention "
                         "(a Decoder)")
        return found

    def visible(self, kv: KV, q_pos: Tensor, mask: Tensor | None) -> Tensor:
        """(b|1, 1|h, i, j - free) bool: the positioned keys each query sees."""
        seen = (kv.pos[..., None, :] <= q_pos[..., :, None])[:, None]
        if kv.mask is not None:
            seen = seen & kv.mask[:, None, None, :]
        return seen if mask is None else seen & mask[..., kv.free:]

    def cope_terms(self, q: Tensor, kv: KV, q_pos: Tensor, scale: float, mask: Tensor | None) -> Tensor:
        """The term q_i · e[p_ij], (b, h, i, j) in float32, zero for free and unseen keys."""
        from ..attention.kernels.dense import match_heads

        seen = self.visible(kv, q_pos, mask)
        qf = upcast(q)
        scores = qf @ upcast(match_heads(kv.k[:, :, kv.free:], q.shape[1])).transpose(-1, -2) * scale
        if self.talking is not None:
            scores = torch.einsum("gh,bhij->bgij", upcast(self.talking), scores.masked_fill(~seen, 0.0))
        gates = torch.sigmoid(scores).masked_fill(~seen, 0.0)
        pos = counted(gates, kv.pos).clamp(max=self.max_pos - 1)                     # p_ij, (b, h, i, j)
        per_row = qf @ upcast(self.pos_emb).t()                                         # q_i · e[p], (b, h, i, P)
        if self.soft_onehot:
            rows = torch.arange(self.max_pos, device=q.device, dtype=pos.dtype)
            weights = torch.softmax(-(pos[..., None] - rows).abs() / SOFT_ONEHOT_TEMPERATURE, dim=-1)
            terms = (weights * per_row[..., None, :]).sum(-1)
        else:
            low = pos.floor()
            frac = pos - low
            below = torch.take_along_dim(per_row, low.long(), dim=-1)
            terms = (1 - frac) * below + frac * torch.take_along_dim(per_row, pos.ceil().long(), dim=-1)
        return pad_free(terms.masked_fill(~seen, 0.0), kv.free)

    def forward(self, kernel: nn.Module, q_pos: Tensor, q: Tensor, kv: KV, *, mask: Tensor | None,
                bias: Tensor | None, causal: bool, prev_scores: Tensor | None, need_weights: bool) -> AttnOut:
        """The dense `kernel` with CoPE's term added to `bias`; the gates see what `mask` keeps."""
        extra = self.cope_terms(q, kv, q_pos, kernel.scale, mask)
        bias = extra if bias is None else bias + extra
        return kernel(q, kv, mask=mask, bias=bias, causal=causal, prev_scores=prev_scores, need_weights=need_weights)
