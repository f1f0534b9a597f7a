"""The x-transformers style keywords of the layer stack, as a table: one row per public keyword.

Each row routes a keyword to fields of `LayersConfig` (dotted paths such as "attention.bias").
Two keywords that write different values to the same field conflict (for example two positional
schemes); the error names both. Unknown keywords fail with the closest valid names. The rows of
the family's variants live in `family_keywords.py`, `Route` and the value converters in `routes.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from typing import Any, Callable

from .config import AttentionConfig, Choice, FeedForwardConfig, LayersConfig, stack_options
from .family_keywords import FAMILY_KEYWORDS
from .routes import Route, _layout, _llama3, _pre_norm, _shift, flag

KEYWORDS: dict[str, Route] = {
    # the stack
    "dim": Route("dim"),
    "depth": Route("depth"),
    "causal": Route("causal"),
    "cross_attend": Route("cross_attend"),
    "only_cross": Route("only_cross"),
    "dim_context": Route("dim_context"),
    "custom_layers": Route("custom_layers", _layout),
    "sandwich_coef": Route("sandwich_coef"),
    "macaron": Route("macaron"),
    "gradient_checkpointing": Route("gradient_checkpointing"),
    "shift_tokens": Route("shift_tokens", _shift),
    "residual_attn": Route("residual_attn"),
    "cross_residual_attn": Route("cross_residual_attn"),
    # residual and norm
    "pre_norm": Route("placement", _pre_norm),
    "sandwich_norm": flag(placement="sandwich"),
    "use_scalenorm": flag(norm="scale"),
    "use_rmsnorm": flag(norm="rms"),
    "use_rezero": flag(residual="rezero", norm="none"),
    "gate_residual": flag(residual="gru"),
    "norm_eps": Route("norm_eps", float),
    # positions
    "rotary_pos_emb": flag(attention__position="rotary"),
    "rotary_emb_dim": Route("attention.rotary_dim"),
    "rotary_base": Route("attention.rotary_base", float),
    "rotary_interleaved": Route("attention.rotary_interleaved"),
    "rotary_interpolation_factor": Route("attention.rotary_interpolation", float),
    "rotary_llama3_scaling": Route("attention.rotary_llama3", _llama3),
    "position_infused_attn": flag(attention__position="infused"),
    "rel_pos_bias": flag(attention__bias="t5"),
    "rel_pos_num_buckets": Route("attention.rel_pos_num_buckets"),
    "rel_pos_max_distance": Route("attention.rel_pos_max_distance"),
    "alibi_pos_emb": flag(attention__bias="alibi"),
    "alibi_pos_bias": flag(attention__bias="alibi"),          # later x-transformers spelling
    "alibi_num_heads": Route("attention.alibi_num_heads"),
    # attention
    "heads": Route("attention.heads"),
    "attn_dim_head": Route("attention.dim_head"),
    "attn_kv_heads": Route("attention.kv_heads"),
    "attn_one_kv_head": flag(attention__kv_heads=1),
    "attn_dropout": Route("attention.dropout", float),
    "attn_num_mem_kv": Route("attention.num_mem_kv"),
    "attn_sparse_topk": Route("attention.topk"),
    "attn_use_entmax15": flag(attention__normalize="entmax15"),
    "attn_talking_heads": Route("attention.talking_heads"),
    "attn_collab_heads": Route("attention.collab_heads"),
    "attn_collab_compression": Route("attention.collab_compression", float),
    "attn_on_attn": Route("attention.on_attn"),
    "gate_values": Route("attention.gate_values"),
    "attn_gate_values": Route("attention.gate_values"),       # later x-transformers spelling
    "attn_flash": Route("attention.fused"),
    "attn_qkv_bias": flag(attention__qkv_bias=True),
    "attn_out_bias": flag(attention__out_bias=True),
    # feedforward
    "ff_mult": Route("ff.mult"),
    "ff_glu": Route("ff.glu"),
    "ff_relu_squared": flag(ff__activation="relu_squared"),
    "ff_swish": flag(ff__activation="swish"),
    "ff_gelu_tanh": flag(ff__activation="gelu_tanh"),
    "ff_dropout": Route("ff.dropout", float),
    "ff_no_bias": flag(ff__bias=False),
    **FAMILY_KEYWORDS,
}


def writing(path: str, below: bool = False) -> list[str]:
    """The keywords whose row writes field `path` (or, with below, anything under it), in table order."""
    def hit(p: str) -> bool:
        return p == path or (below and p.startswith(path + "."))

    return [k for k, route in KEYWORDS.items()
            if any(hit(p) for p in ([route.path] if route.path is not None else list(route.when_true or {})))]


def closest(name: str, valid: list[str] | tuple[str, ...] | set[str]) -> str:
    """' did you mean ...?' with the closest valid names, or '' when none is close."""
    matches = difflib.get_close_matches(name, sorted(valid), n=3, cutoff=0.6)
    if not matches:
        return ""
    return "; did you mean " + " or ".join(repr(m) for m in matches) + "?"


def unknown_keyword(name: str, valid: Any, owner: str) -> TypeError:
    return TypeError(f"{owner} got an unknown keyword {name!r}{closest(name, valid)}")


def parse_layers(keywords: dict[str, Any], owner: str = "AttentionLayers") -> LayersConfig:
    """Turn x-transformers style keywords into a `LayersConfig`, refusing unknown or clashing ones."""
    written: dict[str, tuple[str, Any]] = {}
    for name, arg in keywords.items():
        route = KEYWORDS.get(name)
        if route is None:
            raise unknown_keyword(name, KEYWORDS, owner)
        try:
            writes = route.writes(arg)
        except (TypeError, ValueError) as err:
            raise TypeError(f"{owner}: keyword {name!r}: {err}") from None
        for path, value in writes.items():
            if path in written and written[path][1] != value:
                other = written[path][0]
                raise ValueError(
                    f"{owner}: keywords {other!r} and {name!r} conflict: both set {path} "
                    f"({written[path][1]!r} vs {value!r}); choose one"
                )
            written[path] = (name, value)
    if "depth" not in written and "custom_layers" in written:     # x-transformers: a custom layout needs no depth
        written["depth"] = ("custom_layers", len(written.get("execute_order", written["custom_layers"])[1] or ()))
    if "dim" not in written or "depth" not in written:
        missing = [k for k in ("dim", "depth") if k not in written]
        raise TypeError(f"{owner} needs the keyword(s) {missing}")
    values = {path: value for path, (_, value) in written.items()}
    if values.get("attention.normalize") is None and values.get("attention.topk") is not None:
        values["attention.normalize"] = "topk"
    try:
        return _build(values, {path: name for path, (name, _) in written.items()})
    except ValueError as err:
        raise ValueError(f"{owner}: {err}") from None


# stages whose variants are choices with options: keyword rows write "<prefix>.<name>.<field>"
CHOICE_STAGES = {"attention.pattern.": "pattern", "attention.kernel.": "kernel", "mixer.": "mixer",
                 "attention.relative.": "relative"}


def _choices(stage: str, prefix: str, fields: dict[str, dict[str, Any]], keywords: dict[str, str]
             ) -> tuple[Choice, ...]:
    """The stage's choices, in the registry's order, from their options' fields. A choice missing a
    required option, or given options without the keyword that switches it on, names the keywords
    given and the keyword it needs."""
    from .registry import STAGES

    table = STAGES[stage]
    choices = []
    for name in table:
        if name not in fields:
            continue
        options = table[name].options
        given = sorted({k for path, k in keywords.items() if path.startswith(f"{prefix}{name}")})
        required = [f.name for f in dataclasses.fields(options) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING] if options else []
        missing = [m for m in required if m not in fields[name]]
        # a pattern piece is on when any of its options is given; a kernel or mixer needs its switch
        switched = stage == "pattern" or f"{prefix}{name}" in keywords or (required and not missing)
        if missing or not switched:
            wanted = [f"{prefix}{name}.{m}" for m in missing] or [f"{prefix}{name}"]
            needed = sorted({k for k, route in KEYWORDS.items()
                             if route.path in wanted or any(p in wanted for p in (route.when_true or {}))})
            raise ValueError(f"{' / '.join(given)} need(s) {' and '.join(needed)}")
        choices.append(Choice(stage, name, options(**fields[name]) if options else None))
    return tuple(choices)


def _one(choices: tuple[Choice, ...], prefix: str, keywords: dict[str, str],
         why: str = "each chooses how attention is computed") -> Choice:
    """The single choice of a stage that takes one (a kernel, a mixer): two are refused by name."""
    if len(choices) > 1:
        named = [sorted({k for p, k in keywords.items() if p.startswith(f"{prefix}{c.name}")})[0] for c in choices]
        raise ValueError(f"{' and '.join(named)} conflict: {why}; choose one")
    return choices[0]


def _onto(head: str, fields: dict[str, Any], switched: Any, keywords: dict[str, str]) -> Any:
    """The options dataclass the switch keyword of `head` wrote, with the options given written onto it;
    options given without the switch are refused by name."""
    if not dataclasses.is_dataclass(switched):
        given = sorted({k for path, k in keywords.items() if path.startswith(f"{head}.")})
        raise ValueError(f"{' / '.join(given)} need(s) {' or '.join(writing(head))}=True")
    return dataclasses.replace(switched, **fields)


def _build(values: dict[str, Any], keywords: dict[str, str] | None = None) -> LayersConfig:
    keywords = keywords or {}
    groups: dict[str, dict[str, Any]] = {"attention": {}, "ff": {}, "": {}}
    chosen: dict[str, dict[str, dict[str, Any]]] = {prefix: {} for prefix in CHOICE_STAGES}
    for path, value in values.items():
        prefix = next((p for p in CHOICE_STAGES if path.startswith(p)), None)
        if prefix is not None:
            name, *field = path[len(prefix):].split(".")
            chosen[prefix].setdefault(name, {}).update({field[0]: value} if field else value)
            continue
        head, _, tail = path.partition(".")
        if tail:
            groups.setdefault(head, {})[tail] = value
        else:
            groups[""][head] = value
    for head in groups.keys() - {"attention", "ff", ""}:     # a stack option's own dataclass (act.threshold)
        groups[""][head] = _onto(head, groups[head], groups[""].get(head), keywords)
    for part in ("ff", "attention"):    # a section option's dataclass (ff.moe.top_k, attention.latent.dim_kv)
        for sub in {t.split(".")[0] for t in groups[part] if "." in t}:
            fields = {t.split(".", 1)[1]: groups[part].pop(t) for t in list(groups[part]) if t.startswith(f"{sub}.")}
            start = groups[part].get(sub)
            if start is None and not writing(f"{part}.{sub}"):    # options without a switch keyword: their defaults
                start = stack_options()[f"{part}.{sub}"]()
            groups[part][sub] = _onto(f"{part}.{sub}", fields, start, keywords)
    made = {prefix: _choices(stage, prefix, chosen[prefix], keywords)
            for prefix, stage in CHOICE_STAGES.items() if chosen[prefix]}
    if "attention.pattern." in made:
        groups["attention"]["pattern"] = made["attention.pattern."]
    if "attention.kernel." in made:
        groups["attention"]["kernel"] = _one(made["attention.kernel."], "attention.kernel.", keywords)
    if "mixer." in made:
        groups[""]["mixer"] = _one(made["mixer."], "mixer.", keywords)
    if "attention.relative." in made:        # position/relative.py: one scheme
        groups["attention"]["relative"] = _one(made["attention.relative."], "attention.relative.", keywords,
                                               "two relative position schemes in one stage")
    layers = groups[""].pop("attention_layers", None)     # attn_per_layer: each block's keywords (per_layer.py)
    cfg = LayersConfig(
        attention=AttentionConfig(**groups["attention"]),
        ff=FeedForwardConfig(**groups["ff"]),
        **groups[""],
    )
    if layers is not None:
        from .per_layer import expand

        cfg = dataclasses.replace(cfg, attention_layers=expand(layers, values, keywords))
    return cfg


def checked_keywords(init: Callable) -> Callable:
    """Make a constructor refuse unknown keywords with the closest valid names, and keep the
    keywords it was called with as `self.init_args` (see `build.model_config`)."""
    params = inspect.signature(init).parameters
    valid = [p for p in params if p != "self"]

    @functools.wraps(init)
    def wrapper(self, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in params:
                raise unknown_keyword(name, valid, type(self).__name__)
        init(self, *args, **kwargs)
        self.init_args = dict(kwargs)

    return wrapper
