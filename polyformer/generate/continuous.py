"""`ContinuousAutoregressiveWrapper`: next-vector regression and cached generation of vectors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks
from ..wrappers import ContinuousTransformerWrapper
from .decode import left_padded_positions


class ContinuousAutoregressiveWrapper(nn.Module):
    """forward(x (b, n, d), mask=None) -> mean squared error of predicting x[:, 1:] from x[:, :-1]
    (masked targets left out). generate(start (b, n, d), seq_len) -> (b, seq_len, d), each output
    fed back as the next input; with cache_kv every step runs one vector against a decode state.

    A probabilistic net (`probabilistic=True`: a mean and a variance per feature) trains on the Gaussian
    negative log-likelihood ½(log σ² + (x - μ)² / σ²) and generates by sampling N(μ, (σ · temperature)²).
    """

    def __init__(self, net: ContinuousTransformerWrapper):
        super().__init__()
        if not isinstance(net, ContinuousTransformerWrapper) or not net.attn_layers.causal:
            raise TypeError("ContinuousAutoregressiveWrapper wraps a ContinuousTransformerWrapper with a Decoder")
        dim_out = net.project_out.out_features if net.project_out is not None else net.attn_layers.out_dim
        self.probabilistic = net.probabilistic
        dim_out = dim_out // 2 if self.probabilistic else dim_out
        if dim_out != net.dim_in:
            raise ValueError(f"generation feeds outputs back as inputs: dim_out ({dim_out}) must equal dim_in ({net.dim_in})")
        self.net = net

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        checks.floats("x", x, 3, "(batch, seq, dim_in)")
        if x.shape[1] < 2:
            raise ValueError(f"x must have at least 2 positions, got shape {tuple(x.shape)}")
        inp, target = x[:, :-1], x[:, 1:]
        if mask is not None:
            checks.bool_mask("mask", mask, tuple(x.shape[:2]), "(batch, seq)")
        out = self.net(inp, mask=mask[:, :-1] if mask is not None else None)
        if self.probabilistic:
            loss = F.gaussian_nll_loss(out[0], target, out[1], reduction="none")       # (b, n, d)
        else:
            loss = (out - target).pow(2)
        if mask is None:
            return loss.mean()
        keep = mask[:, 1:, None].to(loss.dtype)
        return (loss * keep).sum() / (keep.sum() * x.shape[-1]).clamp(min=1)

    def _vector(self, out: Tensor, temperature: float) -> Tensor:
        """The net's last output -> the next vector (b, 1, d): itself, or a draw from its Gaussian."""
        out = out[..., -1:, :]
        if not self.probabilistic:
            return out
        return out[0] + out[1].clamp(min=1e-5).sqrt() * temperature * torch.randn_like(out[0])

    @torch.no_grad()
    def generate(self, start: Tensor, seq_len: int, cache_kv: bool = True, mask: Tensor | None = None,
                 temperature: float = 1.0) -> Tensor:
        """temperature scales a probabilistic net's standard deviation (0: its mean). A start of one sequence
        without a batch dimension, (seq, dim_in) (mask (seq,)), gives (seq_len, dim_out), as x-transformers."""
        if isinstance(start, Tensor) and start.ndim == 2:
            unbatched = None if mask is None else mask[None] if isinstance(mask, Tensor) and mask.ndim == 1 else mask
            return self.generate(start[None], seq_len, cache_kv, unbatched, temperature)[0]
        checks.floats("start", start, 3, "(batch, seq, dim_in) or (seq, dim_in)")
        if not self.probabilistic and temperature != 1.0:
            raise ValueError("temperature samples a probabilistic net's Gaussian; this net is deterministic")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        if not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        b, n, _ = start.shape
        if self.net.bounded and n + seq_len > self.net.max_seq_len:
            raise ValueError(f"start ({n}) + seq_len ({seq_len}) exceeds max_seq_len={self.net.max_seq_len} "
                             "of the learned absolute positions")
        if mask is not None:
            checks.bool_mask("mask", mask, (b, n), "(batch, start_len)")
            if not bool(mask.any(dim=-1).all()):
                raise ValueError("mask leaves a start sequence without any kept vector")
        was_training = self.net.training
        self.net.eval()
        try:
            outs = []
            if cache_kv:
                state = self.net.new_state(b, n + seq_len)
                nxt = self._vector(self.net(start, mask=mask, pos=left_padded_positions(mask), state=state),
                                   temperature)
                for _ in range(seq_len):
                    outs.append(nxt)
                    if len(outs) < seq_len:
                        nxt = self._vector(self.net(nxt, state=state), temperature)
            else:
                seq, keep = start, mask
                for _ in range(seq_len):
                    nxt = self._vector(self.net(seq, mask=keep, pos=left_padded_positions(keep)), temperature)
                    outs.append(nxt)
                    seq = torch.cat((seq, nxt), dim=1)
                    keep = F.pad(keep, (0, 1), value=True) if keep is not None else None
        finally:
            self.net.train(was_training)
        return torch.cat(outs, dim=1)
