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
    fed back as the next input; with cache_kv every step runs one vector against a decode state."""

    def __init__(self, net: ContinuousTransformerWrapper):
        super().__init__()
        if not isinstance(net, ContinuousTransformerWrapper) or not net.attn_layers.causal:
            raise TypeError("ContinuousAutoregressiveWrapper wraps a ContinuousTransformerWrapper with a Decoder")
        dim_out = net.project_out.out_features if net.project_out is not None else net.attn_layers.out_dim
        if dim_out != net.dim_in:
            raise ValueError(f"generation feeds outputs back as inputs: dim_out ({dim_out}) must equal dim_in ({net.dim_in})")
        self.net = net

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        checks.floats("x", x, 3, "(batch, seq, dim_in)")
        if x.shape[1] < 2:
            raise ValueError(f"x must have at least 2 positions, got shape {tuple(x.shape)}")
        inp, target = x[:, :-1], x[:, 1:]
        if mask is None:
            return F.mse_loss(self.net(inp), target)
        checks.bool_mask("mask", mask, tuple(x.shape[:2]), "(batch, seq)")
        out = self.net(inp, mask=mask[:, :-1])
        keep = mask[:, 1:, None].to(out.dtype)
        return ((out - target).pow(2) * keep).sum() / (keep.sum() * x.shape[-1]).clamp(min=1)

    @torch.no_grad()
    def generate(self, start: Tensor, seq_len: int, cache_kv: bool = True, mask: Tensor | None = None) -> Tensor:
        checks.floats("start", start, 3, "(batch, seq, dim_in)")
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
                nxt = self.net(start, mask=mask, pos=left_padded_positions(mask), state=state)[:, -1:]
                for _ in range(seq_len):
                    outs.append(nxt)
                    if len(outs) < seq_len:
                        nxt = self.net(nxt, state=state)[:, -1:]
            else:
                seq, keep = start, mask
                for _ in range(seq_len):
                    nxt = self.net(seq, mask=keep, pos=left_padded_positions(keep))[:, -1:]
                    outs.append(nxt)
                    seq = torch.cat((seq, nxt), dim=1)
                    keep = F.pad(keep, (0, 1), value=True) if keep is not None else None
        finally:
            self.net.train(was_training)
        return torch.cat(outs, dim=1)
