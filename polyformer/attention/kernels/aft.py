"""Attention Free Transformer (Zhai et al. 2021, arXiv:2105.14103), a kernel of form "direct":

    Y_t = σ(Q_t) ⊙ Σ_j exp(K_j + w_tj) ⊙ V_j / Σ_j exp(K_j + w_tj)      (elementwise over features)

over the keys j that query t sees (j <= t in a causal stack). The modes differ in the biases w:
"full" learns one per pair of positions (a T x T table for positions below `max_len`), "simple" has
none, "local" keeps the learned pairwise biases only where |t - j| < window (keys further away still
count, unbiased), and "conv" shares them across positions: per head a kernel over the offset t - j
(|t - j| < window; 0 <= t - j < window when causal), the paper's
conv(exp(K) ⊙ V, exp(w) - 1) + Σ exp(K) ⊙ V. Heads are a split of the features (AFT is elementwise);
only the conv kernel is per (key) head. Biases are read at the keys' and queries' positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import checks
from ...config import LayersConfig
from ...interfaces import KV, AttnOut, Caps, KernelSpec
from ...precision import upcast
from . import aft_core as core
from .dense import match_heads

MODES = ("full", "simple", "local", "conv")


@dataclass(frozen=True)
class AftOptions:
    mode: str                        # "full", "simple", "local" or "conv"
    window: int | None = None        # local / conv: keys with |t - j| < window carry a bias
    max_len: int | None = None       # full / local: the biases cover positions 0 .. max_len - 1


class Aft(nn.Module):
    """AFT-full / simple / local / conv on q (b, h, i, d), kv.k and kv.v (b, hk, j, d): the output
    (b, h, i, d). A decode state keeps every key (decode="keys"), for every mode."""

    caps = Caps(exact=True, bias=False, causal=True, bidirectional=True, padding=True, decode="keys",
                form="direct")
    options: type = AftOptions
    chunk = 32          # causal full form: queries in chunks of this many positions
    scan_chunk = 8      # causal prefix sums and causal window blocks: quadratic (x features) inside chunks this
                        # small (fastest, least memory at 4k: 8 -> 0.48 s fwd+bwd, 296 MiB against 1.18 s, 866 MiB
                        # with 32; conv, window 64, 128 positions: 8 beats 4 and 16 by 1.2-1.3x)

    def __init__(self, spec: KernelSpec):
        super().__init__()
        options = spec.options
        self.mode, self.window, self.max_len = options.mode, options.window or 0, options.max_len
        self.causal = spec.causal
        if self.mode in ("full", "local"):
            self.pair_bias = nn.Parameter(torch.zeros(options.max_len, options.max_len))   # w[t, j]
        if self.mode == "conv":
            taps = self.window if spec.causal else 2 * self.window - 1
            self.conv_bias = nn.Parameter(torch.zeros(spec.kv_heads, taps))      # w[head, offset]

    @staticmethod
    def check(options: AftOptions, cfg: LayersConfig) -> list[str]:
        mode = options.mode
        if mode not in MODES:
            return [f"attn_aft must be one of {', '.join(map(repr, MODES))}, got {mode!r}"]
        found = []
        if mode in ("local", "conv"):
            found += (checks.whole(options.window, "attn_aft_window") if options.window is not None else
                      [f"attn_aft={mode!r} needs attn_aft_window (its biases reach keys with |t - j| < window)"])
        elif options.window is not None:
            found.append(f"attn_aft_window sets the reach of attn_aft='local' / 'conv'; attn_aft={mode!r} has "
                         "no window")
        if mode in ("full", "local"):
            found += (checks.whole(options.max_len, "attn_aft_max_len") if options.max_len is not None else
                      [f"attn_aft={mode!r} needs attn_aft_max_len (its pairwise biases cover positions "
                       "0 .. attn_aft_max_len - 1)"])
        elif options.max_len is not None:
            found.append(f"attn_aft_max_len sizes the pairwise biases of attn_aft='full' / 'local'; "
                         f"attn_aft={mode!r} has none")
        if cfg.attention.collab_heads:
            found.append("attn_aft multiplies keys and values feature by feature; attn_collab_heads gives the "
                         "keys another size")
        if cfg.attention.dropout:
            found.append("attn_dropout drops attention weights; attn_aft forms none")
        return found

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        if need_weights:
            raise ValueError("return_attn cannot show attn_aft's attention: it weighs every feature on its "
                             "own, with no (i, j) matrix of weights")
        if self.max_len is not None:
            self.check_positions(q_pos, kv)
        dtype, i, free = q.dtype, q.shape[2], kv.free
        q, k, v = upcast(q), upcast(kv.k), upcast(kv.v)
        if kv.mask is not None:           # padded keys weigh nothing
            keep = F.pad(kv.mask, (free, 0), value=True)[:, None, :, None]
            k = k.masked_fill(~keep, float("-inf"))
        if self.mode == "simple" and not causal:
            num, den, _ = core.summary(k, v)
        elif self.mode == "full":
            num, den = core.pairwise(k, v, free, i, causal, self.biases(q_pos, kv, i), self.chunk)
        else:
            bias = self.biases(q_pos, kv, i) if self.mode != "simple" else None
            num, den = core.windowed(k, v, free, i, self.window, causal, bias, self.scan_chunk)
        out = match_heads(core.divide(num, den), q.shape[1])
        return AttnOut((torch.sigmoid(q) * out).to(dtype))

    def biases(self, q_pos: Tensor, kv: KV, i: int) -> core.Bias:
        """w for (query, key) index pairs, read at their positions: the queries are the last i of
        the positioned keys; free keys (index < 0) get 0, padded keys -inf."""
        n = kv.k.shape[2] - kv.free

        def bias(at: Tensor, u: Tensor) -> Tensor:
            free = u < 0
            u = u.clamp(min=0)
            qp, kp = q_pos[:, at - (n - i)][..., None], kv.pos[:, u]           # (b|1, i, 1), (b|1, i|1, S)
            w = self.table(qp, kp).masked_fill(free, 0.0)                 # (b|1, g|1, i, S)
            if kv.mask is not None:
                w = w.masked_fill(~kv.mask[:, u][:, None] & ~free, float("-inf"))
            return w

        return bias

    def table(self, qp: Tensor, kp: Tensor) -> Tensor:
        """The biases of queries at positions qp with keys at kp: (b|1, g|1, i, S)."""
        offset = qp - kp
        if self.mode == "conv":
            w = self.conv_bias
            index = offset if self.causal else offset + self.window - 1
            inside = (index >= 0) & (index < w.shape[1])
            w = w[:, index.clamp(0, w.shape[1] - 1)].movedim(0, 1)        # (b|1, g, i, S)
            return torch.where(inside[:, None], w, torch.zeros_like(w))
        top = self.max_len - 1
        w = self.pair_bias[qp.clamp(0, top), kp.clamp(0, top)][:, None]   # (b|1, 1, i, S)
        if self.mode == "local":
            w = torch.where((offset.abs() < self.window)[:, None], w, torch.zeros_like(w))
        return w

    def check_positions(self, q_pos: Tensor, kv: KV) -> None:
        """Positions of the kept queries and keys must have biases: 0 .. max_len - 1."""
        if checks.values_hidden():
            return
        pos, qp = kv.pos, q_pos
        if kv.mask is not None:
            pos = pos.expand_as(kv.mask)[kv.mask]
            qp = qp.expand(kv.mask.shape[0], -1)[kv.mask[:, -q_pos.shape[-1]:]]
        seen = torch.cat((pos.flatten(), qp.flatten()))
        if not seen.numel():
            return
        lo, hi = int(seen.min()), int(seen.max())
        if lo < 0 or hi >= self.max_len:
            raise ValueError(f"attn_aft_max_len={self.max_len}: attn_aft={self.mode!r} has position biases for "
                             f"positions 0 .. {self.max_len - 1}, got position {lo if lo < 0 else hi}; a longer "
                             "sequence needs a larger attn_aft_max_len")
