"""The Compressive Transformer's compressed memory (Rae et al., arXiv:1911.05507).

Hidden states evicted from a block's FIFO XL memory are compressed by c (`cmem_ratio`) into a
second FIFO of `max_cmem_len` (per block, oldest first); attention sees [compressed memory, memory,
segment] (memories.py). Evicted states are compressed in whole groups of c: states that do not fill
a group stay in the XL memory until the next segment completes it (nothing is padded or dropped),
so the XL memory holds the last max_mem_len + r states, r = (states evicted so far) mod c.

Compression functions, one per block (`cmem_fn`), mapping e = g c oldest states (b, e, dim) to g:
  max_pool / mean_pool: over each group of c;
  conv1d: a convolution of kernel and stride c;
  dilated_conv: a convolution of c taps with dilation 2 and stride c, the sequence zero-padded by c - 1
      on the old side: slot t reads states tc - (c - 1), tc - (c - 3), ..., tc + c - 1 (the end of group
      t and, every other state, back into group t - 1; the paper names the function without its layout);
  most_used: the g states that received the most attention, in their order; usage is the content
      attention (below) of the segment's queries over the evicted states, summed over heads and queries.

The attention-reconstruction loss (the paper's Algorithm 2) is reported as "cmem_reconstruction":
per block, the mean squared difference between content attention over the evicted states and over
their compression, attn(h, m) = softmax(q kᵀ / sqrt(d)) v with the block's own q, k, v projections
(no positions, no masks), h the block's input in this segment. h, the evicted states and the
projection weights are detached, so the loss trains the compression function alone; blocks' losses
are summed. The new memories are detached too: the language-model loss never reaches the compression.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from .. import checks
from ..attention.kernels.dense import match_heads
from ..interfaces import Source
from ..keywords import closest
from ..losses import AuxLosses
from ..precision import upcast
from .memories import Memories, kept

COMPRESSIONS = ("max_pool", "mean_pool", "conv1d", "dilated_conv", "most_used")
LOSS = "cmem_reconstruction"


class Compression(nn.Module):
    """One block's compression function: (b, g c, dim) oldest states -> (b, g, dim)."""

    def __init__(self, fn: str, dim: int, ratio: int):
        super().__init__()
        self.fn, self.ratio = fn, ratio
        self.conv = None
        if fn in ("conv1d", "dilated_conv"):
            self.conv = nn.Conv1d(dim, dim, ratio, stride=ratio, dilation=2 if fn == "dilated_conv" else 1)

    def forward(self, old: Tensor, usage: Tensor | None = None) -> Tensor:
        b, e, dim = old.shape
        c = self.ratio
        if self.fn == "max_pool":
            return old.view(b, e // c, c, dim).amax(2)
        if self.fn == "mean_pool":
            return old.view(b, e // c, c, dim).mean(2)
        if self.fn == "most_used":
            keep = usage.topk(e // c, dim=1).indices.sort(dim=1).values           # (b, g), in order
            return old.gather(1, keep[..., None].expand(-1, -1, dim))
        x = old.transpose(1, 2)                                                   # (b, dim, e)
        if self.fn == "dilated_conv":
            x = F.pad(x, (c - 1, 0))
        return self.conv(x).transpose(1, 2)


def content_attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ / sqrt(d)) v in float32: q (b, h, i, d), k (b, hk, j, d), v (b, hv, j, dv) ->
    (out (b, h, i, dv), weights (b, h, i, j))."""
    h = q.shape[1]
    k, v = match_heads(upcast(k), h), match_heads(upcast(v), h)
    weights = (upcast(q) @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
    return weights @ v, weights


def frozen_qkv(attn: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A self-attention block's q (b, h, n, d), k, v of rows x (b, n, dim), content only (position 0
    for every row), through detached copies of its weights: no gradient reaches them."""
    project = attn.project
    pos = torch.zeros(1, x.shape[1], dtype=torch.long, device=x.device)
    weights = {name: p.detach() for name, p in project.named_parameters()}
    q, kv = functional_call(project, weights, (x, Source(x, pos, None), pos))
    return q, kv.k, kv.v


@torch.no_grad()
def attention_target(attn: nn.Module, old: Tensor, h: Tensor, usage: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """The content attention of h (b, n, dim) over the evicted states old (b, e, dim): the queries
    (b, h, n, d), its output (b, h, n, dv) and, when `usage`, the attention each old state received
    (b, e), summed over heads and queries. The update runs at the forward's peak memory: only these
    outlive the call, and without `usage` the (n, e) weights are never formed (a fused kernel)."""
    e = old.shape[1]
    q, k, v = frozen_qkv(attn, torch.cat((old, h), dim=1))
    q, k, v = upcast(q[:, :, e:].contiguous()), k[:, :, :e], v[:, :, :e]
    if usage:
        target, weights = content_attention(q, k, v)
        return q, target, weights.sum(dim=(1, 2))
    heads = q.shape[1]
    return q, F.scaled_dot_product_attention(q, upcast(match_heads(k, heads)), upcast(match_heads(v, heads))), None


class CompressiveMemory(nn.Module):
    """The compressed memories of a wrapper's self-attention blocks: their compression functions,
    the FIFO update, and the attention-reconstruction loss."""

    loss_names = (LOSS,)

    def __init__(self, dim: int, layers: int, max_mem_len: int, max_cmem_len: int, ratio: int, fn: str,
                 loss_weight: float):
        super().__init__()
        self.max_mem_len, self.max_cmem_len, self.ratio, self.fn = max_mem_len, max_cmem_len, ratio, fn
        self.loss_weight = loss_weight
        self.compress = nn.ModuleList([Compression(fn, dim, ratio) for _ in range(layers)])

    def update(self, stack: nn.Module, given: Memories | None, hs: list[Tensor], mask: Tensor | None,
               losses: AuxLosses) -> Memories:
        """The next segment's memories from the given ones and each block's input hs[l] (b, n, dim);
        the reconstruction loss of what was compressed is reported into `losses`."""
        attention = [b.branch for b in stack.blocks if b.kind == "a"]
        b = hs[0].shape[0]
        masked = mask is not None or (given is not None and any(m is not None for m in (given.mem_masks,
                                                                                        given.cmem_masks)))
        mems, cmems, mem_masks, cmem_masks = [], [], [], []
        for layer, h in enumerate(hs):
            mem = given.mems[layer] if given is not None else h[:, :0]
            cmem = given.cmems[layer] if given is not None and given.cmems else h[:, :0]
            joined = torch.cat((mem, h), dim=1)
            over = joined.shape[1] - self.max_mem_len
            take = over // self.ratio * self.ratio if over > 0 else 0     # whole groups of c only
            if masked:
                joined_mask = torch.cat((_mask(given, "mem_masks", layer, mem), kept(mask, h)), dim=1)
                cmem_mask = _mask(given, "cmem_masks", layer, cmem)
            if take:
                new = self.compressed(attention[layer % len(attention)], layer, joined[:, :take].detach(),
                                      h.detach(), losses)
                cmem = torch.cat((cmem, new.detach()), dim=1)
                if masked:      # a compressed slot is kept when its whole group was
                    group_mask = joined_mask[:, :take].view(b, -1, self.ratio).all(-1)
                    cmem_mask = torch.cat((cmem_mask, group_mask), dim=1)
            mems.append(joined[:, take:].detach())
            cmems.append(cmem[:, -self.max_cmem_len:].detach())      # max_cmem_len > 0 (setup)
            if masked:
                mem_masks.append(joined_mask[:, take:])
                cmem_masks.append(cmem_mask[:, -self.max_cmem_len:])
        return Memories(mems, cmems, mem_masks if masked else None, cmem_masks if masked else None)

    def compressed(self, attn: nn.Module, layer: int, old: Tensor, h: Tensor, losses: AuxLosses) -> Tensor:
        """Block `layer`'s compression of its evicted states old (b, e, dim) -> (b, e / c, dim), h its
        input (b, n, dim); reports the reconstruction loss."""
        q, target, usage = attention_target(attn, old, h, usage=self.fn == "most_used")
        new = self.compress[layer](old, usage)
        _, k_new, v_new = frozen_qkv(attn, new)
        out, _ = content_attention(q, k_new, v_new)
        losses.report(LOSS, (out - target).square().mean(), self.loss_weight)   # mse; keeps one (b, h, n, dv)
        return new


def _mask(given: Memories | None, name: str, layer: int, x: Tensor) -> Tensor:
    """Block `layer`'s given mask `name` of memory x (b, m, dim), all kept where none was given."""
    masks = getattr(given, name) if given is not None else None
    return kept(masks[layer] if masks is not None else None, x)


def setup(owner: str, stack: nn.Module, max_mem_len: int, shift_mem_down: int, max_cmem_len: object,
          cmem_ratio: object = None, cmem_fn: object = None, cmem_loss_weight: object = None
          ) -> CompressiveMemory | None:
    """The wrapper's compressed memory from its keywords (None when max_cmem_len is 0); bad values fail by name."""
    for problem in checks.whole(max_cmem_len, "max_cmem_len", low=0):
        raise ValueError(f"{owner}: {problem}")
    given = {k: v for k, v in (("cmem_ratio", cmem_ratio), ("cmem_fn", cmem_fn),
                               ("cmem_loss_weight", cmem_loss_weight)) if v is not None}
    if not max_cmem_len:
        if given:
            raise ValueError(f"{owner}: {', '.join(given)} configure the compressed memory, which needs "
                             "max_cmem_len > 0")
        return None
    if not max_mem_len:
        raise ValueError(f"{owner}: max_cmem_len={max_cmem_len} needs max_mem_len > 0 (states are compressed as "
                         "they leave the Transformer-XL memory)")
    if shift_mem_down:
        raise ValueError(f"{owner}: max_cmem_len={max_cmem_len} cannot combine with shift_mem_down={shift_mem_down}")
    ratio = 4 if cmem_ratio is None else cmem_ratio
    for problem in checks.whole(ratio, "cmem_ratio (the compression rate c)"):
        raise ValueError(f"{owner}: {problem}")
    fn = "conv1d" if cmem_fn is None else cmem_fn
    if fn not in COMPRESSIONS:
        raise ValueError(f"{owner}: cmem_fn must be one of {', '.join(COMPRESSIONS)}, got {cmem_fn!r}"
                         f"{closest(str(fn), COMPRESSIONS)}")
    weight = 1.0 if cmem_loss_weight is None else cmem_loss_weight
    if not checks.number(weight) or weight < 0:
        raise ValueError(f"{owner}: cmem_loss_weight must be a finite number >= 0, got {cmem_loss_weight!r}")
    from ..attention.attention import Attention

    if not all(isinstance(b.branch, Attention) for b in stack.blocks if b.kind == "a"):
        raise ValueError(f"{owner}: max_cmem_len needs attention blocks (the reconstruction loss uses their "
                         "projections); the stack's mixer has none")
    return CompressiveMemory(stack.dim, stack.num_self_attn, max_mem_len, max_cmem_len, ratio, fn, float(weight))
