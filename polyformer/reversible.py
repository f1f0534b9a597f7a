"""Reversible layers (RevNet, arXiv:1707.04585, as the Reformer uses them, arXiv:2001.04451): a depth
policy of the layer stack whose training memory does not grow with depth.

The stream is two copies (x1, x2) = (x, x); each attention / feedforward pair of the layout computes

    y1 = x1 + Attn(x2),    y2 = x2 + FF(y1)

(each branch with its block's pre-norm, token shift and sandwich norm), and the stack's output, before
the final norm, is `merge(y1, y2)`. In training each pair is an autograd function that keeps nothing for
the backward (the last pair its outputs): its backward reconstructs the pair's inputs from its outputs,
x2 = y2 - FF(y1) and x1 = y1 - Attn(x2), each branch with the random state it had in the forward (dropout
draws the same masks), and takes the gradients from those recomputations: exact up to float rounding.
Each pair returns its parameters' gradients when it is done, so they accumulate pair by pair. A
feedforward with ff_chunks = c is recomputed and differentiated one piece of the sequence at a time.
Auxiliary losses that branches report reach the forward's record once, as outputs of the functions, so
that their gradients flow. Without autograd (evaluation, decoding with a state) and with return_attn
(the weights need the graph) the pairs run as a plain loop, the same arithmetic.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import Tensor
from torch.utils.checkpoint import get_device_states, set_device_states

from . import checks
from .autodiff import deeper
from .interfaces import AttnOut, Context
from .losses import AuxLosses

if TYPE_CHECKING:
    from .config import LayersConfig
    from .stack import AttentionLayers, Block, Intermediates

_forwarding = [0]       # depth of reversible forwards running (without grad) that a backward will recompute
_recomputing = [0]      # depth of reversible backwards recomputing a branch


def differentiated_forward() -> bool:
    """Whether this call is a forward that autograd will differentiate, run for the first time: grad mode
    is on outside a backward's recomputation (reversible layers, gradient checkpointing), or a reversible
    stack's forward runs (without grad; its backward recomputes it). A module that updates state once per
    training forward (FAVOR+'s redraw count, k-means centroids) updates it only then, so that a
    recomputation sees the forward's state."""
    if _recomputing[0]:
        return False
    if _forwarding[0]:
        return True
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return torch.is_grad_enabled()
    return torch._C._current_graph_task_id() == -1       # not inside a backward (gradient checkpointing)


def merge(y1: Tensor, y2: Tensor, how: str = "mean") -> Tensor:
    """The two streams leaving the last pair -> the stack's output: their mean (b, n, dim), or with
    reversible_merge="concat" (Hugging Face's Reformer) [y1, y2] (b, n, 2 dim)."""
    return torch.cat((y1, y2), dim=-1) if how == "concat" else (y1 + y2) / 2


def branch(block: "Block", x: Tensor, ctx: Context, whole: bool = True) -> tuple[Tensor, AttnOut | None]:
    """What `block` adds to the stream it joins, computed from x (b, n, dim): `Block.step` and the sandwich
    norm (no scale, residual or post-norm: `problems` refuses them). `whole=False`: a feedforward on x as
    one piece (ff_chunks' pieces)."""
    y, attn, _ = block.step(x, ctx, None, whole)
    return (block.norm_out(y) if block.norm_out is not None else y), attn


def forward(stack: "AttentionLayers", x: Tensor, ctx: Context, record: "Intermediates", keep: bool) -> Tensor:
    """The stack's blocks on x (b, n, dim) -> merge(y1, y2), before the final norm. With `keep`,
    record.hiddens gets x (the stack adds the output; the streams between pairs are not kept: that is
    the point, and record.mems stays empty); record.attn the weights, with return_attn."""
    if ctx.mems is not None:
        raise ValueError("mems: a reversible stack (reversible=True) takes no Transformer-XL memories")
    blocks = list(stack.blocks)
    pairs = list(zip(blocks[0::2], blocks[1::2]))
    x1 = x2 = x
    grad = any(p.requires_grad for p in stack.parameters())
    if torch.is_grad_enabled() and (x.requires_grad or grad) and ctx.state is None and not ctx.need_weights:
        run = Run(pairs, ctx, pair_parameters(stack, pairs), x)
        for k in range(len(pairs)):
            x1, x2, values = Pair.apply(x1, x2, run, k, *run.params[k])
            for (name, weight), value in zip(run.names[k], values):
                ctx.losses.report(name, value, weight)
    else:
        for attention, feedforward in pairs:
            y, attn = branch(attention, x2, ctx)
            if attn is not None and attn.weights is not None:
                record.attn.append(attn.weights)
            x1 = x1 + y
            x2 = x2 + branch(feedforward, x1, ctx)[0]
    if keep:
        record.hiddens.append(x)
    return merge(x1, x2, stack.cfg.reversible_merge)


def pair_parameters(stack: "AttentionLayers", pairs: list[tuple["Block", "Block"]]) -> list[list[Tensor]]:
    """For each pair, the parameters its branches may read: its blocks' own, and the stack's outside every
    block and the final norm (the shared score bias). A pair's function returns gradients for just these, so that autograd
    accumulates each parameter's gradient when its last reader is done (a parameter every pair's function
    listed would wait, in autograd's input buffer, for the first pair's backward)."""
    final = [stack.final_norm] if stack.final_norm is not None else []
    inside = {id(p) for module in [*stack.blocks, *final] for p in module.parameters()}
    outside = [p for p in stack.parameters() if id(p) not in inside]
    return [[p for p in dict.fromkeys([*a.parameters(), *f.parameters(), *outside]) if p.requires_grad]
            for a, f in pairs]


@dataclass
class Pass:
    """What one branch's forward leaves for the backward: the random states before it (CPU; the
    accelerator's) and the auxiliary losses it reported, (name, weight) in order."""

    cpu: Tensor
    devices: list[int]
    states: list[Tensor]
    losses: list[tuple[str, float]]


class Run:
    """One reversible forward / backward over `pairs` of blocks (attention, feedforward) with the
    forward's context; `params[k]` are the parameters pair k's branches may read (its function returns
    their gradients). Pair k's backward leaves the streams it reconstructed, its inputs, in `inputs[k]`
    for pair k - 1's."""

    def __init__(self, pairs: list[tuple["Block", "Block"]], ctx: Context, params: list[list[Tensor]], x: Tensor):
        # the context without the record's losses: the graph holds this run, and the losses hold the graph
        self.pairs, self.ctx, self.params = pairs, replace(ctx, losses=AuxLosses()), params
        self.device = x.device.type
        self.autocast = (torch.is_autocast_enabled(self.device), torch.get_autocast_dtype(self.device))
        self.passes: list[Pass] = []
        self.names: list[list[tuple[str, float]]] = []
        self.inputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.last: tuple[Tensor, Tensor] | None = None
        self.grads: list[Tensor | None] = []

    def forward(self, k: int, x1: Tensor, x2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Pair k on the streams (x1, x2) -> (y1, y2), and the auxiliary losses its branches reported as one
        float32 vector (their names and weights in `names[k]`)."""
        values: list[Tensor] = []
        y1 = x1 + self.step(self.pairs[k][0], x2, values)
        y2 = x2 + self.step(self.pairs[k][1], y1, values)
        self.names.append(self.passes[-2].losses + self.passes[-1].losses)
        if k == len(self.pairs) - 1:
            self.last = (y1.detach(), y2.detach())      # not the outputs themselves: they will hold the graph
        return y1, y2, torch.stack(values) if values else x1.new_zeros(0, dtype=torch.float32)

    def step(self, block: "Block", x: Tensor, values: list[Tensor]) -> Tensor:
        devices, states = get_device_states(x)
        local = replace(self.ctx, losses=AuxLosses())
        self.passes.append(Pass(torch.get_rng_state(), devices, states, []))
        y, _ = branch(block, x, local)
        for name, value in local.losses.terms.items():
            self.passes[-1].losses.append((name, local.losses.weights[name]))
            values.append(value)
        return y

    def outputs(self, k: int) -> tuple[Tensor, Tensor]:
        """Pair k's outputs: the inputs pair k + 1's backward reconstructed, or, when that did not run (a
        loss that reads no later pair), undone from the last pair's outputs here."""
        if k + 1 in self.inputs:
            return self.inputs.pop(k + 1)
        y1, y2 = self.last
        for j in range(len(self.pairs) - 1, k, -1):
            y1, y2 = self.backward(j, y1, y2)[:2]
        return y1, y2

    def backward(self, k: int, y1: Tensor, y2: Tensor, dy1: Tensor | None = None, dy2: Tensor | None = None,
                 d_values: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """Pair k undone from its outputs (y1, y2): its inputs (x1, x2), which equal the forward's up to
        float rounding; with the outputs' gradients (dy1, dy2, and the losses' d_values), the inputs'
        gradients too, and the parameters' in `grads`."""
        attention, feedforward = self.pairs[k]
        self.grads = [None] * len(self.params[k])
        split = len(self.passes[2 * k].losses)
        d_a, d_f = (d_values[:split], d_values[split:]) if d_values is not None else (None, None)
        x2, dy1 = self.undo(2 * k + 1, feedforward, y1, y2, dy2, dy1, d_f)
        x1, dx2 = self.undo(2 * k, attention, x2, y1, dy1, dy2, d_a)
        return x1, x2, dy1, dx2

    def undo(self, n: int, block: "Block", inp: Tensor, out: Tensor, d_out: Tensor | None,
             d_inp: Tensor | None, d_losses: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Branch n (block, on inp, added to a stream now `out`) undone: the stream before it,
        out - branch(inp); with d_out (the gradient of out), d_inp plus the gradient through the branch
        (its parameters' gradients added to `grads`)."""
        if block.kind == "f" and block.branch.chunks > 1 and block.shift is None:     # a shift reads across pieces
            pieces = [block.branch.split(t) if t is not None else None for t in (inp, out, d_out, d_inp)]
            with self.replay(n):
                done = [self.one(n, block, *(p[i] if p is not None else None for p in pieces), None, False)
                        for i in range(len(pieces[0]))]
            before = torch.cat([b for b, _ in done], dim=-2)
            return before, torch.cat([g for _, g in done], dim=-2) if d_out is not None else None
        with self.replay(n):
            return self.one(n, block, inp, out, d_out, d_inp, d_losses, True)

    def one(self, n: int, block: "Block", inp: Tensor, out: Tensor, d_out: Tensor | None,
            d_inp: Tensor | None, d_losses: Tensor | None, whole: bool) -> tuple[Tensor, Tensor | None]:
        local = replace(self.ctx, losses=AuxLosses())
        with torch.set_grad_enabled(d_out is not None):
            leaf = inp.detach().requires_grad_(d_out is not None)
            y, _ = branch(block, leaf, local, whole)
        reported = [(name, local.losses.weights[name]) for name in local.losses.terms]
        if reported != self.passes[n].losses:
            raise RuntimeError(f"reversible backward: branch {n} reported the auxiliary losses {reported} when "
                               f"recomputed, {self.passes[n].losses} in the forward")
        before = out - y.detach()
        if d_out is None:
            return before, None
        outputs = [(y, d_out)] + list(zip(local.losses.terms.values(), d_losses if d_losses is not None else []))
        outputs = [(o, g) for o, g in outputs if o.requires_grad]
        if not outputs:
            return before, d_inp
        found = torch.autograd.grad([o for o, _ in outputs], [leaf, *self.params[n // 2]],
                                    [g for _, g in outputs], allow_unused=True)
        for i, g in enumerate(found[1:]):
            if g is not None:
                self.grads[i] = g if self.grads[i] is None else self.grads[i] + g
        return before, d_inp + found[0] if found[0] is not None else d_inp

    @contextlib.contextmanager
    def replay(self, n: int) -> Iterator[None]:
        """Branch n's random state, autocast and `differentiated_forward() == False` while it is recomputed."""
        p = self.passes[n]
        kind = self.device if p.devices else None
        enabled, dtype = self.autocast
        with torch.random.fork_rng(devices=p.devices, device_type=kind), deeper(_recomputing):
            torch.set_rng_state(p.cpu)
            if p.devices:
                set_device_states(p.devices, p.states, device_type=kind)
            with torch.autocast(self.device, dtype=dtype, enabled=enabled):
                yield


class Pair(torch.autograd.Function):
    """(x1, x2, run, k, *params) -> pair k's (y1, y2, the auxiliary losses' values). It saves nothing but
    the last pair's outputs; its backward reconstructs its inputs from its outputs (left by the next
    pair's backward) and returns its parameters' gradients, so that they accumulate pair by pair."""

    @staticmethod
    def forward(ctx: Any, x1: Tensor, x2: Tensor, run: Run, k: int, *params: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        with deeper(_forwarding):
            y1, y2, values = run.forward(k, x1, x2)
        ctx.run, ctx.k = run, k
        if k == len(run.pairs) - 1:
            ctx.save_for_backward(y1, y2)
        return y1, y2, values

    @staticmethod
    def backward(ctx: Any, dy1: Tensor, dy2: Tensor, d_values: Tensor) -> tuple[Tensor | None, ...]:
        run, k = ctx.run, ctx.k
        y1, y2 = ctx.saved_tensors if k == len(run.pairs) - 1 else run.outputs(k)
        x1, x2, dx1, dx2 = run.backward(k, y1, y2, dy1, dy2, d_values)
        if k:
            run.inputs[k] = (x1, x2)
        return (dx1, dx2, None, None, *run.grads)


def problems(cfg: "LayersConfig") -> list[str]:
    """What reversible=True cannot combine with, naming the keywords."""
    if not isinstance(cfg.reversible, bool):
        return checks.flag(cfg.reversible, "reversible")
    if cfg.reversible_merge not in ("mean", "concat"):
        return [f"reversible_merge must be 'mean' or 'concat', got {cfg.reversible_merge!r}"]
    if not cfg.reversible:
        return [] if cfg.reversible_merge == "mean" else [
            f"reversible_merge={cfg.reversible_merge!r} merges the two streams of reversible=True, which is off"]
    found = []
    layout = cfg.layout
    if layout != ("a", "f") * (len(layout) // 2) or not layout:
        found.append(f"reversible=True needs a layout of attention / feedforward pairs ('a', 'f' repeated); "
                     f"{cfg.layout_keyword} makes it {''.join(layout)!r}")
    if cfg.residual != "add":
        named = {"rezero": "use_rezero", "gru": "gate_residual", "deepnorm": "deepnorm"}.get(cfg.residual, f"residual {cfg.residual!r}")
        found.append(f"reversible=True needs plain residual addition (y1 = x1 + Attn(x2)); {named} changes it")
    if cfg.placement == "post":
        found.append("reversible=True needs the norms inside the branches (pre_norm=True or sandwich_norm=True); "
                     "pre_norm=False normalises the stream itself, which the backward cannot undo")
    if cfg.gradient_checkpointing:
        found.append("reversible=True recomputes every block in the backward already; gradient_checkpointing=True "
                     "is redundant: choose one")
    if cfg.residual_attn:
        found.append("reversible=True recomputes each pair on its own in the backward; residual_attn=True "
                     "carries attention scores from block to block")
    return found
