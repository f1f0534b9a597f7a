"""A sequence wrapper's positions: which absolute positions it builds from its keywords (learned, scaled
sinusoids, axial, per-layer tables on its stack, none), how far they reach, and the token positions of
a forward (given, after a decode state's, randomized in training, or 0 .. n-1), checked against that
reach."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .. import checks
from ..embedding import absolute_positions
from . import per_layer_abs, randomized

if TYPE_CHECKING:
    from ..memory.kv_cache import DecodeState
    from ..stack import AttentionLayers
    from ..wrappers import SequenceWrapper


def setup(stack: "AttentionLayers", owner: str, max_seq_len: int, use_abs_pos_emb: bool | None,
          scaled_sinu_pos_emb: bool, axial: object, axial_dims: object, abs_pos_per_layer: object,
          randomized_pos: object, max_mem_len: int, num_memory_tokens: int) -> tuple[nn.Module | None, int]:
    """(the wrapper's absolute positions or None, the number of positions they cover: max_seq_len, or L
    with randomized_pos=L). Per-layer tables go onto `stack` (position/per_layer_abs.py)."""
    reach = randomized.limit(owner, randomized_pos, max_seq_len)
    given = [name for name, on in (("use_abs_pos_emb=True", use_abs_pos_emb is True),
                                   ("scaled_sinu_pos_emb", scaled_sinu_pos_emb),
                                   ("axial_pos_emb", axial is not None or axial_dims is not None)) if on]
    per_layer_abs.attach(stack, abs_pos_per_layer, owner, reach + num_memory_tokens + max_mem_len, given)
    pos_emb = None
    if stack.layer_pos is None:
        pos_emb = absolute_positions(owner, stack.dim, reach, use_abs_pos_emb, scaled_sinu_pos_emb,
                                     stack.cfg.attention.position == "infused", stack.has_pos_emb, axial, axial_dims)
    positional = pos_emb is not None or stack.has_pos_emb or stack.layer_pos is not None
    randomized.check(owner, randomized_pos, positional, max_mem_len)
    return pos_emb, reach


def token_positions(wrapper: "SequenceWrapper", x: Tensor, pos: Tensor | None,
                    state: "DecodeState | None") -> Tensor:
    """Positions (b|1, n) of x's n tokens among the tokens (memory tokens excluded): `pos` as given; after
    each row's last cached position; a sorted random sample of [0, L) per row in training with
    randomized_pos=L; else 0 .. n-1. Positions past max_seq_len are refused by name when bounded."""
    b, n = x.shape[:2]
    if pos is not None:
        tok_pos = pos
    elif state is not None and state.length:
        tok_pos = wrapper.attn_layers.next_positions(n, None, state, x.device) - wrapper.num_memory_tokens
    elif state is None and wrapper.training and wrapper.randomized_pos is not None:
        tok_pos = randomized.sample(b, n, wrapper.randomized_pos, x.device)
    else:
        tok_pos = torch.arange(n, device=x.device)[None]
    if not wrapper.bounded:
        return tok_pos
    if checks.values_hidden():
        if pos is None and state is None:       # traced or batched: only the default 0 .. n-1 is known
            _reach(wrapper, n)
    else:
        _reach(wrapper, int(tok_pos.max()) + 1)
    return tok_pos


def _reach(wrapper: "SequenceWrapper", n: int) -> None:
    if wrapper.randomized_pos is not None and n > wrapper.max_seq_len:
        raise ValueError(f"x reaches {n} positions but the learned positions cover randomized_pos="
                         f"{wrapper.randomized_pos} (max_seq_len becomes L with randomized_pos)")
    checks.seq_len(n, wrapper.max_seq_len)
