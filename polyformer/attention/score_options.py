"""The options of the score stages (scoring.py, gates.py) and the keyword routes that write them: any
score keyword writes the options too, so it switches the section on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..routes import Route


@dataclass(frozen=True)
class ScoreOptions:
    qk_norm: bool = False
    qk_norm_groups: int = 1             # l2-normalise each of this many feature groups: scores in [-g, g] * scale
    qk_norm_scale: float = 10.0         # the score scale with qk_norm (x-transformers' default)
    qk_norm_dim_scale: bool = False     # learned per-feature q / k scales instead of the fixed scale
    sigmoid: bool = False
    sigmoid_bias: float = 0.0           # b in sigmoid(s + b); the paper suggests -log(n), x-transformers has none
    softclamp: bool = False
    softclamp_value: float = 50.0
    head_sink: bool = False             # a learned sink logit per head, init 0
    zero_kv: bool = False               # a key and value of zeros: a sink of logit 0
    pre_talking_heads: bool = False
    post_talking_heads: bool = False
    max_attend_past: int | None = None  # written with the causal window it is (attn_window = M + 1), for its check
    z_loss_weight: float = 0.0          # > 0: report "attn_z_loss" with this weight
    gate_value_heads: bool = False      # attention/gates.py
    output_gate: bool = False
    output_gate_headwise: bool = False
    output_gate_rank: int | None = None
    gate_values_headwise: bool = False  # gate_values as the fused gate's input gate (attention.gate_values)
    gate_values_rank: int | None = None
    swiglu_values: bool = False         # the fused gate through SiLU instead of sigmoid
    low_rank_silu_gates: bool = True    # a SiLU between a low-rank gate's two maps


@dataclass(frozen=True)
class ScoreRoute(Route):
    """Writes a field of `ScoreOptions` (`path` is "attention.scores.<field>"), and the options themselves, so
    any score keyword switches the section on; a switch (convert None) takes True or False."""

    def writes(self, arg: Any) -> dict[str, Any]:
        if self.convert is None and not isinstance(arg, bool):
            raise TypeError(f"expected True or False, got {arg!r}")
        return {"attention.scores": ScoreOptions(), **super().writes(arg)}


@dataclass(frozen=True)
class AttendPast(Route):
    """attn_max_attend_past=M: every key at most M positions back, i.e. a causal window of M + 1 keys."""

    def writes(self, arg: Any) -> dict[str, Any]:
        if arg is None:
            return {}
        if isinstance(arg, bool) or not isinstance(arg, int) or arg < 0:
            raise TypeError(f"expected an integer >= 0 or None, got {arg!r}")
        return {"attention.scores": ScoreOptions(), "attention.pattern.window.size": arg + 1,
                "attention.scores.max_attend_past": arg}


def same(arg: Any) -> Any:
    """A value option's converter: the value as given (its check names what is wrong with it)."""
    return arg
