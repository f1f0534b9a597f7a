"""Input checks, run before any compute; every message names the argument and what was expected.

Checks of shapes, dtypes and types run always. Checks that read tensor values (token ids in range,
finite inputs, prefix lengths) run on eager calls only: under `torch.compile` / `torch.export` a
Python branch on a tensor's value would break the graph, and `torch.func.vmap` cannot read one, so
`values_hidden()` skips them there.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .autodiff import VMAP, levels

if TYPE_CHECKING:
    from .memory.kv_cache import DecodeState
    from .stack import AttentionLayers


def values_hidden() -> bool:
    """Whether this call's tensor values cannot be read: torch.compile or torch.export traces it, or
    torch.func.vmap batches it. Value checks are skipped there: token ids still meet the embedding's own
    index check, but finite inputs and prefix lengths go unchecked."""
    return torch.compiler.is_compiling() or levels(VMAP) > 0


def whole(value: object, name: str, low: int = 1, optional: bool = False) -> list[str]:
    """[] when value is an integer >= low (or None, if optional), else the problem naming `name`: for
    the `check` of a variant's options, which collects every problem before one is raised."""
    if (optional and value is None) or (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        return []
    return [f"{name} must be an integer >= {low}{' (or None)' if optional else ''}, got {value!r}"]


def count(value: object, name: str, low: int = 1) -> int:
    """value, an integer >= low; else ValueError naming `name` (for a constructor's keyword)."""
    if wrong := whole(value, name, low):
        raise ValueError(wrong[0])
    return value


def flag(value: object, name: str) -> list[str]:
    """[] when value is True or False, else the problem naming `name` (for a variant's `check`)."""
    return [] if isinstance(value, bool) else [f"{name} must be True or False, got {value!r}"]


def number(value: object) -> bool:
    """Whether value is a finite real number (an int or float, not a bool): for the `check` of a variant's
    options, before comparing it with its range."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def token_ids(x: object, num_tokens: int, name: str = "x") -> Tensor:
    x = tensor(name, x)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape (batch, seq), got {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{name} must hold at least one token, got shape {tuple(x.shape)}")
    if values_hidden():
        return x
    lo, hi = int(x.min()), int(x.max())
    if lo < 0 or hi >= num_tokens:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds token id {bad}, outside [0, num_tokens={num_tokens})")
    return x


def floats(name: str, x: object, ndim: int, shape_text: str) -> Tensor:
    x = tensor(name, x)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating point tensor, got dtype {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_text}, got {tuple(x.shape)}")
    return x


def finite(name: str, x: Tensor) -> None:
    if not values_hidden() and not torch.isfinite(x).all():
        raise ValueError(f"{name} holds NaN or inf values")


def bool_mask(name: str, mask: object, shape: tuple[int, ...], shape_text: str) -> Tensor:
    mask = tensor(name, mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = keep), got dtype {mask.dtype}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {shape_text} = {tuple(shape)}, got {tuple(mask.shape)}")
    return mask


def seq_len(n: int, max_seq_len: int, name: str = "x") -> None:
    if n > max_seq_len:
        raise ValueError(
            f"{name} has {n} positions but max_seq_len={max_seq_len} and the learned absolute "
            f"positions cannot go beyond it (use rotary_pos_emb / alibi_pos_emb / rel_pos_bias to extrapolate)")


def stack_inputs(stack: "AttentionLayers", x: object, mask: object, context: object, context_mask: object,
                 mems: object, mem_masks: object, pos: object) -> None:
    x = floats("x", x, 3, "(batch, seq, dim)")
    b, n, dim = x.shape
    if dim != stack.dim:
        raise ValueError(f"x has feature size {dim}, expected dim={stack.dim}")
    if mask is not None:
        bool_mask("mask", mask, (b, n), "(batch, seq)")
    if context is not None:
        if not stack.has_cross:
            raise ValueError("context was given but the stack has no cross-attention: build it with cross_attend=True")
        context = floats("context", context, 3, "(batch, context_len, dim_context)")
        dim_context = stack.cfg.dim_context or stack.dim
        if context.shape[0] != b:
            raise ValueError(f"context has batch size {context.shape[0]}, x has {b}")
        if context.shape[2] != dim_context:
            raise ValueError(f"context has feature size {context.shape[2]}, expected dim_context={dim_context}")
        if context_mask is not None:
            bool_mask("context_mask", context_mask, tuple(context.shape[:2]), "(batch, context_len)")
    elif stack.has_cross:
        raise ValueError("this stack has cross-attention blocks: pass context=(batch, context_len, dim)")
    elif context_mask is not None:
        raise ValueError("context_mask was given without a context")
    if mems is not None:
        if not isinstance(mems, (list, tuple)) or len(mems) != stack.num_self_attn:
            raise ValueError(f"mems must be a list of {stack.num_self_attn} tensors (one per self-attention block)")
        m = None
        for i, mem in enumerate(mems):
            mem = floats(f"mems[{i}]", mem, 3, "(batch, mem_len, dim)")
            if mem.shape[0] != b or mem.shape[2] != dim:
                raise ValueError(f"mems[{i}] must have shape ({b}, mem_len, {dim}), got {tuple(mem.shape)}")
            if m is not None and mem.shape[1] != m:
                raise ValueError(f"mems must all have the same length, got {m} and {mem.shape[1]}")
            m = mem.shape[1]
        if mem_masks is not None:
            masks = mem_masks if isinstance(mem_masks, (list, tuple)) else [mem_masks]
            if isinstance(mem_masks, (list, tuple)) and len(masks) != len(mems):
                raise ValueError(f"mem_masks must have one mask per memory ({len(mems)}), got {len(masks)}")
            for i, mm in enumerate(masks):
                if mm is not None:
                    bool_mask(f"mem_masks[{i}]", mm, (b, m), "(batch, mem_len)")
    elif mem_masks is not None:
        raise ValueError("mem_masks was given without mems")
    if pos is not None:
        pos = tensor("pos", pos)
        if pos.ndim != 2 or pos.shape[-1] != n or pos.shape[0] not in (1, b):
            raise ValueError(f"pos must have shape (batch or 1, {n}), got {tuple(pos.shape)}")


def decode_state(stack: "AttentionLayers", state: "DecodeState", x: Tensor, mems: object) -> None:
    if mems is not None:
        raise ValueError("mems and state cannot be combined: a decode state already holds every earlier key")
    if state.batch != x.shape[0]:
        raise ValueError(f"state was made for batch size {state.batch}, x has {x.shape[0]}")
    if state.layers != stack.num_self_attn:
        raise ValueError(f"state holds {state.layers} layers, the stack has {stack.num_self_attn} "
                         "self-attention blocks: it was made for another model")
    if state.length + x.shape[1] > state.max_len:
        raise ValueError(f"state has room for {state.max_len} positions; {state.length} are used and "
                         f"x adds {x.shape[1]}")


def global_mask(stack: "AttentionLayers", mask: object, x: Tensor) -> None:
    """global_mask (b, n) bool marks global tokens of an Encoder with an attention pattern."""
    from .attention.patterns import takes_global_mask

    patterned = [a.pattern for a in stack.cfg.self_attention if a.pattern]   # per block (attn_per_layer)
    if not patterned or not all(takes_global_mask(p) for p in patterned):
        raise ValueError("global_mask marks global tokens of an attention pattern; the stack has none that takes "
                         "them (set attn_window, attn_sparse, ... ; attn_dilated and attn_bigbird_blocks take none)")
    if stack.causal:
        raise ValueError("global_mask makes tokens see every key, which a Decoder cannot apply; use "
                         "attn_global_tokens (the first positions, kept causal)")
    bool_mask("global_mask", mask, tuple(x.shape[:2]), "(batch, seq)")


def memories(stack: "AttentionLayers", max_mem_len: int, owner: str) -> None:
    """A wrapper's max_mem_len > 0 keeps Transformer-XL memories: its stack's blocks must read them
    and keep their inputs, at one length."""
    from .attention.kernels.direct import switch
    from .registry import MIXER

    if not max_mem_len:
        return
    cfg = stack.cfg
    if cfg.mixer is not None and not MIXER[cfg.mixer.name].caps.memories:
        raise ValueError(f"{owner}: max_mem_len={max_mem_len} needs attention to read the memories; "
                         f"{switch('mixer.', cfg.mixer.name)} has none")
    if cfg.reversible:
        raise ValueError(f"{owner}: max_mem_len={max_mem_len} cannot combine with reversible=True (the "
                         "backward recomputes the blocks' inputs; none is kept to be a memory)")
    if cfg.hourglass is not None:
        raise ValueError(f"{owner}: max_mem_len={max_mem_len} cannot combine with hourglass (several lengths)")


def prefix_len(value: object, b: int, n: int, causal: bool) -> Tensor:
    """prefix_len as a (b,) long tensor in [0, n]."""
    if not causal:
        raise ValueError("prefix_len makes a causal stack bidirectional over a prefix; this stack is not causal")
    t = torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"prefix_len must be an int or an integer tensor of shape (batch,), got dtype {t.dtype}")
    if t.ndim == 0:
        t = t.expand(b)
    if tuple(t.shape) != (b,):
        raise ValueError(f"prefix_len must be an int or have shape (batch,) = ({b},), got {tuple(t.shape)}")
    if not values_hidden() and (bool((t < 0).any()) or bool((t > n).any())):
        raise ValueError(f"prefix_len must be in [0, seq_len={n}], got {t.tolist()}")
    return t.long()
