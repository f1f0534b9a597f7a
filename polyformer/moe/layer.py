"""The mixture-of-experts feedforward (Switch arXiv:2101.03961, GShard arXiv:2006.16668, Mixtral
arXiv:2401.04088): a router picks top-k experts per token, each expert runs on its tokens only, and the
gated outputs are summed; shared experts (always on) are added. A token no chosen expert takes (over
capacity, see capacity.py) gets zero from the routed experts: the residual carries it.

Reported through the auxiliary-loss channel: "moe_balance" (weight ff_moe_balance_loss) and "moe_z"
(weight ff_moe_z_loss), summed over the stack's expert layers; "moe_dropped" (the fraction of the real
tokens' routing choices dropped) and "moe_load_<e>" (the fraction routed to expert e) with weight 0,
averaged over the expert layers: logged, never added to a loss."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import universal
from ..checks import values_hidden
from ..config import LayersConfig
from ..interfaces import Context
from .capacity import kept
from .experts import Experts, combine, dispatch
from .options import is_moe
from .router import Router, Routing, balance_loss, load, z_loss


class MoeFeedForward(nn.Module):
    """x (b, n, dim) -> (b, n, dim). `ctx` (the block's forward context) gives the padding mask (padding
    is routed nowhere), the decode state (running capacity counts) and the losses; without it the layer
    runs on its own, every token real, nothing reported."""

    takes_context = True        # Block.step passes ctx to this feedforward
    chunks = 1                  # ff_chunks does not apply (options.problems refuses it)

    def __init__(self, dim: int, cfg: LayersConfig, block: int = 0):
        super().__init__()
        o = cfg.ff.moe
        inner = int(dim * cfg.ff.mult)
        self.options = o
        self.causal = cfg.causal
        self.key = -1 - block       # its running counts in the decode state's per-block history (token shift's >= 0)
        # the expert layers a forward runs (universal=True: the unit's, once per application), for the averages
        runs = universal.steps(cfg) if cfg.universal else 1
        self.layers = runs * sum(is_moe(o, p) for p in range(universal.unit(cfg).count("f")))
        self.router = Router(dim, o)
        self.experts = Experts(dim, inner, o.num_experts, cfg.ff)
        self.shared = Experts(dim, inner * o.shared_experts, 1, cfg.ff) if o.shared_experts else None
        self.balance_group = None   # data-parallel training: the balance loss's f_i over every process's tokens
        # one scalar term per expert (the channel's terms are scalars, the trainer logs a column per name)
        self.load_names = tuple(f"moe_load_{e}" for e in range(o.num_experts))
        self.loss_names = ("moe_balance", "moe_z", "moe_dropped", *self.load_names)

    def forward(self, x: Tensor, ctx: Context | None = None) -> Tensor:
        b, n, dim = x.shape
        o = self.options
        flat = x.reshape(-1, dim)
        routing = self.router(flat)
        mask = ctx.mask if ctx is not None and not o.route_padding else None
        keep = None
        if o.limited:
            real = mask if mask is not None else x.new_ones(b, n, dtype=bool)
            keep = self.limited(routing.experts.view(b, n, -1), real, ctx).reshape(b * n, -1)
        elif mask is not None:
            keep = mask.reshape(-1, 1).expand(-1, o.top_k)
        if values_hidden():     # traced: every expert on every token, weighted by the kept gates
            gates = routing.gates if keep is None else routing.gates * keep
            weights = routing.gates.new_zeros(b * n, o.num_experts).scatter_add(1, routing.experts, gates)
            out = self.experts.everywhere(flat, weights).view(b, n, dim)
        else:
            slots, tokens, counts = dispatch(routing.experts, keep, o.num_experts)
            y = self.experts.routed(flat.index_select(0, tokens), counts)     # backward: one index_add_
            out = combine(y, slots, tokens, routing.gates, b * n).view(b, n, dim)
        if self.shared is not None:
            out = out + self.shared.one(x, 0)
        if ctx is not None:
            self.report(ctx, routing, keep, None if mask is None else mask.reshape(-1))
        return out

    def limited(self, experts: Tensor, real: Tensor, ctx: Context | None) -> Tensor:
        """keep (b, n, k) under the capacity limit; decoding, the running counts are read from and written to
        the decode state."""
        state = ctx.state if ctx is not None else None
        if state is None:
            return kept(experts, real, self.options, self.causal)[0]
        n = experts.shape[1]
        window, _ = state.shift_window(self.key, experts.new_zeros(*real.shape, self.options.num_experts + 1),
                                       reach=1)
        before = window[:, 0] if window.shape[1] > n else None
        keep, counts = kept(experts, real, self.options, self.causal, before)
        window[:, -n:] = counts         # the storage itself (a view): rolled back with the positions
        return keep

    def report(self, ctx: Context, routing: Routing, keep: Tensor | None, real: Tensor | None) -> None:
        o = self.options
        group = self.balance_group if self.training and torch.is_grad_enabled() else None
        ctx.losses.report("moe_balance", balance_loss(routing, real, group), o.balance_loss)
        ctx.losses.report("moe_z", z_loss(routing, real), o.z_loss)
        f = load(routing.experts, o.num_experts, real).detach() / self.layers
        for name, value in zip(self.load_names, f.unbind()):
            ctx.losses.report(name, value, 0.0)
        choices = (real.sum() if real is not None else routing.experts.new_tensor(routing.experts.shape[0])) * o.top_k
        taken = keep.sum() if keep is not None else choices
        dropped = (1 - taken.float() / choices.clamp_min(1).float()) / self.layers
        ctx.losses.report("moe_dropped", dropped.detach(), 0.0)


def feedforward(cfg: LayersConfig, position: int, block: int) -> nn.Module:
    """The branch of the stack's feedforward block `block` (its position-th 'f' block): experts at every
    ff_moe_every-th feedforward position, else the dense FeedForward."""
    if is_moe(cfg.ff.moe, position):
        return MoeFeedForward(cfg.dim, cfg, block)
    from ..feedforward_norm import build     # FeedForward; with SoLU or post_act_ln (feedforward_norm.py)

    return build(cfg.dim, cfg.ff)
