"""The arena's variants: one row each, a name mapped to polyformer keywords.

A row says which keywords go on the layer stack (`Encoder` / `Decoder`), which on the wrapper
(`TransformerWrapper`), which environment switches hold while it runs, and which tasks it joins by
default. Adding a variant to the arena is adding a row here; every task builds its models from these
rows alone, so two variants of one task differ only in their keywords.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TASK_NAMES = ("extrapolation", "mqar", "efficiency", "listops", "long_text")


@dataclass(frozen=True)
class Variant:
    name: str
    summary: str                                              # one line for tables and --list
    paper: str                                                # arXiv id or reference
    layers: dict[str, Any] = field(default_factory=dict)      # keywords for Encoder / Decoder
    wrapper: dict[str, Any] = field(default_factory=dict)     # keywords for TransformerWrapper
    env: dict[str, str] = field(default_factory=dict)         # environment while it runs
    tasks: tuple[str, ...] = ()                               # tasks it joins by default
    causal_only: bool = False                                 # cannot run in an Encoder

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tasks) - set(TASK_NAMES))
        if unknown:
            raise ValueError(f"variant {self.name!r}: unknown task(s) {unknown}; tasks are {TASK_NAMES}")


POSITIONS = ("extrapolation",)
ATTENTION = ("mqar", "listops", "efficiency")

VARIANTS: dict[str, Variant] = {v.name: v for v in [
    # --- attention (the dense kernel and its normalisers) --------------------------------------
    Variant("dense", "exact softmax attention, the default fast path (our CPU kernel / SDPA)",
            "arXiv:1706.03762", layers=dict(rotary_pos_emb=True), tasks=ATTENTION),
    Variant("dense_sdpa", "exact softmax attention on torch's scaled_dot_product_attention only",
            "arXiv:1706.03762", layers=dict(rotary_pos_emb=True), env={"POLYFORMER_CPU_ATTENTION": "0"},
            tasks=("efficiency",)),
    Variant("topk", "softmax over each query's 8 largest scores only (explicit sparse transformer)",
            "arXiv:1912.11637", layers=dict(rotary_pos_emb=True, attn_sparse_topk=8),
            tasks=("mqar", "listops")),
    Variant("entmax15", "sparse entmax-1.5 instead of softmax", "arXiv:1909.00015",
            layers=dict(rotary_pos_emb=True, attn_use_entmax15=True), tasks=()),
    # --- positions ---------------------------------------------------------------------------
    Variant("abs_learned", "learned absolute positions (one vector per position)", "arXiv:1706.03762",
            wrapper=dict(use_abs_pos_emb=True), tasks=POSITIONS + ("mqar",)),   # Zoology's models have them
    Variant("sinusoidal", "fixed sinusoidal absolute positions, scaled by a learned scalar",
            "arXiv:1706.03762", wrapper=dict(scaled_sinu_pos_emb=True), tasks=POSITIONS),
    Variant("rotary", "rotary position embedding on q and k", "arXiv:2104.09864",
            layers=dict(rotary_pos_emb=True), tasks=POSITIONS),
    Variant("alibi", "ALiBi: a linear distance penalty per head", "arXiv:2108.12409",
            layers=dict(alibi_pos_emb=True), tasks=POSITIONS),
    Variant("t5_bias", "T5's learned bucketed relative bias", "arXiv:1910.10683",
            layers=dict(rel_pos_bias=True), tasks=POSITIONS),
    Variant("nope", "no positional information at all (causal masking alone)", "arXiv:2305.19466",
            wrapper=dict(use_abs_pos_emb=False), tasks=POSITIONS, causal_only=True),
    Variant("infused", "sinusoids added to the q / k inputs of every layer (Shortformer)",
            "arXiv:2012.15832", layers=dict(position_infused_attn=True), tasks=()),
    # --- memories ----------------------------------------------------------------------------
    Variant("no_memory", "segments of 128 tokens, no memory of earlier segments", "arXiv:1901.02860",
            layers=dict(rotary_pos_emb=True), tasks=("long_text",)),
    Variant("xl", "Transformer-XL memory of the previous segment's hidden states (128 per layer)",
            "arXiv:1901.02860", layers=dict(rotary_pos_emb=True), wrapper=dict(max_mem_len=128),
            tasks=("long_text",), causal_only=True),
]}


def variant(name: str) -> Variant:
    if name not in VARIANTS:
        import difflib

        close = difflib.get_close_matches(name, VARIANTS, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown variant {name!r}{hint} (see python -m benchmarks.arena --list)")
    return VARIANTS[name]


def for_task(task: str) -> list[str]:
    """The variants that join `task` by default, in table order."""
    return [name for name, v in VARIANTS.items() if task in v.tasks]
