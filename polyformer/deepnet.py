"""DeepNet (Wang et al. 2022, arXiv:2203.00555): DeepNorm, x_{l+1} = LN(alpha * x_l + G_l(x_l)), a
post-LN stack whose residual stream is up-weighted by alpha, and the Xavier-normal initialisation
with gain beta of the feedforward, value and output projections (queries and keys keep gain 1).

Depth is counted in the paper's layers: an N-layer encoder (or decoder-only model) has N
(self-attention, feedforward) pairs; the decoder of an encoder-decoder has M (self-attention,
cross-attention, feedforward) triples. A layout must consist of whole layers (in any order:
sandwich_coef reorders them); macaron, a mixer that is its own feedforward (gau) and only_cross
stacks have no counterpart in the paper and are refused.

    setting                          alpha                   beta
    encoder-only, N layers           (2N)^(1/4)              (8N)^(-1/4)
    decoder-only, M layers           (2M)^(1/4)              (8M)^(-1/4)
    encoder-decoder: the encoder     0.81 (N^4 M)^(1/16)     0.87 (N^4 M)^(-1/16)
    encoder-decoder: the decoder     (3M)^(1/4)              (12M)^(-1/4)

A stack alone is encoder-only (no cross-attention, not causal), decoder-only (causal) or the decoder
of an encoder-decoder (it cross-attends: its constants need M alone). The encoder of an
encoder-decoder needs M too: `deepnorm_depths = (N, M)` on it says so (XTransformer sets it on both
stacks; set it yourself on an encoder you pair with a DeepNorm decoder).

`setup(stack)`, called once when a stack is built (stack.py), writes alpha into every block's
residual (`residual.ScaledAdd`) and re-initialises the named weights with the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .checks import whole
from .config import LayersConfig

if TYPE_CHECKING:
    from .stack import AttentionLayers


@dataclass(frozen=True)
class DeepNorm:
    """A stack's DeepNorm constants: alpha scales the residual stream, beta the initialisation."""

    setting: str            # "encoder", "decoder", "encoder-decoder encoder", "encoder-decoder decoder"
    layers: int             # the stack's depth in the paper's layers
    alpha: float
    beta: float


def encoder_only(n: int) -> tuple[float, float]:
    """(alpha, beta) of an N-layer encoder-only model (a decoder-only one alike, with M for N)."""
    return (2 * n) ** 0.25, (8 * n) ** -0.25


def encoder_decoder(n: int, m: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((alpha, beta) of the encoder, (alpha, beta) of the decoder) of an N-encoder, M-decoder layer model."""
    return (0.81 * (n ** 4 * m) ** (1 / 16), 0.87 * (n ** 4 * m) ** (-1 / 16)), ((3 * m) ** 0.25, (12 * m) ** -0.25)


def paper_layers(layout: tuple[str, ...]) -> int | None:
    """How many of the paper's layers a layout holds: one 'a' and one 'f' block each, plus one 'c' in a
    cross-attending decoder; None when its blocks do not make whole layers."""
    a, c, f = (layout.count(kind) for kind in "acf")
    if f == 0 or a != f or c not in (0, f):
        return None
    return f


def constants(cfg: LayersConfig) -> DeepNorm:
    """The constants of a stack with DeepNorm (`problems(cfg)` empty)."""
    layers = paper_layers(cfg.layout)
    if "c" in cfg.layout:
        n = cfg.deepnorm_depths[0] if cfg.deepnorm_depths else layers     # the decoder's constants need M alone
        alpha, beta = encoder_decoder(n, layers)[1]
        return DeepNorm("encoder-decoder decoder", layers, alpha, beta)
    if cfg.deepnorm_depths is not None:
        alpha, beta = encoder_decoder(*cfg.deepnorm_depths)[0]
        return DeepNorm("encoder-decoder encoder", layers, alpha, beta)
    return DeepNorm("decoder" if cfg.causal else "encoder", layers, *encoder_only(layers))


def problems(cfg: LayersConfig) -> list[str]:
    """What stops DeepNorm on this stack, each naming the keywords (rules.check raises the first)."""
    depths = cfg.deepnorm_depths
    if cfg.residual != "deepnorm":
        return ["deepnorm_depths is set but deepnorm is not True"] if depths is not None else []
    found = []
    if cfg.placement != "post":
        found.append("deepnorm=True normalises after each residual (post-LN): it cannot be combined with "
                     "pre_norm=True or sandwich_norm=True")
    if cfg.norm == "none":
        found.append("deepnorm=True needs a norm after each residual; use_rezero=True removes them")
    layers = paper_layers(cfg.layout)
    if layers is None:
        found.append(f"deepnorm=True counts depth in the paper's layers (one self-attention and one feedforward "
                     f"block each, plus one cross-attention block in a cross-attending decoder); {cfg.layout_keyword} "
                     f"makes the layout {''.join(cfg.layout)!r}, not made of them")
    if depths is not None:
        if not isinstance(depths, tuple) or len(depths) != 2 or any(whole(d, "deepnorm_depths") for d in depths):
            found.append(f"deepnorm_depths must be (N encoder layers, M decoder layers), two positive integers, "
                         f"got {depths!r}")
        elif layers is not None:
            side, own = ("decoder", depths[1]) if "c" in cfg.layout else ("encoder", depths[0])
            if own != layers:
                found.append(f"deepnorm_depths={depths} gives the {side} {own} layers, but this stack has {layers}")
    return found


def xavier_normal_rows_(weight: Tensor, parts: tuple[int, ...], gains: tuple[float, ...]) -> None:
    """Xavier-normal init of each block of rows of a fused weight (out, in) as its own matrix:
    std = gain * sqrt(2 / (in + rows))."""
    with torch.no_grad():
        for rows, gain in zip(weight.split(parts, dim=0), gains):
            nn.init.xavier_normal_(rows, gain=gain)


def initialise(branch: nn.Module, beta: float) -> None:
    """DeepNet's init of one block's branch: queries and keys with gain 1, values, the output projection
    and the feedforward with gain beta. Other parameters (norms, gates, memory key / values) keep theirs."""
    from .attention.attention import Attention
    from .feedforward import FeedForward

    if isinstance(branch, FeedForward):
        inner = branch.proj_out.weight.shape[1]
        xavier_normal_rows_(branch.proj_in.weight, (inner,) * (2 if branch.glu else 1), (beta, beta))
        xavier_normal_rows_(branch.proj_out.weight, (branch.proj_out.weight.shape[0],), (beta,))
    elif isinstance(branch, Attention):
        project = branch.project
        q_out, k_out, v_out = project.split
        if project.cross:
            xavier_normal_rows_(project.to_q.weight, (q_out,), (1.0,))
            xavier_normal_rows_(project.to_kv.weight, (k_out, v_out), (1.0, beta))
        else:
            xavier_normal_rows_(project.to_qkv.weight, (q_out, k_out, v_out), (1.0, 1.0, beta))
        output = branch.output
        while not hasattr(output, "proj"):      # behind head scales / gates (attention/head_scale.py, gates.py)
            output = output.output
        out = output.proj.weight
        halves = (out.shape[0] // 2,) * 2 if output.on_attn else (out.shape[0],)
        xavier_normal_rows_(out, halves, (beta, beta))
    elif any(True for _ in branch.parameters()):
        raise ValueError(f"deepnorm=True knows the weights of attention and feedforward blocks, not those of "
                         f"{type(branch).__name__}")


def setup(stack: "AttentionLayers") -> DeepNorm:
    """alpha into every block's residual, the beta-scaled init of every block's weights; the constants."""
    found = constants(stack.cfg)
    for block in stack.blocks:
        block.combine.alpha = found.alpha
        initialise(block.branch, found.beta)
    return found


def pair_depths(dim: int, enc_layers: dict, dec_layers: dict) -> tuple[int, int] | None:
    """(N, M) of an encoder-decoder from its two stacks' keywords, DeepNorm on both or neither; None
    when a layout is not made of the paper's layers (building that stack then says why)."""
    from .keywords import parse_layers

    on = enc_layers.get("deepnorm") is True, dec_layers.get("deepnorm") is True
    if on[0] != on[1]:
        raise ValueError("XTransformer: enc_deepnorm and dec_deepnorm go together (the paper's alpha and beta of an "
                         "encoder-decoder assume DeepNorm on both stacks); set both")
    enc = parse_layers({**enc_layers, "dim": dim, "causal": False}, owner="Encoder")
    dec = parse_layers({**dec_layers, "dim": dim, "causal": True, "cross_attend": True}, owner="Decoder")
    n, m = paper_layers(enc.layout), paper_layers(dec.layout)
    return (n, m) if n is not None and m is not None else None
