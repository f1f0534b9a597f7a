"""The default decode step's blocks over 2-D rows: a plan made once per generate call.

When every block of a stack is a `plan.PlainBlock` joined by a plain x + y, `Rows` runs them on the
residual stream as (b, dim) rows held in one buffer, with each product written by `torch.addmm(...,
out=)` into buffers made once per batch size, dtype and device (shared by the blocks, so they stay in
cache) and the heads of q, k and v read as views of the q|k|v buffer made with it. Per layer a step
is one Python call that runs the norm, the products, the cache writes, one
`scaled_dot_product_attention` and the residual additions; what is the same for every layer (the
cache views, the folded key mask and score bias) is made once per step. Its logits equal the module
path's up to float rounding (tests/generate/test_default_layout.py). With autograd recording or
autocast on, `FastStep` keeps the PlainBlocks' own calls (out= buffers take no gradient or autocast).
Where the extension is built and knows every block (`native.py`), the loop over the blocks runs in C++ on the
same buffers, the same operations in the same order: the same rows bit for bit, one call per step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.kernels.dense import additive, match_heads
from ..memory.kv_cache import DecodeState
from ..norm import LayerNorm, RMSNorm
from ..quantize import Int8Linear
from . import native
from .plan import DecodeLayout, PlainBlock

Product = Callable[[Tensor, Tensor], Tensor]


class _Transposed:
    """w.t() of a weight, remade when the weight's storage was replaced (`param.data = ...`): the view
    held here keeps the old storage alive, so a new one never has its address."""

    def __init__(self, w: Tensor):
        self.w, self.ptr, self.t = w, w.data_ptr(), w.t()

    def __call__(self) -> Tensor:
        w = self.w
        if w.data_ptr() != self.ptr:
            self.ptr, self.t = w.data_ptr(), w.t()
        return self.t


def _weight(module: nn.Linear, layout: DecodeLayout | None) -> Callable[[], Tensor]:
    """The (in, out) matrix rows multiply: the layout's input-major copy (checked every call) or w.t()."""
    w = module.weight
    if layout is not None and layout.wants(module):
        layout.weight(w)
        current = layout.current
        return lambda: current(w).rows
    return _Transposed(w)


def product(module: nn.Module, layout: DecodeLayout | None) -> Product:
    """(x (b, in), out (b, out)) -> module(x): written into `out` for a linear layer (over the layout's
    input-major copy where it keeps one) or an int8 one over float32 rows, else the module's own result."""
    if type(module) is Int8Linear:
        return module.forward_into
    if type(module) is not nn.Linear:
        forward = module.forward
        return lambda x, out: forward(x)
    weight, bias = _weight(module, layout), module.bias
    if bias is None:
        return lambda x, out: torch.mm(x, weight(), out=out)
    return lambda x, out: torch.addmm(bias, x, weight(), out=out)


def accumulate(module: nn.Module, layout: DecodeLayout | None) -> Callable[[Tensor, Tensor], None]:
    """(res (b, out), x (b, in)) -> res += module(x), in place (into res for a linear layer)."""
    if type(module) is not nn.Linear:
        forward = module.forward
        return lambda res, x: res.add_(forward(x))
    weight, bias = _weight(module, layout), module.bias
    if bias is None:
        return lambda res, x: res.addmm_(x, weight())
    return lambda res, x: res.addmm_(x, weight()).add_(bias)


def norm(module: nn.Module | None, dtype: torch.dtype) -> Callable[[Tensor], Tensor] | None:
    """The norm as one ATen call where it is one for rows of `dtype`, else its forward."""
    if module is None:
        return None
    w = getattr(module, "weight", None)
    same = w is None or w.dtype == dtype
    if type(module) is LayerNorm and dtype in (torch.float32, torch.float64) and same:
        shape, eps = module.normalized_shape, module.eps
        return lambda x: torch.layer_norm(x, shape, module.weight, module.bias, eps)
    if type(module) is RMSNorm and dtype == torch.float32 and same:
        shape, eps = (w.shape[0],), module.eps
        return lambda x: F.rms_norm(x, shape, module.weight, eps)
    return module.forward


# GELU in place over a non-contiguous view of the hidden rows (the same elements): ATen's own vectorised
# kernel then runs, not oneDNN's primitive, which it picks for contiguous float32 and which costs
# 20-50 us a call once the weights have streamed through the cache (2-5 us here); equal to rounding.
# Through the public operator namespace: about 0.5 us a call more than the private torch._C._nn.gelu_
_GELU_ = torch.ops.aten.gelu_.default


class _Attention:
    """One self-attention block over rows (bound to one batch size and dtype by `Rows`)."""

    def __init__(self, block: PlainBlock, layout: DecodeLayout | None, width: dict[str, int]):
        self.block, self.qkv = block, product(block.modules["qkv"], layout)
        self.out = accumulate(block.modules["out"], layout)
        self.layer, self.scale, self.position = block.layer, block.scale, block.position
        self.gqa = block.kv_heads != block.heads
        self.match = block.kv_heads != block.v_heads            # keys and values with other head counts
        qd, kd, vd = block.split
        width["qkv"] = max(width.get("qkv", 0), qd + kd + vd)
        self.cuts = (qd, kd, vd)

    def bind(self, buffers: dict[str, Tensor], dtype: torch.dtype) -> None:
        self.norm = norm(self.block.modules["norm"], dtype)
        qkv = buffers["qkv"][:, :sum(self.cuts)]
        self.buf = qkv
        self.q, self.k, self.v = self.heads(qkv)
        self.k3, self.v3 = self.k[:, :, 0], self.v[:, :, 0]

    def heads(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (b, h, 1, d), k (b, hk, 1, d), v (b, hv, 1, dv): views of the rows qkv (b, q + k + v)."""
        b, (qd, kd, vd), blk = qkv.shape[0], self.cuts, self.block
        q, k, v = qkv.split(self.cuts, dim=-1)
        return (q.view(b, blk.heads, 1, qd // blk.heads), k.view(b, blk.kv_heads, 1, kd // blk.kv_heads),
                v.view(b, blk.v_heads, 1, vd // blk.v_heads))

    def __call__(self, res: Tensor, pos: Tensor, new_k: tuple[Tensor, ...], new_v: tuple[Tensor, ...],
                 keys: tuple[Tensor, ...], values: tuple[Tensor, ...], rows: dict[int, int],
                 mask: Tensor | None) -> None:
        x = self.norm(res) if self.norm is not None else res
        qkv = self.qkv(x, self.buf)
        q, k, v = (self.q, self.k, self.v) if qkv is self.buf else self.heads(qkv)
        if self.position is not None:
            q, k = self.position(q, k, pos, pos)
        row = rows[self.layer]
        new_k[row].copy_(self.k3 if k is self.k else k[:, :, 0])
        new_v[row].copy_(self.v3 if v is self.v else v[:, :, 0])
        k, v = keys[row], values[row]
        if self.match:
            k, v = match_heads(k, q.shape[1]), match_heads(v, q.shape[1])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.gqa and not self.match)
        self.out(res, out.reshape(res.shape[0], -1))


class _FeedForward:
    """One feedforward block over rows."""

    def __init__(self, block: PlainBlock, layout: DecodeLayout | None, width: dict[str, int]):
        self.block = block
        self.proj_in = product(block.modules["proj_in"], layout)
        self.proj_out = accumulate(block.modules["proj_out"], layout)
        self.act, self.glu = block.act, block.glu
        width["hidden"] = max(width.get("hidden", 0), block.modules["proj_in"].out_features)

    def bind(self, buffers: dict[str, Tensor], dtype: torch.dtype) -> None:
        self.norm = norm(self.block.modules["norm"], dtype)
        self.hidden = buffers["hidden"][:, :self.block.modules["proj_in"].out_features]
        self.gelu = None
        act = self.block.modules["act"]
        if (type(act) is nn.GELU and act.approximate == "none" and not self.glu and dtype == torch.float32
                and self.hidden.is_contiguous() and self.hidden.numel() % 2 == 0):
            self.gelu = self.hidden.view(-1, 2).t()

    def __call__(self, res: Tensor, *_) -> None:
        x = self.norm(res) if self.norm is not None else res
        y = self.proj_in(x, self.hidden)
        if self.gelu is not None and y is self.hidden:
            _GELU_(self.gelu)
        elif self.glu:
            y, gate = y.chunk(2, dim=-1)
            y = y * self.act(gate)
        else:
            y = self.act(y)
        self.proj_out(res, y)


class Rows:
    """A stack of plain-joined `PlainBlock`s as one call per block over (b, dim) rows (module doc)."""

    def __init__(self, blocks: list[PlainBlock], layout: DecodeLayout | None):
        self.width: dict[str, int] = {}
        self.blocks = [(_Attention if blk.attention else _FeedForward)(blk, layout, self.width) for blk in blocks]
        self.layout = layout
        self.bound: tuple | None = None
        self.native: Any = None             # the block loop in C++ over the bound buffers (native.py), or None
        self.key_rows: tuple[dict, list[int]] | None = None

    @staticmethod
    def build(blocks: list, layout: DecodeLayout | None) -> "Rows | None":
        """A `Rows` for `blocks`, or None unless each is a `PlainBlock` whose join is x + y."""
        if not blocks or not all(isinstance(b, PlainBlock) and b.join is None for b in blocks):
            return None
        return Rows(blocks, layout)

    @staticmethod
    def takes(h: Tensor) -> bool:
        """Whether a step may run over the buffers: no autograd recording and no autocast."""
        return not torch.is_grad_enabled() and not torch.is_autocast_enabled(h.device.type)

    def _buffers(self, h: Tensor) -> dict[str, Tensor]:
        """The buffers for rows like h (b, 1, dim), made on the first step of a batch size / dtype / device."""
        key = (h.shape[0], h.shape[-1], h.dtype, h.device)
        if self.bound is None or self.bound[0] != key:
            b, dim = h.shape[0], h.shape[-1]
            buffers = {name: h.new_empty(b, width) for name, width in self.width.items()}
            buffers["res"] = h.new_empty(b, dim)
            for blk in self.blocks:
                blk.bind(buffers, h.dtype)
            self.bound = (key, buffers)
            self.native = native.bind(self, buffers["res"])
        return self.bound[1]

    def begin(self, h: Tensor, state: DecodeState, keep: Tensor | None, bias: Tensor | None) -> tuple[Tensor, tuple]:
        """The residual rows (b, dim), set to h (b, 1, dim), and what every block takes after (rows, pos) this
        step: the new keys' / values' slots, the cache views, the state's layer rows, the folded key mask."""
        res = self._buffers(h)["res"]
        res.copy_(h[:, 0])
        end = state.length + 1
        new_k, new_v = state.k.select(3, state.length).unbind(0), state.v.select(3, state.length).unbind(0)
        keys, values = state.k.narrow(3, 0, end).unbind(0), state.v.narrow(3, 0, end).unbind(0)
        return res, (new_k, new_v, keys, values, state.rows, additive(keep, bias, h.dtype))

    def __call__(self, h: Tensor, pos: Tensor, state: DecodeState, keep: Tensor | None,
                 bias: Tensor | None) -> Tensor:
        """The blocks' output for one new token per row, h (b, 1, dim) -> (b, 1, dim), its keys and
        values written to `state` (begun for this step); keep / bias: the key mask and score bias."""
        res = self._buffers(h)["res"]
        if self.native is not None:
            res.copy_(h[:, 0])
            if self.key_rows is None or self.key_rows[0] is not state.rows:
                layers = [blk.layer for blk in self.blocks if isinstance(blk, _Attention)]
                self.key_rows = (state.rows, [state.rows[layer] for layer in layers])
            if self.native.step(state.k, state.v, state.length, additive(keep, bias, h.dtype), self.key_rows[1]):
                return res[:, None]
            self.native = native.bind(self, res)        # an input-major copy went stale: remade, rebound
            return self(h, pos, state, keep, bias)
        res, step = self.begin(h, state, keep, bias)
        for blk in self.blocks:
            blk(res, pos, *step)
        return res[:, None]
