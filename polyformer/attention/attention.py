"""One attention block, as a run of stages. No variant is named here: each stage is present or not."""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn

from ..autodiff import needs_reference
from ..config import AttentionConfig
from ..config import Choice
from ..interfaces import KV, AttnOut, Context, KernelSpec
from ..position import relative
from ..precision import upcast
from ..registry import KERNEL, POSITION
from . import forgetting, gates, latent, patterns, scoring
from .global_queries import GlobalQueries
from .kernels import block_sparse
from .kernels.direct import switch
from .keys import MemoryKV, context_source, self_source
from .projection import Projection


class Attention(nn.Module):
    """Self-attention or, when `cross` is True, cross-attention to `ctx.context`. `layer` is the
    block's index among the stack's blocks of its kind (XL memories, decode state).

    `shared_bias` is the stack's score-bias module (T5, ALiBi): one per stack, so it is held here
    outside the module tree and registered once, on the stack.
    """

    def __init__(self, dim: int, cfg: AttentionConfig, *, causal: bool, layer: int = 0,
                 cross: bool = False, dim_context: int | None = None,
                 shared_bias: nn.Module | None = None, keep_scores: bool = False,
                 shared_relative: nn.Module | None = None):
        super().__init__()
        self.cross = cross
        self.causal = causal and not cross
        self.layer = layer
        positional = not cross
        project = latent.LatentProjection if latent.used(cfg) else Projection    # multi-latent attention
        self.project = project(dim, cfg, dim_context=(dim_context or dim) if cross else None,
                               infuse=positional and cfg.position == "infused")
        position = POSITION[cfg.position].build if positional else None
        self.position = position(self.project.qk_dim, cfg) if position is not None else None
        self._bias = (shared_bias,) if positional and shared_bias is not None else ()
        self.relative = relative.build(cfg, dim, shared_relative) if positional else None
        self.memory_kv = (MemoryKV(cfg.num_mem_kv, self.project.kv_heads, self.project.qk_dim,
                                   self.project.v_heads, cfg.dim_head) if cfg.num_mem_kv else None)
        normalize = scoring.normalizer(cfg)          # the normaliser with its score transforms (scoring.py)
        self.qk_norm = scoring.qk_norm(cfg.scores, cfg.heads, self.project.kv_heads, self.project.qk_dim)
        choice = cfg.kernel
        if cross and not KERNEL[choice.name].caps.cross:    # cross-attention stays dense unless it serves both
            choice = Choice("kernel", "dense")
        self.kernel = KERNEL[choice.name].build(KernelSpec(
            heads=cfg.heads, kv_heads=self.project.kv_heads, dim_qk=self.project.qk_dim, dim_v=cfg.dim_head,
            causal=self.causal, layer=layer, scale=self.project.qk_dim ** -0.5, dropout=cfg.dropout,
            options=choice.options, normalize=normalize, talking_heads=cfg.talking_heads,
            fused=False if self.relative is not None and self.relative.reads_weights else cfg.fused,
            keep_scores=keep_scores, pattern=cfg.pattern if not cross else ()))
        self.direct = self.kernel.caps.form == "direct"
        self.cfg_kernel = choice.name
        self.output = gates.output_stage(dim, cfg)         # merge and project, behind gates / head scale (gates.py)
        self.pattern = (patterns.PatternStage(cfg.pattern, cfg.heads, self.causal, layer)
                        if cfg.pattern and not cross and not self.direct else None)   # a direct kernel applies its own
        own = patterns.own_projections(cfg.pattern)
        self.global_queries = GlobalQueries(dim, cfg, own) if own is not None and not cross else None
        self.knn: nn.Module | None = None      # a kNN memory (knn_memory.py), given by the stack to chosen blocks
        self.value_residual: nn.Module | None = None   # add_value_residual (value_residual.py), given by the stack
        self.forget = forgetting.build(dim, cfg, self.project.kv_heads, self.causal) if not cross else None

    @property
    def decode_window(self) -> object | None:
        """What limits the keys a decode step reads (`.decode == "window"`, `.sinks`, `.span`): the pattern
        stage, or a direct kernel that declares one (adaptive span); None when every key stays."""
        return self.pattern if self.pattern is not None else getattr(self.kernel, "decode_window", None)

    @property
    def decode_kind(self) -> str:
        """What this block keeps in a decode state: "keys" or "recurrent" (memory/recurrent.py)."""
        return "recurrent" if self.kernel.caps.decode == "recurrent" else "keys"

    @property
    def latent_capable(self) -> bool:
        """Whether a decode state may keep this block's multi-latent inputs instead of its keys (latent.py):
        nothing else of the block needs the cached keys themselves."""
        return (getattr(self.project, "latent_width", None) is not None and not self.cross and not self.direct
                and self.decode_kind == "keys" and self.decode_window is None and self.forget is None
                and self.value_residual is None and self.knn is None)

    @property
    def decode_dims(self) -> tuple[int, int, int, int]:
        """(key heads, key size, value heads, value size) of what a "keys" decode state stores."""
        extra = self.forget.columns if self.forget is not None else 0     # its gate terms ride with the keys
        return self.project.kv_heads, self.project.qk_dim + extra, self.project.v_heads, self.project.dim_head

    def forward(self, x: Tensor, ctx: Context, prev_scores: Tensor | None = None) -> AttnOut:
        latent = ctx.state is not None and not self.cross and ctx.state.keeps_latents
        if self.cross:
            q, kv = self.project.queries(x), self.context_kv(ctx)
        elif latent:        # the state keeps multi-latent inputs: every cached one up-projected (latent.py)
            q = self.project.queries(x)
            kv = self.project.expand(ctx.state.attend(self.layer, self.project.latent(self_source(x, ctx, self.layer))))
        else:
            q, kv = self.project(x, self_source(x, ctx, self.layer), ctx.pos)   # q (b, h, i, d)
        if self.value_residual is not None:
            kv = self.value_residual(kv, x, ctx, self.layer)
        recalled = self.knn(q, kv, ctx) if self.knn is not None else None   # before positions: none stored
        if self.position is not None:
            q, kv.k = self.position(q, kv.k, ctx.pos, kv.pos)      # rotate before anything is cached
        memory = forget_bias = None
        if self.forget is not None:                               # attn_data_dependent_alibi (forgetting.py)
            kv, forget_bias = self.forget(kv, x, ctx, self.layer)   # writes the decode state itself
        elif ctx.state is not None and not self.cross and not latent:
            if self.kernel.caps.decode == "recurrent":
                memory = ctx.state.recurrent(self.layer)          # a fixed-size summary of earlier keys
            else:
                kv = ctx.state.attend(self.layer, kv)             # every key so far, written in place
        elif ctx.carried is not None and not self.cross:
            memory = ctx.carried.get(self.layer)                  # a memory from the forward before (its summary)
        if self.memory_kv is not None:
            kv = self.memory_kv(kv)
        if self.qk_norm is not None:
            q, kv = self.qk_norm(q, kv)                           # cosine similarity on every key (scoring.py)
        if self.direct:
            if ctx.prefix_span is not None:
                raise ValueError(f"prefix_len cannot combine with {switch('attention.kernel.', self.cfg_kernel)}")
            if ctx.global_mask is not None:     # a direct kernel's own pattern (routing's local heads) has no globals
                raise ValueError(f"global_mask cannot combine with {switch('attention.kernel.', self.cfg_kernel)}")
            out = self.kernel(q, kv, q_pos=ctx.pos, causal=self.causal, memory=memory, need_weights=ctx.need_weights)
            if out.losses is not None:
                ctx.losses.merge(out.losses)
            return AttnOut(self.output(out.out, x), weights=out.weights)
        if self.pattern is not None:
            out = self.patterned(q, kv, ctx, prev_scores)
            if self.global_queries is not None:
                out.out = self.global_queries(out.out, x, ctx, self.layer, self.position,
                                              self._bias[0] if self._bias else None, self.kernel)
            if recalled is not None:
                out.out = self.knn.mix(out.out, recalled)
            return AttnOut(self.output(out.out, x), scores=out.scores, weights=out.weights)
        mask, causal = self.keep(ctx, kv)
        bias = self._bias[0](ctx.pos, kv.pos) if self._bias else forget_bias
        if bias is not None and kv.free:
            bias = F.pad(bias, (kv.free, 0))
        out = self.attend(ctx)(q, kv, mask=mask, bias=bias, causal=causal, prev_scores=prev_scores,
                               need_weights=ctx.need_weights)
        if recalled is not None:
            out.out = self.knn.mix(out.out, recalled)
        return AttnOut(self.output(out.out, x), scores=out.scores, weights=out.weights)

    def attend(self, ctx: Context) -> nn.Module | partial:
        """The dense kernel, or the relative stage around it (its terms join the bias)."""
        scoring.bind(self.kernel, ctx.losses)                     # the score stage's z-loss goes to this forward
        return self.kernel if self.relative is None else partial(self.relative, self.kernel, ctx.pos)

    def patterned(self, q: Tensor, kv: KV, ctx: Context, prev_scores: Tensor | None) -> AttnOut:
        """Attention restricted to the pattern: the block-sparse kernel when the keys are one run of
        positions per row and the kernel's fast path applies, else the dense kernel with the pattern's
        mask (decode steps, return_attn, residual scores, top-k / entmax, transforms)."""
        if ctx.prefix_span is not None:
            raise ValueError("prefix_len cannot combine with an attention pattern (attn_window, attn_sparse, ...)")
        nk, n = kv.k.shape[2] - kv.free, q.shape[2]
        at = ("geometry", self.pattern.heads)   # the blocks of a kind share keys' positions in one forward
        if at not in ctx.memo:
            flags = None if ctx.global_mask is None else F.pad(ctx.global_mask, (nk - n, 0), value=False)
            ctx.memo[at] = self.pattern.geometry(ctx.pos, kv.pos, kv.mask, flags)
        geo = ctx.memo[at]
        bias = self._bias[0] if self._bias else None
        if (geo.run and self.kernel.can_fuse and prev_scores is None and not ctx.need_weights
                and self.relative is None and not needs_reference(q, kv.k, kv.v)):
            key = ("pattern", self.pattern.layer_key)
            if key not in ctx.memo:
                ctx.memo[key] = self.pattern.parts(geo)
            return AttnOut(block_sparse.attention(q, kv, ctx.pos, ctx.memo[key], kv.mask, bias,
                                                  self.kernel.scale, self.kernel.dropout))
        counts = self.pattern.counts(geo)                                     # (z, h, i, j)
        keep = self.pattern.visible(counts, kv)
        scores = bias(ctx.pos, kv.pos) if bias is not None else None
        if self.pattern.mixture:            # a key shown by c configurations weighs c times
            extra = upcast(counts.clamp(min=1).to(q.dtype)).log()
            scores = extra if scores is None else scores + extra
        if kv.free and scores is not None:
            scores = F.pad(scores, (kv.free, 0))
        return self.attend(ctx)(q, kv, mask=keep, bias=scores, causal=False, prev_scores=prev_scores,
                                need_weights=ctx.need_weights)

    def context_kv(self, ctx: Context) -> KV:
        """Keys / values of the context; a decode state keeps them, so they are computed once."""
        if ctx.state is None:
            return self.project.keys_values(context_source(ctx))
        if self.layer not in ctx.state.cross:
            ctx.state.cross[self.layer] = self.project.keys_values(context_source(ctx))
        return ctx.state.cross[self.layer]

    def keep(self, ctx: Context, kv: KV) -> tuple[Tensor | None, bool]:
        """The boolean keep-mask (b|1, 1, i, j), or None with causal=True when the pattern is
        exactly top-left causal. Built once per forward and shared by the stack's blocks.

        Blocks of one kind see keys of one length and order (XL memories all have one length, a
        decode state one fill), so the key leaves the length out: a traced graph then need not
        specialise on it. Only XL memory masks are per block."""
        per_block = ctx.mem_masks is not None and not self.cross
        key = (self.cross, self.causal, kv.free, self.layer if per_block else None)
        if key not in ctx.memo:
            ctx.memo[key] = self._build_keep(ctx, kv)
        return ctx.memo[key]

    def _build_keep(self, ctx: Context, kv: KV) -> tuple[Tensor | None, bool]:
        keep = kv.mask[:, None, None, :] if kv.mask is not None else None     # (b, 1, 1, j)
        causal = False
        if self.causal and ctx.prefix_span is not None:
            pattern = patterns.prefix_causal(ctx.pos, kv.pos, *ctx.prefix_span)[:, None]
            keep = pattern if keep is None else keep & pattern
        elif self.causal:
            state = ctx.state
            if kv.free == 0 and (kv.pos is ctx.pos or (state is not None and state.length == 0)):
                causal = True                       # the keys are exactly the queries, in order
            elif state is not None and ctx.pos.shape[-1] == 1:
                pass                                # one new token comes after every cached key
            else:
                pattern = patterns.causal(ctx.pos, kv.pos)[:, None]           # (b|1, 1, i, j)
                keep = pattern if keep is None else keep & pattern
        if ctx.attn_mask is not None and not self.cross:      # x-transformers' attn_mask (attn_mask.py)
            keep = ctx.attn_mask if keep is None else keep & ctx.attn_mask
        if kv.free and keep is not None:
            keep = F.pad(keep, (kv.free, 0), value=True)
        return keep, causal
