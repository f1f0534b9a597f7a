"""Per-layer attention options: `attn_per_layer = [dict(attn_window=128), {}, ...]` gives each
self-attention block its own attention keywords, applied on top of the stack's own (alternating local
and global layers as Gemma 2, Longformer-style stacks, the Reformer's mix of local and LSH layers).

One dict per self-attention block, in order (under universal=True, per block of the shared unit);
`[a, b] * (depth // 2)` cycles a pattern. Only attention keywords go inside; the score bias (one module
shared by the stack's blocks) and position-infused attention (absolute positions the wrapper reads) stay
on the stack. A keyword in a block's dict replaces the stack's value of the same field; a block cannot
drop a choice the stack makes (a kernel, a pattern piece, a flag), so give those per block instead.
The result is plain data, `LayersConfig.attention_layers` (one `AttentionConfig` per block), checked
by the same rules as the stack's own, each problem named with its block's index.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import BIAS_KEYWORD, AttentionConfig, LayersConfig
from .universal import unit

if TYPE_CHECKING:
    from .stack import AttentionLayers

KEYWORD = "attn_per_layer"
# fields of the stack's score bias: one module per stack, shared by its blocks
BIAS_FIELDS = ("bias", "rel_pos_num_buckets", "rel_pos_max_distance", "alibi_num_heads")


@dataclass(frozen=True)
class LayerKeywords:
    """One block's keywords as the table routes them: path -> (keyword, value); `off`: flags given False
    (they write nothing), keyword -> the paths their True would write."""

    writes: dict[str, tuple[str, Any]]
    off: dict[str, tuple[str, ...]]


def attention_keywords() -> list[str]:
    """The keywords allowed in a block's dict: every keyword that writes only attention fields, less the
    score bias and position-infused attention."""
    from .keywords import KEYWORDS

    return [name for name, route in KEYWORDS.items() if _refusal(name, route) is None]


def _paths(route: Any) -> list[str]:
    return [route.path] if route.path is not None else list(route.when_true or {})


def _refusal(name: str, route: Any) -> str | None:
    """Why keyword `name` cannot be given per block, or None when it can."""
    paths = _paths(route)
    if not paths or not all(p.startswith("attention.") for p in paths):
        return f"{name!r} is not an attention keyword: per-block options shape attention only; give it to the stack"
    if any(p[len("attention."):] in BIAS_FIELDS for p in paths):
        return (f"{name!r} sets the score bias, one module shared by the stack's blocks: give it to the stack "
                "(every self-attention block then takes it)")
    if (route.when_true or {}).get("attention.position") == "infused":
        return (f"{name!r} adds absolute positions to every block's input (the wrapper reads it): give it to "
                "the stack")
    return None


def parse(arg: Any) -> tuple[LayerKeywords, ...]:
    """The attn_per_layer keyword's value: a list with one dict of attention keywords per self-attention
    block. Unknown keywords, keywords that are not attention keywords and clashes within a dict are
    refused, named with the block's index."""
    from .keywords import KEYWORDS, unknown_keyword

    if not isinstance(arg, (list, tuple)) or not all(isinstance(d, dict) for d in arg):
        raise TypeError(f"expected a list with one dict of attention keywords per self-attention block, got {arg!r}")
    out = []
    for i, given in enumerate(arg):
        owner = f"{KEYWORD}[{i}]"
        writes: dict[str, tuple[str, Any]] = {}
        off: dict[str, tuple[str, ...]] = {}
        for name, value in given.items():
            route = KEYWORDS.get(name) if isinstance(name, str) else None
            if route is None:
                raise unknown_keyword(name, attention_keywords(), owner)
            refusal = _refusal(name, route)
            if refusal is not None:
                raise TypeError(f"{owner}: {refusal}")
            try:
                written = route.writes(value)
            except (TypeError, ValueError) as err:
                raise TypeError(f"{owner}: keyword {name!r}: {err}") from None
            if route.when_true is not None and not written:
                off[name] = tuple(route.when_true)
            for path, v in written.items():
                if path in writes and writes[path][1] != v:
                    raise TypeError(f"{owner}: keywords {writes[path][0]!r} and {name!r} conflict: both set {path} "
                                    f"({writes[path][1]!r} vs {v!r}); choose one")
                writes[path] = (name, v)
        out.append(LayerKeywords(writes, off))
    return tuple(out)


def expand(layers: tuple[LayerKeywords, ...], values: dict[str, Any], keywords: dict[str, str]
           ) -> tuple[AttentionConfig, ...]:
    """Each block's `AttentionConfig`: the stack's written fields (`values`, path -> value, `keywords`,
    path -> keyword) with the block's on top, built by the keyword table's own step."""
    from .keywords import _build

    base = {p: v for p, v in values.items() if p != "attention_layers"}
    out = []
    for i, layer in enumerate(layers):
        for name, paths in layer.off.items():
            if any(p in base for p in paths):
                stack = keywords[next(p for p in paths if p in base)]
                raise ValueError(f"{KEYWORD}[{i}]: {name}=False cannot switch off the stack's {stack}: a block "
                                 f"cannot drop what the stack chooses; give {stack} per block instead")
        merged = {**base, **{p: v for p, (_, v) in layer.writes.items()}}
        named = {**keywords, **{p: k for p, (k, _) in layer.writes.items()}}
        if "attention.topk" in layer.writes and "attention.normalize" not in layer.writes:
            merged["attention.normalize"] = "topk"
        try:
            out.append(_build(merged, named).attention)
        except ValueError as err:
            raise ValueError(f"{KEYWORD}[{i}]: {err}") from None
    return tuple(out)


def problems(cfg: LayersConfig) -> list[str]:
    """What the per-block configs cannot be, as a whole (each block's own rules: `check`)."""
    layers = cfg.attention_layers
    if layers is None:
        return []
    if cfg.mixer is not None:
        from .attention.kernels.direct import switch

        return [f"{KEYWORD} gives self-attention blocks their own attention options; "
                f"{switch('mixer.', cfg.mixer.name)} replaces attention in every block: choose one"]
    if not isinstance(layers, tuple) or not all(isinstance(a, AttentionConfig) for a in layers):
        return [f"{KEYWORD}: expected one attention config per self-attention block, got {layers!r}"]
    layout = unit(cfg)                  # under universal=True, the shared unit's blocks
    if len(layers) != layout.count("a"):
        return [f"{KEYWORD} has {len(layers)} entries; the stack has {layout.count('a')} self-attention blocks "
                f"(layout {''.join(layout)!r}{', the shared unit of universal=True' if cfg.universal else ''}): "
                "give one dict per block"]
    found = []
    base = cfg.attention
    for i, a in enumerate(layers):
        if any(getattr(a, f) != getattr(base, f) for f in BIAS_FIELDS):
            found.append(f"{KEYWORD}[{i}]: the score bias (rel_pos_bias / alibi_pos_emb and their options) is one "
                         "module shared by the stack's blocks: give it to the stack")
        if (a.position == "infused") != (base.position == "infused"):
            found.append(f"{KEYWORD}[{i}]: position_infused_attn adds absolute positions to every block's input: "
                         "give it to the stack")
        if base.bias != "none" and a.heads != base.heads:
            found.append(f"{KEYWORD}[{i}]: heads={a.heads} differs from the stack's heads={base.heads}, but the "
                         f"stack's score bias ({_bias_keyword(base)}) has one value per stack head")
        if cfg.residual_attn and (a.heads, a.num_mem_kv) != (layers[0].heads, layers[0].num_mem_kv):
            found.append(f"{KEYWORD}[{i}]: residual_attn=True adds each block's scores to the next block's: heads and "
                         f"attn_num_mem_kv must agree across the blocks, got {(a.heads, a.num_mem_kv)} and "
                         f"{(layers[0].heads, layers[0].num_mem_kv)} in block 0")
    return found


def _bias_keyword(a: AttentionConfig) -> str:
    return BIAS_KEYWORD[a.bias]


def check(cfg: LayersConfig, owner: str) -> None:
    """Raise ValueError for the first problem of the per-block configs: the whole (`problems`), then each
    block's config by the stack's own rules, named with its index."""
    if cfg.attention_layers is None:
        return
    found = problems(cfg)
    if found:
        raise ValueError(f"{owner}: {found[0]}")
    from .rules import check as rules_check

    for i, a in enumerate(cfg.attention_layers):
        rules_check(dataclasses.replace(cfg, attention=a, attention_layers=None), f"{owner}: {KEYWORD}[{i}]")


def check_state(stack: "AttentionLayers", owner: str) -> None:
    """A Decoder's decode state stores the keys of every block that keeps keys in one tensor: their
    (key heads, key size, value heads, value size) must agree."""
    if stack.cfg.attention_layers is None or not stack.causal:
        return
    keyed = [(i, b.branch.decode_dims) for i, b in enumerate(b for b in stack.blocks if b.kind == "a")
             if b.branch.decode_kind == "keys"]
    for i, dims in keyed[1:]:
        if dims != keyed[0][1]:
            raise ValueError(
                f"{owner}: {KEYWORD}[{keyed[0][0]}] and {KEYWORD}[{i}] keep keys of different shapes in a decode "
                f"state ((key heads, key size, value heads, value size) {keyed[0][1]} vs {dims}): heads / "
                "attn_dim_head / attn_kv_heads / attn_collab_heads / attn_data_dependent_alibi(_per_row) must agree "
                "across the blocks that keep keys")
