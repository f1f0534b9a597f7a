"""Multi-latent attention (DeepSeek-V2, arXiv:2405.04434): queries, keys and values projected up from
low-rank latents of the input, c_q = W_dq x (queries q = W_uq c_q) and one latent c_kv = W_dkv x shared by
keys k = W_uk c_kv and values v = W_uv c_kv; with x-transformers' form of the decoupled rotary part
(its latent_rope_subheads): the last r key heads come straight from the input, k_r = W_kr x, and only
the last r heads of queries and keys are rotated (the rotary's rotate_num_heads), so the latent heads
carry no position.

A decode state keeps what MLA is for: the latent c_kv and the r decoupled key heads before rotation,
dim_kv + r * dim_head numbers per token and block instead of 2 * kv_heads * dim_head (`latent` packs them
into the state's key rows, its value rows left empty; `expand` up-projects every cached latent at each step,
and the block rotates the keys by their cached positions, as x-transformers does). The stack keeps the full
keys instead when a block needs them cached (a pattern's ring, the Forgetting Transformer's gate terms, a
value residual, a kNN memory, an hourglass: `Attention.latent_capable`); both give the same outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from einops import rearrange
from torch import Tensor, nn

from ..interfaces import KV, Source
from ..routes import Route

if TYPE_CHECKING:
    from ..config import AttentionConfig, LayersConfig


@dataclass(frozen=True)
class LatentOptions:
    """attn_use_latent_q / attn_dim_latent_q, attn_use_latent_kv / attn_dim_latent_kv and
    attn_latent_rope_subheads (x-transformers' spellings): which projections go through a latent, its
    size, and how many heads take the decoupled rotary part."""

    use_q: bool = False
    dim_q: int | None = None
    use_kv: bool = False
    dim_kv: int | None = None
    rope_subheads: int | None = None


@dataclass(frozen=True)
class RopeSubheads(Route):
    """attn_latent_rope_subheads=r: r key heads straight from the input, and the last r heads of queries and
    keys rotated, by the rotary's own head count (rotate_num_heads' field, position/rotary.py)."""

    def writes(self, arg: object) -> dict[str, object]:
        return {} if arg is None else {self.path: arg, "attention.rotary_heads": arg}


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _attention_problems(a: "AttentionConfig", cfg: "LayersConfig") -> list[str]:
    o: LatentOptions = a.latent
    found = []
    for part, use, size in (("q", o.use_q, o.dim_q), ("kv", o.use_kv, o.dim_kv)):
        if not isinstance(use, bool):
            found.append(f"attn_use_latent_{part} expects True or False, got {use!r}")
        elif use and size is None:
            found.append(f"attn_use_latent_{part}=True needs attn_dim_latent_{part} (the latent's size)")
        elif size is not None and not use:
            found.append(f"attn_dim_latent_{part} is set but attn_use_latent_{part} is not True")
        elif size is not None and not _positive(size):
            found.append(f"attn_dim_latent_{part} must be a positive integer, got {size!r}")
    r, heads = o.rope_subheads, a.heads
    if r is not None:
        kv_heads = a.kv_heads or heads
        if not o.use_kv:
            found.append("attn_latent_rope_subheads needs attn_use_latent_kv=True (its heads are the keys that "
                         "do not come from the latent)")
        if not _positive(r) or r > heads:
            found.append(f"attn_latent_rope_subheads must be an integer in [1, heads={heads}], got {r!r}")
        elif kv_heads != heads:
            found.append(f"attn_latent_rope_subheads rotates the last {r} query and key heads, which needs one key "
                         f"head per query head: it cannot combine with attn_kv_heads / attn_one_kv_head "
                         f"({kv_heads} key heads for {heads} heads)")
        if a.position != "rotary":
            found.append("attn_latent_rope_subheads is the decoupled rotary part of multi-latent attention: it "
                         "needs rotary_pos_emb=True")
    if a.collab_heads:
        found.append("attn_use_latent_q / attn_use_latent_kv cannot combine with attn_collab_heads=True (two "
                     "ways to factor the projections)")
    if a.position == "infused":
        found.append("attn_use_latent_q / attn_use_latent_kv cannot combine with position_infused_attn=True")
    if getattr(a.kernel.options, "shared_qk", False) is True:
        found.append("attn_use_latent_q / attn_use_latent_kv cannot combine with attn_shared_qk=True (the keys "
                     "would be the queries)")
    if cfg.residual == "deepnorm":
        found.append("deepnorm=True initialises the plain q|k|v projection; it cannot combine with "
                     "attn_use_latent_q / attn_use_latent_kv")
    if cfg.mixer is not None:
        found.append("attn_use_latent_q / attn_use_latent_kv shape attention's projections, but the stack's "
                     "mixer replaces attention")
    return found


def state_dims(keyed: list[nn.Module]) -> tuple[int, int, int, int] | None:
    """The decode-state dims (1, latent_width, 1, 0) when every block keeping keys may keep its multi-latent
    inputs instead (`Attention.latent_capable`, one width for all), else None: the state keeps keys."""
    widths = {a.project.latent_width if getattr(a, "latent_capable", False) else None for a in keyed}
    return (1, widths.pop(), 1, 0) if keyed and len(widths) == 1 and None not in widths else None


def used(cfg: "AttentionConfig") -> bool:
    """Whether the block's queries or keys / values go through a latent (attn_use_latent_q / _kv)."""
    return cfg.latent is not None and (cfg.latent.use_q is True or cfg.latent.use_kv is True)


def problems(cfg: "LayersConfig") -> list[str]:
    """What is wrong with the stack's multi-latent attention options, each naming the keywords."""
    return [p for a in cfg.self_attention if a.latent is not None for p in _attention_problems(a, cfg)]


class LatentProjection(nn.Module):
    """Queries, keys and values through latents; a drop-in for `projection.Projection` (same heads
    and call). Cross-attention takes its key / value latent from the context."""

    def __init__(self, dim: int, cfg: "AttentionConfig", dim_context: int | None = None, infuse: bool = False):
        super().__init__()
        if infuse:
            raise ValueError("attn_use_latent_q / attn_use_latent_kv cannot combine with position_infused_attn=True")
        o: LatentOptions = cfg.latent
        h, d = cfg.heads, cfg.dim_head
        self.heads, self.dim_head, self.qk_dim = h, d, d
        self.kv_heads = self.v_heads = cfg.kv_heads or h
        self.cross = dim_context is not None
        self.rope_heads = o.rope_subheads or 0
        source = dim_context or dim
        bias = cfg.qkv_bias
        self.to_latent_q = nn.Linear(dim, o.dim_q, bias=False) if o.use_q else None
        self.to_latent_kv = nn.Linear(source, o.dim_kv, bias=False) if o.use_kv else None
        kv_in = o.dim_kv if o.use_kv else source
        self.to_q = nn.Linear(o.dim_q if o.use_q else dim, h * d, bias=bias)
        latent_heads = self.kv_heads - self.rope_heads
        self.to_k = nn.Linear(kv_in, latent_heads * d, bias=bias) if latent_heads else None
        self.to_v = nn.Linear(kv_in, self.kv_heads * d, bias=bias)
        self.to_rope_k = nn.Linear(source, self.rope_heads * d, bias=bias) if self.rope_heads else None

    @property
    def dim_value(self) -> int:
        return self.dim_head

    def forward(self, x: Tensor, src: Source, q_pos: Tensor) -> tuple[Tensor, KV]:
        """x (b, i, dim) -> q (b, h, i, d); the source (b, j, dim) -> keys and values."""
        return self.queries(x), self.keys_values(src)

    def queries(self, x: Tensor) -> Tensor:
        c = self.to_latent_q(x) if self.to_latent_q is not None else x          # (b, i, dim_q)
        return rearrange(self.to_q(c), "b n (h d) -> b h n d", h=self.heads)

    @property
    def latent_width(self) -> int | None:
        """Numbers per token of what a latent decode state keeps (c_kv and the rope heads), or None without a
        key / value latent."""
        return None if self.to_latent_kv is None else self.to_latent_kv.out_features + self.rope_heads * self.dim_head

    def keys_values(self, src: Source) -> KV:
        if self.to_latent_kv is not None:
            return self.expand(self.latent(src))
        c = src.x
        k = rearrange(self.to_k(c), "b n (h d) -> b h n d", d=self.dim_head)
        return KV(k=k, v=rearrange(self.to_v(c), "b n (h d) -> b h n d", h=self.kv_heads), pos=src.pos, mask=src.mask)

    def latent(self, src: Source) -> KV:
        """The source's latent c_kv and unrotated rope heads packed as one key head (b, 1, j, latent_width),
        with empty values (b, 1, j, 0): the rows a latent decode state stores."""
        parts = [self.to_latent_kv(src.x)]
        if self.to_rope_k is not None:          # the decoupled heads: from the input, not the latent
            parts.append(self.to_rope_k(src.x))
        packed = torch.cat(parts, dim=-1)[:, None]
        return KV(k=packed, v=packed.new_zeros(*packed.shape[:-1], 0), pos=src.pos, mask=src.mask)

    def expand(self, kv: KV) -> KV:
        """Packed latents (b, 1, j, latent_width) -> keys (b, hk, j, d) and values (b, hv, j, d)."""
        c, rope = kv.k[:, 0].split((self.to_latent_kv.out_features, self.rope_heads * self.dim_head), dim=-1)
        v = rearrange(self.to_v(c), "b n (h d) -> b h n d", h=self.kv_heads)
        heads = []
        if self.to_k is not None:
            heads.append(rearrange(self.to_k(c), "b n (h d) -> b h n d", d=self.dim_head))
        if self.rope_heads:
            heads.append(rearrange(rope, "b n (h d) -> b h n d", h=self.rope_heads))
        k = heads[0] if len(heads) == 1 else torch.cat(heads, dim=1)            # (b, hk, j, d)
        return KV(k=k, v=v, pos=kv.pos, mask=kv.mask)
