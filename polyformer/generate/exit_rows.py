"""The early-exit walk of one decoding step over the default decode plan's rows (`rows.Rows`).

`ExitRows` runs the plan's blocks layer by layer on its residual rows (b, dim): per block the same call
`Rows` makes, so a step where no row exits is the plain step's arithmetic, and after each exit layer the
confidence of every row, read off the row buffer (softmax_margin: the shared head's logits of the rows;
state_change: the cosine with the previous exit layer's rows; classifier: the exit's logistic classifier).
A row that exits is held: after every later block its row is set back to the state it exited with, so the
blocks that still run for other rows write its keys / values from that state (CALM's state propagation),
as the module path's walk does (`EarlyExit.walk`). Once every row has exited, the remaining layers run only
their key / value products (the q|k|v weight's key and value columns, over the same layout), the rotation
of the keys and the cache writes; their attention and feedforward are skipped.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ..early_exit import EarlyExit
from ..memory.kv_cache import DecodeState
from ..position.rotary import Rotary
from .plan import DecodeLayout
from .rows import Rows, _Attention, _weight

Confidence = Callable[[Tensor, Tensor, int], list[float]]


def key_rotation(position: Callable | None) -> Callable[[Tensor, Tensor], Tensor] | None:
    """(keys (b, hk, 1, d), positions (b, 1)) -> the keys as the block's position stage (its bound forward)
    turns them: `Rotary.rotate` of the keys alone, else the stage's own call with the keys as the queries."""
    if position is None:
        return None
    stage = getattr(position, "__self__", None)
    if type(stage) is Rotary:
        return stage.rotate
    return lambda k, pos: position(k, k, pos, pos)[1]


class _Keys:
    """A self-attention block's keys / values of held rows written to the cache, nothing else of it."""

    def __init__(self, blk: _Attention, layout: DecodeLayout | None):
        self.blk, module, qd = blk, blk.block.modules["qkv"], blk.cuts[0]
        if type(module) is nn.Linear:
            weight, bias = _weight(module, layout), module.bias
            kv_bias = bias[qd:] if bias is not None else None
            self.kv: Callable[[Tensor, Tensor], Tensor] | None = (
                (lambda x, out: torch.addmm(kv_bias, x, weight()[:, qd:], out=out)) if kv_bias is not None
                else (lambda x, out: torch.mm(x, weight()[:, qd:], out=out)))
        else:                               # a quantized or re-laid-out projection: its whole q|k|v
            self.kv = None
        self.rotate = key_rotation(blk.position)

    def __call__(self, res: Tensor, pos: Tensor, new_k: tuple[Tensor, ...], new_v: tuple[Tensor, ...],
                 rows: dict[int, int]) -> None:
        blk = self.blk
        x = blk.norm(res) if blk.norm is not None else res
        if self.kv is not None:
            self.kv(x, blk.buf[:, blk.cuts[0]:])
            k, v = blk.k, blk.v
        else:
            _, k, v = blk.heads(blk.qkv(x, blk.buf))
        if self.rotate is not None:
            k = self.rotate(k, pos)
        row = rows[blk.layer]
        new_k[row].copy_(k[:, :, 0])
        new_v[row].copy_(v[:, :, 0])


class ExitRows:
    """The exit walk over a `Rows` plan whose blocks are `exits.depth` repeats of `exits.unit` blocks."""

    def __init__(self, plan: Rows, exits: EarlyExit, layout: DecodeLayout | None):
        self.plan, self.depth, self.exits = plan, exits.depth, frozenset(exits.exits)
        self.state_change = exits.measure == "state_change"
        unit = exits.unit
        self.layers = [plan.blocks[n * unit: (n + 1) * unit] for n in range(self.depth)]
        self.keys = [[_Keys(blk, layout) for blk in blocks if isinstance(blk, _Attention)] for blocks in self.layers]

    def __call__(self, h: Tensor, pos: Tensor, state: DecodeState, keep: Tensor | None, bias: Tensor | None,
                 confidence: Confidence, threshold: float) -> tuple[Tensor, Tensor, int | None]:
        """One step's stream h (b, 1, dim) -> (the rows each exited with (b, 1, dim), a view of the plan's
        buffer; the layer count (b, 1) each stopped at; the exit layer when every row stopped at that same one,
        else None). confidence(rows (b, dim), before (b, dim), layer count) -> the rows' confidences, as floats:
        the decisions are made in Python (one read of the confidences per exit layer, no tensor ops)."""
        res, step = self.plan.begin(h, state, keep, bias)
        before = res.clone() if self.state_change else res
        b = res.shape[0]
        running: list[bool] | None = None   # rows still running; None: all
        live: Tensor | None = None          # the same as a (b, 1) mask, once a row has exited
        held: Tensor | None = None          # the rows' exit states (only the held rows' are read)
        stopped = [self.depth] * b
        for layer, blocks in enumerate(self.layers):
            for blk in blocks:
                blk(res, pos, *step)
                if live is not None:
                    torch.where(live, res, held, out=res)
            if layer + 1 not in self.exits:
                continue
            scores = confidence(res, before, layer + 1)
            stop = [c > threshold and (running is None or running[i]) for i, c in enumerate(scores)]
            if any(stop):
                first = running is None
                running = [not s for s in stop] if first else [r and not s for r, s in zip(running, stop)]
                stopped = [layer + 1 if s else n for s, n in zip(stop, stopped)]
                if not any(running):
                    self.propagate(layer + 1, res, pos, step)
                    return res[:, None], torch.tensor(stopped, device=res.device)[:, None], layer + 1 if first else None
                live, held = torch.tensor(running, device=res.device)[:, None], res.clone()
            if self.state_change:
                before.copy_(res)
        return res[:, None], torch.tensor(stopped, device=res.device)[:, None], None

    def propagate(self, start: int, res: Tensor, pos: Tensor, step: tuple) -> None:
        """Layers start.. (0-based) for rows that all exited: their keys / values from res, nothing else."""
        new_k, new_v, _, _, rows, _ = step
        for keys in self.keys[start:]:
            for write in keys:
                write(res, pos, new_k, new_v, rows)
