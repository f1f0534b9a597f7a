"""What the default decode path prepares: the weight layout once per model, a tight block step once
per generate call.

At batch 1 on a CPU every linear layer is a matrix-vector product bounded by how fast the BLAS
streams its weight, and MKL streams the expanding matrices (q|k|v, the feedforward's first layer)
faster input-major, (in, out) in memory (`polyformer/layout.py`). `DecodeLayout` keeps an
input-major copy of each such float32 CPU weight, made on first use and kept beside the model, not
in it: no parameter, buffer or state-dict entry is added, and the copies go when the model does.
They cost the bytes of the expanding weights (q|k|v and the feedforward's first layer; 44 MiB for
dim 512 / depth 6, 58% of that model's weights); `forget(net)` frees them. A copy is tagged with its
parameter's version counter, storage address, shape, strides and a sample of its values, checked
when a plan is made, and each step re-checks the version counter and the storage address (the entry
holds the storage it copied, so a replacement never reuses that address), so an optimizer step, a
loaded state dict or a tensor replaced (`param.data = ...`), even between two steps, is never decoded
from a stale copy. (In-place writes through `param.data` bypass the version counter; the sample
catches, when a plan is made, those that change the sampled values.)

`PlainBlock` runs a block whose stages are the common ones (any norm, fused-capable softmax dense
attention without memory key / values, optional rotary / score bias, plain output, plain or gated
feedforward) with the layout's weights and `scaled_dot_product_attention` called directly (for one
query it is several times faster than the fused training kernel the module path picks). Its
logits equal the module path's up to float rounding (another summation order);
tests/generate/test_default_layout.py checks it. Anything else keeps `fast._Block`. When every block
of the stack is a PlainBlock with a plain join, `rows.Rows` runs them over (b, dim) rows in buffers
made once per generate call (`rows.py`); the PlainBlocks' own calls run the stacks Rows does not take
(another join: sandwich or post norm, a residual scale or gate) and steps under autograd or autocast,
about 10% faster there than `fast._Block` at dim 64 / depth 6 (SDPA without the kernel's dispatch).
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.attention import Attention
from ..attention.kernels.dense import DenseKernel, additive, match_heads
from ..attention.mixing import Output
from ..attention.projection import split_heads
from ..feedforward import FeedForward
from ..layout import is_input_major
from ..memory.kv_cache import DecodeState
from ..residual import Add

SAMPLES = 64          # values compared per weight when a plan is made


def _key(w: Tensor) -> tuple:
    return w._version, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device


def _sample(w: Tensor) -> Tensor:
    flat = w.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES].clone()


class _Copy(NamedTuple):
    param: weakref.ref        # the weight copied (its id may be reused once it is gone)
    source: Tensor            # its tensor then: holds that storage, so no replacement gets its address
    key: tuple                # `_key` of the weight then
    sample: Tensor            # `_sample` of the weight then
    copy: Tensor              # (out, in), input-major: what F.linear reads
    rows: Tensor              # copy.t(): the contiguous (in, out) matrix rows (b, in) multiply


class DecodeLayout:
    """Input-major copies of one model's expanding float32 CPU weights, kept in sync (module doc)."""

    def __init__(self, model: nn.Module):
        users: dict[int, int] = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                users[id(p)] = users.get(id(p), 0) + 1
        self.shared = {i for i, n in users.items() if n > 1}       # tied weights keep one layout
        self.copies: dict[int, _Copy] = {}

    def wants(self, linear: nn.Module) -> bool:
        """Whether `linear` gains from an input-major copy: a plain expanding float32 CPU layer."""
        w = getattr(linear, "weight", None)
        return (type(linear) is nn.Linear and w is not None and w.device.type == "cpu" and w.dtype == torch.float32
                and linear.out_features > linear.in_features > 1 and id(w) not in self.shared
                and not is_input_major(w))

    def entry(self, w: Tensor) -> _Copy:
        """The copy of (out, in) weight `w`, made or remade when `w` changed since (every check)."""
        entry = self.copies.get(id(w))
        if (entry is not None and entry.param() is w and entry.key == _key(w)
                and torch.equal(_sample(w), entry.sample)):
            return entry
        with torch.no_grad():
            copy = w.detach().t().contiguous().t()
        entry = self.copies[id(w)] = _Copy(weakref.ref(w), w.detach(), _key(w), _sample(w), copy, copy.t())
        return entry

    def weight(self, w: Tensor) -> Tensor:
        """The input-major copy of (out, in) weight `w`, checked as when a plan is made."""
        return self.entry(w).copy

    def current(self, w: Tensor) -> _Copy:
        """The copy of `w` while its version counter and storage are those it was made from (each step's
        check); else a fresh one."""
        entry = self.copies[id(w)]
        return entry if entry.key[0] == w._version and entry.key[1] == w.data_ptr() else self.entry(w)

    def nbytes(self) -> int:
        return sum(entry.copy.nbytes for entry in self.copies.values())


_LAYOUTS: "weakref.WeakKeyDictionary[nn.Module, DecodeLayout]" = weakref.WeakKeyDictionary()


def layout_for(net: nn.Module) -> DecodeLayout:
    """The model's `DecodeLayout`, made on first use and kept while the model lives."""
    if net not in _LAYOUTS:
        _LAYOUTS[net] = DecodeLayout(net)
    return _LAYOUTS[net]


def forget(net: nn.Module) -> None:
    """Free the decode-time copies of `net`'s weights (the next generate call makes them again)."""
    _LAYOUTS.pop(net, None)


def linear(module: nn.Module, layout: DecodeLayout | None) -> Callable[[Tensor], Tensor]:
    """`module`'s product: over the layout's input-major copy where it keeps one, else its forward."""
    if layout is None or not layout.wants(module):
        return module.forward
    w, bias = module.weight, module.bias
    layout.weight(w)

    def product(x: Tensor) -> Tensor:
        return F.linear(x, layout.current(w).copy, bias)
    return product


class PlainBlock:
    """One block of the common kinds as a single call (module doc); `build` says whether it is one."""

    def __init__(self, block: nn.Module, layout: DecodeLayout | None):
        self.attention = block.kind == "a"
        self.norm_in = block.norm_in.forward if block.norm_in is not None else None
        self.join = None if plain_join(block) else block.join
        branch = block.branch
        self.modules: dict[str, nn.Module | None] = {"norm": block.norm_in}     # what `rows.Rows` resolves
        if self.attention:
            project = branch.project
            self.modules.update(qkv=project.to_qkv, out=branch.output.proj)
            self.qkv, self.split = linear(project.to_qkv, layout), project.split
            self.heads, self.kv_heads, self.v_heads = project.heads, project.kv_heads, project.v_heads
            self.position = branch.position.forward if branch.position is not None else None
            self.layer, self.scale = branch.layer, branch.kernel.scale
            self.out = linear(branch.output.proj, layout)
        else:
            self.modules.update(proj_in=branch.proj_in, proj_out=branch.proj_out, act=branch.act)
            self.proj_in, self.proj_out = linear(branch.proj_in, layout), linear(branch.proj_out, layout)
            self.act, self.glu = branch.act.forward, branch.glu

    @staticmethod
    def build(block: nn.Module, layout: DecodeLayout | None) -> "PlainBlock | None":
        """A `PlainBlock` for `block` (one `FastStep` accepts), or None when it has another stage."""
        if block.shift is not None:
            return None
        branch = block.branch
        if block.kind == "f":
            return PlainBlock(block, layout) if type(branch) is FeedForward else None
        kernel, output = branch.kernel, branch.output
        if (type(branch) is not Attention or branch.memory_kv is not None or type(kernel) is not DenseKernel
                or not kernel.can_fuse or type(output) is not Output or output.gate is not None or output.on_attn):
            return None
        return PlainBlock(block, layout)

    def __call__(self, x: Tensor, pos: Tensor, state: DecodeState, masks: Callable,
                 prev_scores: Tensor | None) -> tuple[Tensor, Tensor | None]:
        h = self.norm_in(x) if self.norm_in is not None else x
        if self.attention:
            q, k, v = self.qkv(h).split(self.split, dim=-1)
            q, k, v = split_heads(q, self.heads), split_heads(k, self.kv_heads), split_heads(v, self.v_heads)
            if self.position is not None:
                q, k = self.position(q, k, pos, pos)
            k, v = state.write(self.layer, k, v)
            out = attend(q, k, v, *masks(0), self.scale)
            b, heads, n, d = out.shape
            y = self.out(out.transpose(1, 2).reshape(b, n, heads * d))
        else:
            y = FeedForward.compute(h, self.proj_in, self.act, self.proj_out, self.glu)
        return (x + y if self.join is None else self.join(x, y)), None


def plain_join(block: nn.Module) -> bool:
    """Whether the block's join is x + y (no residual scale, gate, or norm after it)."""
    return (type(block.combine) is Add and block.scale == 1.0 and block.norm_out is None
            and block.post_norm is None)


def attend(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, scale: float) -> Tensor:
    """Softmax attention of q (b, h, i, d) over k (b, hk, j, d), v (b, hv, j, dv) with a keep-mask and
    an additive bias (b|1, 1|h, i, j) or None, as the dense kernel's fused path computes it."""
    h = q.shape[1]
    gqa = k.shape[1] != h
    if gqa and k.shape[1] != v.shape[1]:
        k, v, gqa = match_heads(k, h), match_heads(v, h), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=additive(keep, bias, q.dtype), scale=scale,
                                          enable_gqa=gqa)
