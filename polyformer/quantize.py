"""Weight-only int8 quantization for inference: every `nn.Linear` keeps its weight as int8 with one
float scale per output row (symmetric absmax, as in LLM.int8() arXiv:2208.07339 without the outlier
split), and activations stay in floating point.

Decoding one sequence at a time reads every weight once per token, so its speed is bounded by
memory bandwidth; int8 weights move a quarter of float32's bytes. For float32 CPU rows, up to `ROWS`
of them (decoding), the product runs on the native decode extension's `int8_linear`
(polyformer/generate/rows_native.cpp: each int8 weight converted to float32 exactly, float32 products
and sums, the row's scale applied to the sum), which the default decode loop runs too; bfloat16 CPU
rows take `torch._weight_int8pack_mm` (bfloat16 activations and result); anything else (more rows,
other devices and dtypes, no extension) multiplies by the weight dequantized to the input's dtype.
Float32 rows thus get the product with the dequantized weight `q * scale` to float32 rounding.

    model = quantize_int8(model.eval())        # in place; returns the model

Inference only: the int8 weights are buffers, not parameters, so nothing trains them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention.projection import Projection
from .layout import linear_layers

QMAX = 127
ROWS = 24           # float32 CPU products of up to this many rows run on the int8 kernel; more dequantize


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(out, in) float -> int8 (out, in) and float32 scales (out,) with weight ~= q * scale[:, None];
    every element's error is at most scale / 2 of its row. An all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def _packed_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def _int8_kernel() -> Callable[..., None] | None:
    """The extension's `int8_linear(x (b, in), q, scale, bias, out (b, out))`, or None without it."""
    from .generate import native

    module = native.extension()
    return None if module is None else module.int8_linear


class Int8Linear(nn.Module):
    """A `nn.Linear` whose weight is int8 per-row quantized (see module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, device=device))
        # the kernel's copy of `scale`: moves with the module, refreshed when scales are loaded
        self.register_buffer("scale_bf16", self.scale.to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device=linear.weight.device)
        q, scale = quantize_rows(linear.weight)
        new.qweight.copy_(q)
        new.scale.copy_(scale)
        new.scale_bf16.copy_(scale)
        if linear.bias is not None:
            new.bias.copy_(linear.bias.detach().float())
        return new

    @property
    def weight(self) -> Tensor:
        """The dequantized (out, in) weight, for code that reads `.weight` (tied heads, infusion)."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.numel() <= ROWS * self.in_features:
            kernel = _int8_kernel()
            if kernel is not None:
                flat = x.reshape(-1, self.in_features)
                out = x.new_empty(flat.shape[0], self.out_features)
                kernel(flat if flat.stride(-1) == 1 else flat.contiguous(), self.qweight, self.scale, self.bias, out)
                return out.view(*x.shape[:-1], self.out_features)
        if x.device.type == "cpu" and _packed_kernel() and x.dtype == torch.bfloat16:
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale_bf16)
            y = y.view(*x.shape[:-1], self.out_features)
            return (y if self.bias is None else y + self.bias).to(x.dtype)   # bias added in float32
        w = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return F.linear(x, w, self.bias.to(x.dtype) if self.bias is not None else None)

    def forward_into(self, x: Tensor, out: Tensor) -> Tensor:
        """forward(x) for rows x (b, in), written into `out` (b, out) when both are float32 CPU rows and the
        int8 kernel is built (any b: the decode loop's call, as the native loop runs it); else a new tensor."""
        kernel = _int8_kernel() if x.device.type == "cpu" and x.dtype == out.dtype == torch.float32 else None
        if kernel is None or x.stride(-1) != 1:
            return self(x)
        kernel(x, self.qweight, self.scale, self.bias, out)
        return out

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        with torch.no_grad():
            self.scale_bf16.copy_(self.scale)          # new scales: refresh the kernel's copy

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def quantize_int8(model: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """Replace every `nn.Linear` of `model` (in place) by an `Int8Linear`; `skip` lists module names
    (as in `named_modules`, e.g. "to_logits") to leave in floating point. Returns the model, in
    eval mode. Refuses a model whose parameters require gradients while it is training. The q|k|v
    projection of position-infused attention stays in floating point (it splits its weight per call)."""
    if model.training and any(p.requires_grad for p in model.parameters()):
        raise ValueError("model: quantize_int8 is for inference; call model.eval() first "
                         "(int8 weights are buffers and would not be trained)")
    # a position-infused projection reads its weight in the forward pass: it stays in floating point
    infused = {f"{name}.to_qkv" for name, m in model.named_modules()
               if isinstance(m, Projection) and m.infusion is not None}
    for name, linear in linear_layers(model, skip):
        if name in infused:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear.from_linear(linear))
    return model.eval()
