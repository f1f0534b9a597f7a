"""The layer stack: a layout of blocks ('a' self-attention, 'c' cross-attention, 'f' feedforward),
each joined to the residual stream by a norm placement and a residual policy.

`AttentionLayers`, `Encoder`, `Decoder` and `CrossAttender` take the x-transformers keywords
(see `keywords.py`); `from_config` rebuilds any of them from a `LayersConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import checks, deepnet, early_exit, per_layer, residual_extras, reversible, rules, stack_policies, universal
from . import attn_mask as attn_masks
from .attention import hard_log_probs, knn_memory, latent
from .attention.attention import Attention
from .block import Block
from .position import relative
from .config import LayersConfig
from .hourglass import Hourglass
from .moe.layer import feedforward as moe_feedforward
from .interfaces import Context
from .keywords import parse_layers
from .losses import AuxLosses
from .memory.kv_cache import DecodeState
from .memory.window_state import window_state
from .registry import KERNEL, MIXER, NORM, RESIDUAL, SCORE_BIAS
from .shift import TokenShift


@dataclass
class Intermediates:
    """What a stack computed on the way, for inspection and for XL memories.

    hiddens: the residual stream entering each block, then the stack's output before the final norm
        (len(layout) + 1 tensors of (b, n, dim)).
    attn: the attention weights (b, h, i, j) of every attention block, in order, when
        `return_attn=True`; memory key / values come first along j.
    mems: for each self-attention block, the (normalised) input its keys and values were computed
        from: (b, n, dim). The wrappers turn these into the next segment's `mems`.
    losses: the auxiliary losses the blocks reported (losses.py): `losses.total()` is what a
        training loss adds.
    """

    hiddens: list[Tensor] = field(default_factory=list)
    attn: list[Tensor] = field(default_factory=list)
    mems: list[Tensor] = field(default_factory=list)
    # a lambda: torch.compile cannot call the class as a factory
    losses: AuxLosses = field(default_factory=lambda: AuxLosses())
    gumbel_log_probs: list[Tensor] = field(default_factory=list)    # return_gumbel_log_probs (hard_log_probs.py)


class AttentionLayers(nn.Module):
    """A stack of attention and feedforward blocks. Keywords as in x-transformers, e.g.
    `AttentionLayers(dim=512, depth=6, heads=8, causal=True, rotary_pos_emb=True)`.

    Args of forward:
        x: (b, n, dim) float.
        mask: (b, n) bool, True = keep; masked positions are never attended to.
        context: (b, m, dim_context) for cross-attention blocks; context_mask: (b, m) bool.
        mems: one (b, m, dim) memory per self-attention block (Transformer-XL), attended to before x.
        mem_masks: one (b, m) bool per memory, or a single (b, m) for all of them.
        pos: (b|1, n) positions of x; default m, m+1, ... after the memories, or after the cache.
        state: a `DecodeState` (from `new_state`): keys and values of earlier steps are read from it
            and this step's are written to it; x holds only the new positions.
        prefix: the first `prefix` positions of x are memory tokens: attended to like the others,
            but token shift does not move their features into the text.
        global_mask: (b, n) bool, with an attention pattern on an Encoder: the marked tokens see every
            key and are seen by every query (Longformer's global attention).
        prefix_len: prefix-LM, for a causal stack: int or (b,); the first prefix_len text positions
            of each row (after memory tokens) are seen by every query, so the prefix attends to
            itself bidirectionally and the rest stays causal.
        return_attn: keep the attention weights (forces the reference path); returns
            (out, Intermediates) like return_intermediates.
        return_intermediates: return (out, Intermediates).
        return_gumbel_log_probs: (out, Intermediates) with `gumbel_log_probs`: per block that picks keys
            (attn_hard, attn_gumbel_softmax), the log-probability of each query's pick (attention/hard_log_probs.py).
        knn_clear: (b,) bool, with knn_memory_layers: clear these rows' kNN memories first (a new document).
        attn_mask: (i, j), (h, i, j) or (b, h, i, j) bool over x's text positions: which keys each query of
            every self-attention block may see, on top of its pattern (x-transformers' attn_mask; attn_mask.py).
        carried: by self-attention block, memories that cross forward calls (memory/infini_carry.py).
        condition: (b, dim_condition) or (b, n, dim_condition) for use_adaptive_layernorm / _rmsnorm / _layerscale.
    """

    fixed: dict[str, Any] = {}

    def __init__(self, **keywords: Any):
        super().__init__()
        owner = type(self).__name__
        for name, value in self.fixed.items():
            if name in keywords:
                raise TypeError(f"{owner} sets {name}={value!r} itself; use AttentionLayers to choose it")
        self._build(parse_layers({**keywords, **self.fixed}, owner=owner), owner)

    @classmethod
    def from_config(cls, cfg: LayersConfig) -> "AttentionLayers":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._build(cfg, cls.__name__)
        return self

    def _build(self, cfg: LayersConfig, owner: str) -> None:
        rules.check(cfg, owner)
        self.cfg = cfg
        self.dim = cfg.dim
        self.causal = cfg.causal
        a = cfg.attention
        bias_cls = SCORE_BIAS[a.bias].build
        if bias_cls is None:
            self.shared_bias = None
        elif a.bias == "t5":
            self.shared_bias = bias_cls(a.heads, cfg.causal, a.rel_pos_num_buckets, a.rel_pos_max_distance)
        elif a.bias == "dynamic":           # position/dynamic_bias.py
            self.shared_bias = bias_cls(cfg.dim, a.heads, cfg.dynamic_pos_bias)
        else:
            self.shared_bias = bias_cls(a.heads, a.alibi_num_heads)
        self.shared_relative = relative.shared(a)     # Transformer-XL's u, v shared by the blocks (or None)
        layout = universal.unit(cfg)        # the layout as built (universal=True: one shared unit)
        shifts = cfg.shift_tokens if isinstance(cfg.shift_tokens, tuple) else (cfg.shift_tokens,) * len(layout)
        norm_cls = NORM[cfg.norm].build

        def norm() -> nn.Module | None:
            return norm_cls(cfg.dim, cfg.norm_eps) if norm_cls is not None else None

        blocks = []
        n_self = n_cross = 0
        for index, (kind, s) in enumerate(zip(layout, shifts)):
            if kind == "f":         # dense, or experts at every ff_moe_every-th feedforward (moe/)
                branch: nn.Module = moe_feedforward(cfg, layout[:index].count("f"), index)
            elif kind == "a" and cfg.mixer is not None:
                branch = MIXER[cfg.mixer.name].build(cfg.dim, cfg, n_self)
                n_self += 1
            else:
                branch = Attention(cfg.dim, cfg.attention_of(n_self) if kind == "a" else a, causal=cfg.causal,
                                   layer=n_self if kind == "a" else n_cross,
                                   cross=kind == "c",
                                   dim_context=cfg.dim_context, shared_bias=self.shared_bias,
                                   keep_scores=cfg.residual_attn if kind == "a" else cfg.cross_residual_attn,
                                   shared_relative=self.shared_relative)
                n_self += kind == "a"
                n_cross += kind == "c"
            shift = TokenShift(tuple(range(0 if cfg.causal else -s, s + 1))) if s > 0 else None
            blocks.append(Block(
                kind, branch, RESIDUAL[cfg.residual].build(cfg.dim),
                norm_in=norm() if cfg.placement in ("pre", "sandwich") else None,
                norm_out=norm() if cfg.placement == "sandwich" else None,
                post_norm=norm() if cfg.placement == "post" else None,
                shift=shift, scale=0.5 if cfg.macaron and kind == "f" else 1.0, index=index))
        self.blocks = nn.ModuleList(blocks)
        knn_memory.attach(self)             # knn_memory_layers: those blocks' kNN memories
        self.layer_pos: nn.Module | None = None     # a wrapper's abs_pos_per_layer tables (position/per_layer_abs.py)
        per_layer.check_state(self, owner)      # attn_per_layer: one decode state for blocks of their own shapes
        # DeepNet: alpha into the residuals, the beta-scaled init of the blocks' weights (deepnet.py)
        self.deepnorm = deepnet.setup(self) if cfg.residual == "deepnorm" else None
        self.window = self._decode_window() if cfg.hourglass is None else None   # an hourglass state cannot slide
        self.universal = universal.Universal(cfg, n_self) if cfg.universal else None
        self.num_self_attn = n_self * (self.universal.steps if self.universal is not None else 1)
        self.hourglass = Hourglass(self) if cfg.hourglass is not None else None   # a depth policy (hourglass.py)
        self.early_exit = early_exit.EarlyExit(self, owner) if cfg.early_exit is not None else None  # early_exit.py
        self.has_cross = "c" in layout
        final = cfg.placement in ("pre", "sandwich") and norm_cls is not None     # of out_dim features
        self.final_norm = norm_cls(self.out_dim, cfg.norm_eps) if final else None
        residual_extras.setup(self)     # hyper-connections, layerscale, adaptive norms, DyT (residual_extras.py)
        stack_policies.attach(self)     # layer_dropout, reinject_input, layers_execute_order, unet_skips, ...

    def _decode_window(self) -> tuple[int, int] | None:
        """(sinks, span) when every self-attention block's pattern can only show the first `sinks`
        positions and the last `span` ones (a causal window, perhaps with sinks): a decode state then
        keeps just those (`window`, read by generation at every step). None otherwise."""
        stages = [getattr(b.branch, "decode_window", None) for b in self.blocks if b.kind == "a"]   # mixers: None
        if not stages or any(s is None or s.decode != "window" for s in stages):
            return None
        return max(s.sinks for s in stages), max(s.span for s in stages)    # blocks may differ (attn_per_layer)

    @staticmethod
    def next_positions(n: int, mems: list[Tensor] | None, state: DecodeState | None,
                       device: torch.device) -> Tensor:
        """Default positions of n new tokens: after the XL memories, or after each row's last cached
        position; 0, 1, ... otherwise."""
        steps = torch.arange(n, device=device)[None]
        if state is not None and state.length:
            return state.last_positions() + 1 + steps
        m = mems[0].shape[1] if mems else 0
        return steps + m

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, history: int = 1) -> DecodeState:
        """A decode state with room for max_len positions (see memory/kv_cache.py). Blocks whose
        kernel keeps a recurrent summary (Performer, linear, RFA) keep that instead of keys, and the
        summaries after their last `history` positions, so that many positions can be rolled back."""
        if not self.causal:
            raise ValueError("a decode state needs a causal stack (a Decoder)")
        attention = [b.branch for b in self.blocks if b.kind == "a"]
        kinds = tuple(a.decode_kind for a in attention) * (self.universal.steps if self.universal is not None else 1)
        kinds = self.loop.kinds(kinds) if self.loop is not None else kinds     # one per run (stack_order.py)
        keyed = [a for a, kind in zip(attention, kinds) if kind == "keys"]
        # no block keeping keys (custom_layers "f", "cf"; recurrent kernels): nothing but positions, shifts, context
        heads = keyed[0].decode_dims if keyed else (1, 1, 1, 1)
        if self.hourglass is None:          # multi-latent inputs rather than keys, where every block allows
            heads = latent.state_dims(keyed) or heads
        param = next(self.parameters())
        if self.hourglass is not None:      # a state per resolution (memory/hourglass_state.py)
            return self.hourglass.new_state(self, batch, max_len, heads, dtype or param.dtype, device or param.device,
                                            history)
        if self.window is not None:         # a ring of the window, whatever max_len asks (memory/window_state.py)
            return window_state(self, batch, heads, dtype or param.dtype, device or param.device, history)
        return DecodeState(self.num_self_attn, batch, max_len, *heads, dtype=dtype or param.dtype,
                           device=device or param.device, kinds=kinds, history=history)

    @property
    def out_dim(self) -> int:
        """The feature size of the stack's output: 2 dim when a reversible stack concatenates its two
        streams (reversible_merge="concat"), else dim."""
        return 2 * self.cfg.dim if self.cfg.reversible and self.cfg.reversible_merge == "concat" else self.cfg.dim

    @property
    def has_pos_emb(self) -> bool:
        """Whether the blocks carry positions themselves (rotary, infused, T5, ALiBi, relative schemes, DA)."""
        return any(a.position != "none" or a.bias != "none" or a.relative is not None
                   or KERNEL[a.kernel.name].caps.positional for a in self.cfg.self_attention)

    @property
    def layout(self) -> tuple[str, ...]:
        return self.cfg.layout

    def run_blocks(self, blocks: Any, x: Tensor, ctx: Context, record: Intermediates, keep: bool,
                   prev: dict[str, Tensor | None]) -> Tensor:
        """`blocks` (this stack's `Block`s) on x in order, as every depth policy runs them: checkpointed in
        training when asked; with `keep`, each block's input (and a self-attention block's normalised
        input) in `record`; `prev` carries each kind's scores to the next block (residual attention)."""
        for block in blocks:
            if self.layer_pos is not None:
                x = self.layer_pos(x, block.index, ctx)
            if keep:
                record.hiddens.append(x)
            if self.layer_drop is not None and self.training and self.layer_drop.skips(block, x, ctx, record, keep):
                continue                    # layer_dropout (stack_policies.py)
            if self.cfg.gradient_checkpointing and self.training and torch.is_grad_enabled():
                own = replace(ctx, losses=AuxLosses())      # the backward's second run reports here, not twice
                x, attn, h = checkpoint(block, x, own, prev.get(block.kind), use_reentrant=False)
                ctx.losses.merge(own.losses)
            else:
                x, attn, h = block(x, ctx, prev.get(block.kind))
            if attn is not None:
                prev[block.kind] = attn.scores
                if attn.weights is not None:
                    record.attn.append(attn.weights)
            if keep and block.kind == "a":
                record.mems.append(h)
        return x

    def forward(self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None,
                context_mask: Tensor | None = None, mems: list[Tensor] | None = None,
                mem_masks: list[Tensor] | Tensor | None = None, pos: Tensor | None = None,
                state: DecodeState | None = None, prefix: int = 0,
                prefix_len: Tensor | int | None = None, return_attn: bool = False,
                return_intermediates: bool = False, global_mask: Tensor | None = None,
                knn_clear: Tensor | None = None, carried: dict | None = None, attn_mask: Tensor | None = None,
                condition: Tensor | None = None,
                return_gumbel_log_probs: bool = False) -> Tensor | tuple[Tensor, Intermediates]:
        if return_gumbel_log_probs:         # (out, record with gumbel_log_probs): attention/hard_log_probs.py
            return hard_log_probs.returned(self, self, dict(locals()))
        checks.stack_inputs(self, x, mask, context, context_mask, mems, mem_masks, pos)
        if global_mask is not None:
            checks.global_mask(self, global_mask, x)
        if state is not None:
            checks.decode_state(self, state, x, mems)
        if isinstance(mem_masks, Tensor):
            mem_masks = [mem_masks] * self.num_self_attn
        if pos is None:
            pos = self.next_positions(x.shape[1], mems, state, x.device)
        prefix_span = None
        if prefix_len is not None:        # counted from the first text position, after memory tokens
            prefix_len = checks.prefix_len(prefix_len, x.shape[0], x.shape[1] - prefix, self.causal)
            start = pos[:, prefix: prefix + 1].expand(x.shape[0], 1)
            prefix_span = (start, start + prefix_len[:, None])
        shift_mask = mask
        if prefix:
            shift_mask = mask.clone() if mask is not None else x.new_ones(x.shape[:2], dtype=torch.bool)
            shift_mask[:, :prefix] = False
        if attn_mask is not None:
            attn_mask = attn_masks.prepare(self, attn_mask, x, prefix, mems, state)
        ctx = Context(pos=pos, mask=mask, causal=self.causal, context=context, context_mask=context_mask,
                      mems=mems, mem_masks=mem_masks, need_weights=return_attn, prefix_span=prefix_span,
                      global_mask=global_mask,
                      shift_mask=shift_mask, attn_mask=attn_mask,
                      state=state, carried=carried)
        ctx = stack_policies.begin(self, x, ctx)    # reinject_input, value residual, cross_attn_tokens_dropout
        knn_memory.begin(self, knn_clear, x, state is not None)
        if state is not None:
            state.begin(pos, mask, prefix)
        x = residual_extras.enter(self, x, condition)   # the adaptive norms' condition; n residual streams
        keep = return_intermediates or return_attn      # else hold no block's input past its use
        record = Intermediates(losses=ctx.losses)
        prev = {"a": None, "c": None}
        if self.cfg.reversible:             # depth policies (at most one) run the blocks themselves
            x = reversible.forward(self, x, ctx, record, keep)          # as attention / feedforward pairs
        elif self.universal is not None:
            x = self.universal(self, x, ctx, record, keep)              # one unit, depth times or until halted
        elif self.hourglass is not None:
            x = self.hourglass(self, x, ctx, record, keep, prefix)      # at their resolutions
        elif self.early_exit is not None and self.early_exit.running and state is not None:
            x = self.early_exit(self, x, ctx, record, keep)             # decoding: a token stops once confident
        elif self.loop is not None:
            x = self.loop(self, x, ctx, record, keep, prev)             # layers_execute_order, unet_skips
        else:
            x = self.run_blocks(self.blocks, x, ctx, record, keep, prev)
        x = residual_extras.leave(self, x)
        if keep:
            record.hiddens.append(x)
        if state is not None:
            state.commit()
        if self.final_norm is not None:
            x = self.final_norm(x)
        residual_extras.release(self)
        return (x, record) if return_intermediates or return_attn else x


class Encoder(AttentionLayers):
    """Bidirectional stack (BERT-like)."""

    fixed = {"causal": False}


class Decoder(AttentionLayers):
    """Causal stack (GPT-like): position t never sees positions after t."""

    fixed = {"causal": True}


class CrossAttender(AttentionLayers):
    """Cross-attention and feedforward blocks only: queries attend to a context, never to each other."""

    fixed = {"cross_attend": True, "only_cross": True}
