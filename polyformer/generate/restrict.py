"""`restrict_to_max_seq_len` (x-transformers' generate keyword): True keeps exactly the last
max_seq_len tokens as context at every step, False keeps every token; None is polyformer's default
(learned positions: the last max_seq_len; otherwise a decode state that slides a quarter of its window
at a time). Refused by name where a model cannot do what it asks."""

from __future__ import annotations

from torch import nn


def check_restrict(wrapper: nn.Module, restrict: bool | None, n: int, seq_len: int, cache_kv: bool,
                   has_state: bool) -> None:
    """Refuse `restrict_to_max_seq_len` for prompts of n tokens and seq_len more where the model
    cannot honour it. The last generated token is never fed, so the model sees n + seq_len - 1."""
    if restrict is None:
        return
    if not isinstance(restrict, bool):
        raise TypeError(f"restrict_to_max_seq_len must be True, False or None, got {restrict!r}")
    if has_state:
        raise ValueError("restrict_to_max_seq_len sizes the decode state itself; it does not take a state")
    net, limit = wrapper.net, wrapper.max_seq_len
    if n + seq_len - 1 <= limit:
        return
    if not restrict:
        if net.bounded:
            raise ValueError(f"restrict_to_max_seq_len=False keeps all {n + seq_len - 1} tokens as context but the "
                             f"model's learned positions stop at max_seq_len={limit}")
        return
    if not cache_kv:
        return
    layers = net.attn_layers
    reason = None
    if net.bounded:
        reason = "its learned absolute positions cannot move"
    elif layers.window is not None and (layers.window[0] > 0 or layers.window[1] > limit):
        reason = f"its attention window (sinks, span) = {layers.window} reaches past the last max_seq_len tokens"
    elif layers.hourglass is not None or net.landmarks is not None or net.interspersed is not None:
        reason = "its decode state (hourglass / landmarks / interspersed memory tokens) cannot drop single tokens"
    elif any(b.branch.decode_kind == "recurrent" for b in layers.blocks if b.kind == "a"):
        reason = "a recurrent summary cannot forget the tokens it summarised"
    if reason is not None:
        raise ValueError(f"restrict_to_max_seq_len=True with cache_kv=True cannot drop the tokens before the last "
                         f"max_seq_len={limit} from this model's cache ({reason}); pass cache_kv=False to "
                         "recompute the last max_seq_len tokens at every step")


def state_len(wrapper: nn.Module, restrict: bool | None, n: int, seq_len: int) -> int | None:
    """Positions the decode state needs under `restrict` (None: `wrapper.state_for` decides)."""
    if restrict is None or wrapper.net.attn_layers.window is not None:
        return None
    return min(n + seq_len, wrapper.max_seq_len) if restrict else n + seq_len
