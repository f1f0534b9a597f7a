"""Hyper-connections (arXiv:2409.19606): the residual stream widened to n streams H (n x d) per token,
joined to each block by learned, input-dependent weights instead of x + f(x) (num_residual_streams=n).

For a block T with its weights computed from H_bar = norm(H) (the paper's dynamic hyper-connections):

    A_m(H) = A_m + s_a * tanh(H_bar W_m)      (n x 1)   the block's input h0 = A_m^T H
    A_r(H) = A_r + s_a * tanh(H_bar W_r)      (n x n)   the streams carried on: A_r^T H
    B(H)   = B + s_b * tanh(H_bar W_b)^T      (1 x n)   the block's output into each stream
    H'     = B^T T(h0) + A_r^T H

initialised as the paper's static part: A_m = e_{k mod n} for the stack's k-th block, A_r = I, B = 1, the
dynamic W at zero, s_a = s_b = 0.01. The stack starts from n copies of its input and sums the streams at
the end (before the final norm), so at initialisation every stream is the plain residual stream and a
pre-norm stack's output is unchanged. The block's own norm then acts on h0 (`StreamRead`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import checks
from .norm import LayerNorm


class HyperConnection(nn.Module):
    """The residual of one block over n streams: `read(H)` -> its input h0, `forward(H, y)` -> H'.
    H (b, i, n, d), h0 and y (b, i, d)."""

    def __init__(self, dim: int, streams: int, layer_index: int):
        super().__init__()
        self.streams = streams
        self.norm = LayerNorm(dim, bias=False)
        self.static_m = nn.Parameter(torch.zeros(streams))            # A_m
        with torch.no_grad():
            self.static_m[layer_index % streams] = 1.0
        self.static_r = nn.Parameter(torch.eye(streams))              # A_r
        self.static_b = nn.Parameter(torch.ones(streams))             # B
        self.dynamic_m = nn.Parameter(torch.zeros(dim, 1))            # W_m
        self.dynamic_r = nn.Parameter(torch.zeros(dim, streams))      # W_r
        self.dynamic_b = nn.Parameter(torch.zeros(dim, 1))            # W_b
        self.scale_a = nn.Parameter(torch.tensor(0.01))               # s_a
        self.scale_b = nn.Parameter(torch.tensor(0.01))               # s_b

    def read(self, h: Tensor) -> Tensor:
        """h0 = A_m(H)^T H: the block's input, (b, i, d)."""
        a_m = self.static_m + self.scale_a * torch.tanh(self.norm(h) @ self.dynamic_m.to(h.dtype)).squeeze(-1)
        return torch.einsum("bisd,bis->bid", h, a_m.to(h.dtype))

    def forward(self, h: Tensor, y: Tensor) -> Tensor:
        """H' = B(H)^T y + A_r(H)^T H: (b, i, n, d)."""
        h_bar = self.norm(h)
        a_r = self.static_r + self.scale_a * torch.tanh(h_bar @ self.dynamic_r.to(h.dtype))      # (b, i, n, n)
        b = self.static_b + self.scale_b * torch.tanh(h_bar @ self.dynamic_b.to(h.dtype)).squeeze(-1)   # (b, i, n)
        carried = torch.einsum("bisd,bist->bitd", h, a_r.to(h.dtype))
        return carried + b.to(h.dtype)[..., None] * y[:, :, None]


class StreamRead(nn.Module):
    """A block's input from the streams: h0 = A_m^T H, then the block's own pre-norm (if any). The
    hyper-connection it reads with is the block's residual (`Block.combine`), held here unregistered."""

    def __init__(self, connection: HyperConnection, norm: nn.Module | None):
        super().__init__()
        self._connection = (connection,)
        self.norm = norm

    def forward(self, h: Tensor) -> Tensor:
        h0 = self._connection[0].read(h)
        return self.norm(h0) if self.norm is not None else h0


class Streams(nn.Module):
    """The stack's n streams: its input copied n times on entry, the streams summed on exit."""

    def __init__(self, streams: int):
        super().__init__()
        self.streams = streams

    def expand(self, x: Tensor) -> Tensor:
        """(b, i, d) -> (b, i, n, d)."""
        return x.unsqueeze(2).expand(-1, -1, self.streams, -1)

    def reduce(self, h: Tensor) -> Tensor:
        """(b, i, n, d) -> (b, i, d)."""
        return h.sum(dim=2)


def problems(cfg) -> list[str]:
    """What num_residual_streams cannot take or combine with, naming the keywords."""
    n, iters = cfg.residual_streams, cfg.streams_sinkhorn
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return [f"num_residual_streams must be an integer >= 1, got {n!r}"]
    found = checks.whole(iters, "hyper_conn_sinkhorn_iters", optional=True)
    if iters is not None and n == 1:
        found.append("hyper_conn_sinkhorn_iters constrains the mixing of hyper-connections' streams: it needs "
                     "num_residual_streams > 1")
    if n == 1:
        return found
    named = {"rezero": "use_rezero", "gru": "gate_residual", "deepnorm": "deepnorm"}
    if cfg.residual != "add":
        found.append(f"num_residual_streams={n} replaces the residual with hyper-connections; "
                     f"{named.get(cfg.residual, cfg.residual)}=True is another residual: choose one")
    if cfg.placement == "post":
        found.append(f"num_residual_streams={n} keeps n streams that are never normalised themselves "
                     "(arXiv:2409.19606 builds on pre-norm); pre_norm=False normalises the stream: use pre_norm=True")
    for on, keyword in ((cfg.reversible, "reversible=True"), (cfg.universal, "universal=True"),
                        (cfg.hourglass is not None, "hourglass"), (cfg.early_exit is not None, "exit_layers")):
        if on:
            found.append(f"num_residual_streams={n} cannot combine with {keyword}: that depth policy runs the "
                         "blocks on one (b, n, dim) stream")
    return found
