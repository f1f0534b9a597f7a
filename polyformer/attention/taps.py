"""Per-forward requests that read blocks' normalisers through hooks, for one forward only (the attention
z-loss under x-transformers' spellings, z_loss.py; return_gumbel_log_probs, hard_log_probs.py): the hooks held
while the forward runs, and the forward's own arguments re-passed with the record asked for."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from torch import nn


@contextmanager
def tapped(modules: Iterable[nn.Module], hook: Callable[..., None], pre: bool = False) -> Iterator[None]:
    """Within: `hook` on every module's forward (before it with `pre`: hook(module, inputs); else
    hook(module, inputs, output)); removed on leaving, also after an error."""
    handles = []
    try:
        for m in modules:
            handles.append(m.register_forward_pre_hook(hook) if pre else m.register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def recorded(args: dict[str, Any], flag: str) -> dict[str, Any]:
    """A forward's `locals()` as its arguments again: without self and the request `flag`, with the record
    (return_intermediates) asked for."""
    return {**{k: v for k, v in args.items() if k not in ("self", "__class__", flag)}, "return_intermediates": True}
