"""Infini-attention (Munkhdalai et al. 2024, "Leave No Context Behind", arXiv:2404.07143), a kernel of form
"direct", causal only: causal softmax attention inside segments of N positions, and per key head a
compressive memory of every earlier segment read by linear attention, mixed by a learned per-head gate
(the algebra: `infini_core.py`). A decode state keeps the memory and the latest segment's keys: its size
does not grow with the tokens fed. A forward hands its memory to the next in the `Memories` record (`mems`;
memory/infini_carry.py), read here as a decode state's summary is."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import checks
from ...config import LayersConfig
from ...interfaces import KV, AttnOut, Caps, KernelSpec
from . import infini_core as core


@dataclass(frozen=True)
class InfiniOptions:
    segment: int = 2048             # N: positions per segment (the paper's language-modelling segments)
    delta: bool = False             # the delta rule: store only what the memory does not already retrieve


class Infini(nn.Module):
    """Infini-attention on q (b, h, i, d), kv.k (b, hk, j, d), kv.v (b, hk, j, dv): out (b, h, i, dv). Keys
    before the queries (memory key / values, XL memories) join every segment's local attention and never
    the compressive memory; padded keys join neither."""

    caps = Caps(exact=False, bias=False, causal=True, bidirectional=False, padding=True, decode="recurrent",
                form="direct")
    options: type = InfiniOptions

    def __init__(self, spec: KernelSpec):
        super().__init__()
        o: InfiniOptions = spec.options
        self.segment, self.delta, self.scale, self.dropout = o.segment, o.delta, spec.scale, spec.dropout
        self.gate = nn.Parameter(torch.zeros(spec.heads))       # β per head: sigmoid(β) weighs the memory

    @staticmethod
    def check(options: InfiniOptions, cfg: LayersConfig) -> list[str]:
        found = checks.whole(options.segment, "attn_infini_segment")
        found += checks.flag(options.delta, "attn_infini_delta")
        return found

    def forward(self, q: Tensor, kv: KV, *, q_pos: Tensor, causal: bool, memory: object | None,
                need_weights: bool) -> AttnOut:
        if need_weights:
            raise ValueError("return_attn cannot show attn_infini's attention: its memory keeps no keys to weigh")
        n = q.shape[2]
        pre = kv.k.shape[2] - n
        keep = None if kv.mask is None else kv.mask[:, -n:]
        prefix = None
        if pre:
            pkeep = None if kv.mask is None else F.pad(kv.mask[:, : pre - kv.free], (kv.free, 0), value=True)
            prefix = (kv.k[:, :, :pre], kv.v[:, :, :pre], pkeep)
        k, v = kv.k[:, :, pre:], kv.v[:, :, pre:]

        def run(lo: int, hi: int, start: core.Summary | None, want: bool) -> tuple[Tensor, core.Summary | None]:
            return core.infini(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], q_pos[:, lo:hi],
                               None if keep is None else keep[:, lo:hi], gate=self.gate, segment=self.segment,
                               scale=self.scale, delta=self.delta, dropout=self.dropout if self.training else 0.0,
                               prefix=prefix, start=start, want_state=want)

        if memory is None:
            return AttnOut(run(0, n, None, False)[0])
        # a decode step: the summary after the step, and after each of its last `wanted` positions (rollback)
        r = memory.wanted
        state, outs, trail = memory.summary, [], []
        for lo, hi in [(0, n - r)] * (n > r) + [(t, t + 1) for t in range(n - r, n)]:
            out, state = run(lo, hi, state, True)
            outs.append(out)
            if hi > n - r:
                trail.append(state)
        memory.write(state, {name: torch.stack([s[name] for s in trail], 1) for name in state} if trail else None)
        return AttnOut(torch.cat(outs, 2))
