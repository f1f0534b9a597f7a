"""Early exit: the depth-adaptive transformer (Elbayad et al. 2020, arXiv:1910.10073) and CALM (Schuster et al.
2022, arXiv:2207.07061), a depth policy of a causal stack.

`exit_layers` names the layers after which a token may stop (layer counts n in [1, depth]; True: every
layer); the shared output head (the stack's final norm and the wrapper's `to_logits`) reads the stream there.
`exit_confidence` is one of CALM's three measures, each in [0, 1] or [-1, 1], compared with `exit_threshold`
(a token exits when its confidence is strictly above it, so 1 never exits):

    softmax_margin   p_(1) - p_(2), the top two probabilities of the exit head's softmax
    state_change     cos(h_n, h_m), the stream at this exit layer against the previous exit layer's (the
                     stack's input for the first): CALM's hidden-state saturation
    classifier       sigmoid(w_n . f(h_n) + b_n), a linear classifier per exit layer on the head's input
                     f(h_n), trained with CALM's oracle labels 1[argmax head(h_n) = argmax head(h_N)] by binary
                     cross-entropy on detached inputs (the language model is not changed by it)

Training (`next_token_loss`, used by `AutoregressiveWrapper.forward` and the trainer's language modelling in
training mode) is CALM's weighted average of the exit layers' next-token losses with w_n = n / sum_m m over
the exit layers and the last one (weights proportional to the layer index, normalised to sum to 1); each
layer's loss is logged as "exit_ce_<n>" (weight 0), the classifier's as "exit_classifier" (weight 1).

Decoding (`generate/early_exit.py` turns the policy on for one-token steps) runs the layers until every row's
token has exited: an exited row's stream is frozen, and each later layer computes its keys / values from
that frozen state (CALM's state propagation), so later tokens attend to them. Once every row has exited the
remaining layers run nothing but their key / value projection: their attention and feedforward are skipped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention.keys import self_source
from .checks import number
from .interfaces import Context
from .losses import AuxLosses
from .precision import upcast

if TYPE_CHECKING:
    from .config import LayersConfig
    from .stack import AttentionLayers, Intermediates

MEASURES = ("softmax_margin", "state_change", "classifier")


@dataclass(frozen=True)
class ExitOptions:
    layers: tuple[int, ...] | None = None   # layer counts after which a token may exit; None: every layer
    confidence: str = "softmax_margin"      # one of MEASURES
    threshold: float = 0.9                  # exit when the confidence is > threshold; in [0, 1]


def keyword(arg: Any) -> ExitOptions | None:
    """exit_layers=True (every layer), a sequence of layer counts, one count, or False / None (off)."""
    if arg is None or arg is False:
        return None
    if arg is True:
        return ExitOptions()
    if isinstance(arg, int):
        return ExitOptions(layers=(arg,))
    if isinstance(arg, (list, tuple)):
        return ExitOptions(layers=tuple(arg))
    raise TypeError(f"expected True or a sequence of layer counts in [1, depth], got {arg!r}")


def unit_length(cfg: "LayersConfig") -> int | None:
    """Blocks per layer when the layout is `depth` repeats of one unit, else None."""
    layout = cfg.layout
    if len(layout) % cfg.depth:
        return None
    u = len(layout) // cfg.depth
    return u if layout == layout[:u] * cfg.depth and "a" in layout[:u] else None


def problems(cfg: "LayersConfig") -> list[str]:
    """What exit_layers / exit_confidence / exit_threshold cannot be or combine with, naming the keywords."""
    from .attention.kernels.direct import switch
    from .registry import KERNEL

    o, found = cfg.early_exit, []
    layers = o.layers if o.layers is not None else tuple(range(1, cfg.depth + 1))
    if not layers or any(not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= cfg.depth for n in layers):
        found.append(f"exit_layers must be layer counts in [1, depth={cfg.depth}] (exit after that many layers), "
                     f"got {o.layers!r}")
    elif len(set(layers)) != len(layers):
        found.append(f"exit_layers names a layer twice: {o.layers!r}")
    elif max(layers) == cfg.depth and len(layers) == 1:
        found.append(f"exit_layers={o.layers!r} names only the last layer (depth={cfg.depth}): no token could exit early")
    if o.confidence not in MEASURES:
        found.append(f"exit_confidence must be one of {list(MEASURES)}, got {o.confidence!r}")
    if not number(o.threshold) or not 0 <= o.threshold <= 1:
        found.append(f"exit_threshold must be a number in [0, 1] (1 never exits), got {o.threshold!r}")
    if not cfg.causal:
        found.append("exit_layers stops tokens while decoding; it needs a causal stack (a Decoder)")
    for name, on in (("universal=True", cfg.universal), ("reversible=True", cfg.reversible),
                     ("hourglass", cfg.hourglass is not None)):
        if on:
            found.append(f"exit_layers cannot combine with {name}: both are depth policies of the stack")
    if cfg.ff.moe is not None and cfg.ff.moe.limited:
        found.append("exit_layers cannot combine with ff_moe_capacity / ff_moe_capacity_factor: an exited token skips "
                     "later layers' experts, whose running capacity counts would no longer match a full forward")
    if cfg.mixer is not None:
        found.append(f"exit_layers propagates an exited token's state to self-attention keys; "
                     f"{switch('mixer.', cfg.mixer.name)}=True replaces self-attention")
    for a in cfg.self_attention:
        if KERNEL[a.kernel.name].caps.decode == "recurrent":
            found.append(f"exit_layers cannot combine with {switch('attention.kernel.', a.kernel.name)}: its decode "
                         "state is a recurrent summary that skipped layers cannot update without running attention")
    if unit_length(cfg) is None and not found:
        found.append(f"exit_layers counts layers of one repeating unit of blocks; {cfg.layout_keyword} makes the layout "
                     f"{''.join(cfg.layout)}")
    return found


def softmax_margin(logits: Tensor) -> Tensor:
    """Logits (..., v) -> p_(1) - p_(2) (...), in float32 or above."""
    top = upcast(logits).softmax(-1).topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def state_change(h: Tensor, before: Tensor) -> Tensor:
    """Streams (..., dim) -> cos(h, before) (...), in float32 or above; clamped to [-1, 1], since rounding can
    put nearly parallel streams above 1, which threshold 1 must never pass."""
    return F.cosine_similarity(upcast(h), upcast(before), dim=-1).clamp(-1.0, 1.0)


@dataclass
class ExitRun:
    """One decoding step's settings (the head, the threshold) and what it did: `layers` (b, n), the layer
    count each position stopped at."""

    head: Callable[[Tensor], Tensor]
    threshold: float
    layers: Tensor | None = None


class EarlyExit(nn.Module):
    """The early-exit policy of a stack (its `early_exit`): exit layers, confidence, classifier, losses."""

    def __init__(self, stack: "AttentionLayers", owner: str):
        super().__init__()
        cfg = stack.cfg
        found = problems(cfg)
        if found:
            raise ValueError(f"{owner}: {found[0]}")
        o = cfg.early_exit
        self.depth, self.unit = cfg.depth, unit_length(cfg)
        self.exits = tuple(sorted(n for n in (o.layers or range(1, cfg.depth + 1)) if n < cfg.depth))
        self.measure, self.threshold = o.confidence, float(o.threshold)
        self.classifier = nn.Linear(stack.out_dim, len(self.exits)) if o.confidence == "classifier" else None
        self.register_buffer("trained", torch.zeros((), dtype=torch.long))    # classifier updates so far
        self.loss_names = tuple(f"exit_ce_{n}" for n in (*self.exits, self.depth)) + (
            ("exit_classifier",) if self.classifier is not None else ())
        self.run: ExitRun | None = None

    @property
    def running(self) -> bool:
        return self.run is not None

    def checked(self, threshold: float | None) -> float:
        """The decoding threshold (None: exit_threshold), refused by name when out of range or when the
        classifier it would read is untrained."""
        threshold = self.threshold if threshold is None else threshold
        if not number(threshold) or not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be a number in [0, 1] (1 never exits), got {threshold!r}")
        if self.classifier is not None and int(self.trained) == 0:
            raise ValueError("exit_confidence='classifier' needs a trained classifier: train the model (its "
                             "next-token loss trains it) before decoding with exits")
        return float(threshold)

    @contextlib.contextmanager
    def decoding(self, head: Callable[[Tensor], Tensor], threshold: float | None = None) -> Iterator[ExitRun]:
        """Within it, a stack forward with a decode state stops each token at its first confident exit layer;
        `head` maps the head's input (b, n, dim) to logits (softmax_margin reads them)."""
        self.run = ExitRun(head, self.checked(threshold))
        try:
            yield self.run
        finally:
            self.run = None

    def features(self, stack: "AttentionLayers", h: Tensor) -> Tensor:
        """The head's input at a stream h (b, n, dim): the stack's final norm, when it has one."""
        return stack.final_norm(h) if stack.final_norm is not None else h

    def confidence(self, stack: "AttentionLayers", h: Tensor, before: Tensor, layer: int,
                   head: Callable[[Tensor], Tensor]) -> Tensor:
        """The confidence (b, n) of exiting at `layer` with stream h; `before`: the previous exit layer's stream."""
        if self.measure == "state_change":
            return state_change(h, before)
        f = self.features(stack, h)
        if self.measure == "softmax_margin":
            return softmax_margin(head(f))
        return torch.sigmoid(upcast(self.classifier(f)[..., self.exits.index(layer)]))

    def forward(self, stack: "AttentionLayers", x: Tensor, ctx: Context, record: "Intermediates", keep: bool) -> Tensor:
        """One decoding step x (b, n, dim) through the stack's modules -> the stream each position exited with
        (before the final norm); the layers they used in `self.run.layers`."""
        if ctx.state is None:
            raise ValueError("early-exit decoding runs against a decode state (state=...)")
        if stack.layer_pos is not None:
            raise ValueError("exit_layers cannot combine with abs_pos_per_layer: an exited state has no next layer")
        run, prev, blocks = self.run, {"a": None, "c": None}, tuple(stack.blocks)     # slicing a ModuleList builds one
        x, run.layers = self.walk(
            x, blocks, lambda block, h: stack.run_blocks((block,), h, ctx, record, keep, prev),
            lambda layer, h: self.propagate(blocks[layer * self.unit: (layer + 1) * self.unit], h, ctx),
            lambda h, before, layer: self.confidence(stack, h, before, layer, run.head), run.threshold)
        return x

    def walk(self, x: Tensor, blocks: Sequence[Any], run: Callable[[Any, Tensor], Tensor],
             skip: Callable[[int, Tensor], None], confidence: Callable[[Tensor, Tensor, int], Tensor],
             threshold: float) -> tuple[Tensor, Tensor]:
        """The exit loop of one decoding step over `blocks` (the stack's, or a fast step's for them), x (b, n, dim)
        -> (the stream each position exited with, the layer count (b, n) each stopped at). run(block, h): the
        block's output; skip(layer, h): the 0-based layer's blocks propagated from h once every position has
        exited; confidence(h, before, layer count). An exited position's stream stays frozen block by block, so
        the blocks still run for other positions write its keys / values from its exit state, as skip would."""
        live: Tensor | None = None          # None: every position still runs
        stopped: Tensor | None = None       # None: none has exited
        before = x
        for layer in range(self.depth):
            if live is not None and not bool(live.any()):
                skip(layer, x)
                continue
            for block in blocks[layer * self.unit: (layer + 1) * self.unit]:
                new = run(block, x)
                x = new if live is None else torch.where(live[..., None], new, x)
            if layer + 1 in self.exits:
                stop = confidence(x, before, layer + 1) > threshold
                stop = stop if live is None else stop & live
                if bool(stop.any()):
                    base = stopped if stopped is not None else torch.full_like(stop, self.depth, dtype=torch.long)
                    stopped, live = base.masked_fill(stop, layer + 1), ~stop if live is None else live & ~stop
                before = x
        return x, stopped if stopped is not None else torch.full(x.shape[:2], self.depth, device=x.device)

    @staticmethod
    def propagate(blocks: Any, x: Tensor, ctx: Context) -> None:
        """Skipped blocks for the frozen stream x: self-attention writes its keys / values computed from x to the
        decode state, a token-shifting block records its input; nothing else runs."""
        for block in blocks:
            if block.kind == "c" or (block.kind == "f" and block.shift is None):
                continue
            h = block.norm_in(x) if block.norm_in is not None else x
            if block.shift is not None:
                h = block.shifted(h, ctx.state)
            if block.kind == "a":
                write_keys(block.branch, h, ctx)

    def loss(self, net: nn.Module, logits: Tensor, record: "Intermediates", target: Tensor,
             ignore_index: int) -> tuple[Tensor, AuxLosses]:
        """The weighted average of the exit layers' next-token losses (and the last layer's, `logits`), plus the
        blocks' auxiliary losses and the classifier's; record.hiddens holds every block's input."""
        stack, m = net.attn_layers, net.num_memory_tokens
        aux = record.losses
        counts = (*self.exits, self.depth)
        total = float(sum(counts))
        final = logits.detach().argmax(-1)
        kept = target != ignore_index
        loss = ce = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=ignore_index)
        loss = loss * (self.depth / total)
        aux.report(f"exit_ce_{self.depth}", ce.detach(), 0.0)
        judged = []
        for e, n in enumerate(self.exits):
            f = self.features(stack, record.hiddens[n * self.unit][:, m:])
            exit_logits = net.head(f)
            ce = F.cross_entropy(exit_logits.transpose(1, 2), target, ignore_index=ignore_index)
            loss = loss + ce * (n / total)
            aux.report(f"exit_ce_{n}", ce.detach(), 0.0)
            if self.classifier is not None:
                label = (exit_logits.detach().argmax(-1) == final).to(f.dtype)
                score = self.classifier(f.detach())[..., e]
                judged.append(F.binary_cross_entropy_with_logits(upcast(score[kept]), upcast(label[kept])))
        if judged:
            aux.report("exit_classifier", torch.stack(judged).mean(), 1.0)
            self.trained += 1
        extra = aux.total()
        return (loss if extra is None else loss + extra.to(loss.dtype)), aux


def write_keys(attn: nn.Module, h: Tensor, ctx: Context) -> None:
    """Self-attention block `attn`'s keys / values of h (b, n, dim) into the decode state: its key / value
    projection alone (the fused projection's rows) where the block has plain heads, rotated like the queries'
    keys would be; nothing else of the block runs."""
    p = attn.project
    src = self_source(h, ctx, attn.layer)
    if ctx.state.keeps_latents:             # multi-latent inputs, rotated when read (attention/latent.py)
        ctx.state.attend(attn.layer, p.latent(src))
        return
    if type(getattr(p, "to_qkv", None)) is nn.Linear and p.infusion is None and p.mixing is None and not p.shared_qk:
        q_out, k_out, v_out = p.split
        bias = p.to_qkv.bias[q_out:] if p.to_qkv.bias is not None else None
        k, v = F.linear(h, p.to_qkv.weight[q_out:], bias).split((k_out, v_out), dim=-1)
        kv = p._heads_kv(k, v, src)
    else:                                   # position-infused, collaborative or shared-qk heads, quantized weights
        _, kv = p(h, src, ctx.pos)
    if attn.position is not None:
        _, kv.k = attn.position(kv.k, kv.k, ctx.pos, kv.pos)
    ctx.state.attend(attn.layer, kv)


def policy_of(model: nn.Module) -> tuple[nn.Module, EarlyExit] | None:
    """(the TransformerWrapper inside `model` - DDP, FSDP or torch.compile hold it as `module` / `_orig_mod` -,
    its stack's early-exit policy), or None when it has none."""
    net = model
    while not hasattr(net, "attn_layers") and isinstance(getattr(net, "module", getattr(net, "_orig_mod", None)),
                                                         nn.Module):
        net = getattr(net, "module", None) or net._orig_mod
    policy = getattr(getattr(net, "attn_layers", None), "early_exit", None)
    return (net, policy) if isinstance(policy, EarlyExit) else None


def next_token_loss(model: nn.Module, inp: Tensor, target: Tensor, ignore_index: int = -100,
                    **kwargs: Any) -> tuple[Tensor, AuxLosses] | None:
    """The early-exit training loss of `model` (a TransformerWrapper, perhaps wrapped) on inputs inp (b, n) and
    next tokens target (b, n): (loss, its AuxLosses), or None when the model has no exit layers or is not in
    training mode (evaluation scores the full model)."""
    found = policy_of(model)
    if found is None or not found[0].training:
        return None
    net, policy = found
    if net.attn_layers.layer_pos is not None:
        raise ValueError("exit_layers cannot combine with abs_pos_per_layer: an exited state has no next layer")
    logits, record = model(inp, return_intermediates=True, **kwargs)
    return policy.loss(net, logits, record, target, ignore_index)
