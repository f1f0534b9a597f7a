"""Feedforwards with a norm after the activation: SoLU (ff_solu; Elhage et al. 2022, "Softmax Linear
Units", transformer-circuits.pub/2022/solu): LayerNorm(x * softmax(x)) over the hidden features; and
NormFormer's LayerNorm after the activation (ff_post_act_ln, arXiv:2110.09456), after the gate of a GLU.
Both LayerNorms have a gain and no bias, as x-transformers' (a bias there is one proj_out can hold)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from .config import FeedForwardConfig
from .feedforward import FeedForward
from .norm import LayerNorm


class SoLU(nn.Module):
    """LayerNorm(x * softmax(x)), the softmax over the last axis (computed in at least float32)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = LayerNorm(dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return self.norm((x32 * x32.softmax(dim=-1)).to(x.dtype))


class NormedFeedForward(FeedForward):
    """proj_in -> activation (or a * act(b)) -> LayerNorm -> dropout -> proj_out (ff_post_act_ln)."""

    def __init__(self, dim: int, cfg: FeedForwardConfig, dim_out: int | None = None):
        super().__init__(dim, cfg, dim_out)
        self.post_act = LayerNorm(self.proj_out.in_features, bias=False)

    def dense(self, x: Tensor) -> Tensor:
        h = self.proj_in(x)
        if self.glu:
            h, gate = h.chunk(2, dim=-1)
            h = h * self.act(gate)
        else:
            h = self.act(h)
        return self.proj_out(self.dropout(self.post_act(h)))


def build(dim: int, cfg: FeedForwardConfig) -> FeedForward:
    """The dense feedforward of a stack: FeedForward, with SoLU as its activation, with post_act_ln the
    NormedFeedForward."""
    solu = cfg.activation == "solu"
    plain = dataclasses.replace(cfg, activation="gelu") if solu else cfg    # SoLU needs the hidden width
    ff = NormedFeedForward(dim, plain) if cfg.post_act_ln else FeedForward(dim, plain)
    if solu:
        ff.act = SoLU(ff.proj_out.in_features)
    return ff


def problems(cfg) -> list[str]:
    f = cfg.ff
    found = []
    if not isinstance(f.post_act_ln, bool):
        found.append(f"ff_post_act_ln must be True or False, got {f.post_act_ln!r}")
    if f.moe is not None and (f.post_act_ln or f.activation == "solu"):
        named = "ff_solu=True" if f.activation == "solu" else "ff_post_act_ln=True"
        found.append(f"{named} is built into the dense feedforward; ff_moe's experts do not take it")
    return found
