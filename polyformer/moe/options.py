"""The options of a mixture-of-experts feedforward (`ff_moe=True`) and their checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..checks import flag, number, whole

if TYPE_CHECKING:
    from ..config import LayersConfig


@dataclass(frozen=True)
class MoeOptions:
    num_experts: int = 8                    # E (ff_num_experts)
    top_k: int = 2                          # experts per token: 1 Switch, 2 GShard / Mixtral
    capacity_factor: float | None = None    # c: at most ceil(c * tokens * k / E) tokens per expert and row; None: no limit
    capacity: int | None = None             # an absolute per-row, per-expert capacity (Switch checkpoints); None: none
    balance_loss: float = 0.01              # alpha of the Switch load-balancing loss alpha * E * sum_i f_i P_i
    z_loss: float = 0.0                     # weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE)
    jitter: float = 0.0                     # eps: router inputs times U(1 - eps, 1 + eps) in training
    shared_experts: int = 0                 # always-on experts added to every token's output
    every: int = 1                          # experts at every k-th feedforward block, dense ones between
    offset: int | None = None               # experts where position % every == offset; None: every - 1
    route_padding: bool = False             # padding routed, counted in capacity (Switch in transformers)
    renormalize: bool | None = None         # divide the top-k gates by their sum; None: when top_k > 1

    @property
    def renormalized(self) -> bool:
        return self.top_k > 1 if self.renormalize is None else self.renormalize

    @property
    def limited(self) -> bool:
        """Whether an expert takes at most a capacity of each row's tokens (capacity.py)."""
        return self.capacity_factor is not None or self.capacity is not None


def is_moe(options: MoeOptions | None, position: int) -> bool:
    """Whether the feedforward block at `position` (0-based among the stack's 'f' blocks) has experts: the
    every-th, 2 every-th, ... of them (with an offset: those at position % every == offset)."""
    return options is not None and position % options.every == first(options)


def first(options: MoeOptions) -> int:
    """The position of the first feedforward block with experts."""
    return options.every - 1 if options.offset is None else options.offset


def problems(cfg: "LayersConfig") -> list[str]:
    """What is wrong with the ff_moe keywords' values and their combination with the stack, each naming
    its keyword."""
    o = cfg.ff.moe
    if o is None:
        return []
    found = whole(o.num_experts, "ff_num_experts")
    if not found and (isinstance(o.top_k, bool) or not isinstance(o.top_k, int) or not 1 <= o.top_k <= o.num_experts):
        found.append(f"ff_moe_top_k must be an integer in [1, ff_num_experts={o.num_experts}], got {o.top_k!r}")
    c = o.capacity_factor
    if c is not None and (not number(c) or c <= 0):
        found.append(f"ff_moe_capacity_factor must be a number > 0 (or None: no dropping), got {c!r}")
    found += whole(o.capacity, "ff_moe_capacity", optional=True)
    if c is not None and o.capacity is not None:
        found.append("ff_moe_capacity_factor and ff_moe_capacity both limit the tokens per expert; choose one")
    for name, value in (("ff_moe_balance_loss", o.balance_loss), ("ff_moe_z_loss", o.z_loss)):
        if not number(value) or value < 0:
            found.append(f"{name} must be a number >= 0, got {value!r}")
    if not number(o.jitter) or not 0 <= o.jitter < 1:
        found.append(f"ff_moe_jitter must be a number in [0, 1), got {o.jitter!r}")
    found += whole(o.shared_experts, "ff_moe_shared_experts", low=0)
    found += whole(o.every, "ff_moe_every")
    found += whole(o.offset, "ff_moe_offset", low=0, optional=True)
    found += flag(o.route_padding, "ff_moe_route_padding")
    if o.renormalize is not None and not isinstance(o.renormalize, bool):
        found.append(f"ff_moe_renormalize must be True, False or None, got {o.renormalize!r}")
    if found:
        return found
    from ..universal import unit

    blocks = unit(cfg).count("f")       # the feedforward blocks built (universal=True: the shared unit's)
    if o.offset is not None and o.offset >= o.every:
        found.append(f"ff_moe_offset must be below ff_moe_every={o.every}, got {o.offset}")
    elif blocks <= first(o):
        at = f"ff_moe_every={o.every}" + (f" with ff_moe_offset={o.offset}" if o.offset is not None else "")
        shared = " in the shared unit of universal=True" if cfg.universal else ""
        found.append(f"{at} gives no feedforward block experts: the layout has {blocks}{shared}")
    if cfg.ff.chunks > 1:
        found.append("ff_chunks splits a dense feedforward along the sequence; ff_moe=True does not take it")
    if cfg.residual == "deepnorm":
        found.append("deepnorm=True initialises dense feedforwards; ff_moe=True is not supported with it")
    if o.limited and (cfg.universal or cfg.hourglass is not None or cfg.reversible):
        named = "universal=True" if cfg.universal else "hourglass" if cfg.hourglass is not None else "reversible=True"
        found.append(f"ff_moe_capacity_factor / ff_moe_capacity count tokens per row in token order; {named} is "
                     "not supported with them (use no capacity limit)")
    return found
