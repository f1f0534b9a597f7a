"""The x-transformers style keywords of the layer stack, as a table: one row per public keyword.

Each row routes a keyword to fields of `LayersConfig` (dotted paths such as "attention.bias").
Two keywords that write different values to the same field conflict (for example two positional
schemes); the error names both. Unknown keywords fail with the closest valid names.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from .config import AttentionConfig, Choice, FeedForwardConfig, LayersConfig


@dataclass(frozen=True)
class Route:
    """Write `value(arg)` to `path`; a `when_true` route writes fixed fields only if arg is truthy."""

    path: str | None = None
    convert: Callable[[Any], Any] | None = None
    when_true: dict[str, Any] | None = None

    def writes(self, arg: Any) -> dict[str, Any]:
        if self.when_true is not None:
            if not isinstance(arg, bool):
                raise TypeError(f"expected True or False, got {arg!r}")
            return dict(self.when_true) if arg else {}
        value = self.convert(arg) if self.convert is not None else arg
        return {self.path: value}


def flag(**fields: Any) -> Route:
    return Route(when_true={k.replace("__", "."): v for k, v in fields.items()})


def _pre_norm(arg: Any) -> str:
    if not isinstance(arg, bool):
        raise TypeError(f"expected True or False, got {arg!r}")
    return "pre" if arg else "post"


def _shift(arg: Any) -> int | tuple[int, ...]:
    if isinstance(arg, (list, tuple)):
        return tuple(int(a) for a in arg)
    return int(arg)


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _llama3(arg: Any) -> tuple[float, float, float, float] | None:
    """{factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} (Hugging Face's
    names for Llama 3's rope scaling) -> a tuple in that order; None: off."""
    if arg is None:
        return None
    if not isinstance(arg, dict) or set(arg) != set(LLAMA3_KEYS):
        raise TypeError(f"expected a dict with exactly the keys {list(LLAMA3_KEYS)}, got {arg!r}")
    return tuple(float(arg[k]) for k in LLAMA3_KEYS)


def _ints(arg: Any) -> int | tuple[int, ...]:
    """An integer, or a sequence of them (one per head)."""
    if isinstance(arg, (list, tuple)):
        return tuple(arg)
    return arg


def _pairs(arg: Any) -> Any:
    """((w1, r1), (w2, r2), ...) from any nesting of lists / tuples."""
    if isinstance(arg, (list, tuple)):
        return tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in arg)
    return arg


def _block_local(arg: Any) -> dict[str, Any]:
    if not isinstance(arg, (list, tuple)) or len(arg) != 2:
        raise TypeError(f"expected (query_block, memory), got {arg!r}")
    return {"query_block": arg[0], "memory": arg[1]}


def _local_2d(arg: Any) -> dict[str, Any]:
    keys = {"image", "query", "memory"}
    if not isinstance(arg, dict) or not {"image", "query"} <= set(arg) <= keys:
        raise TypeError(f"expected dict(image=(H, W), query=(qh, qw), memory=(mh, mw)), got {arg!r}")
    return {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in arg.items()}


def _bigbird_blocks(arg: Any) -> dict[str, Any]:
    if not isinstance(arg, dict) or "block_size" not in arg or not set(arg) <= {"block_size", "random_blocks"}:
        raise TypeError(f"expected dict(block_size=b, random_blocks=r), got {arg!r}")
    return dict(arg)


def _depths(arg: Any) -> tuple[Any, ...] | None:
    """(N encoder layers, M decoder layers) from any sequence; None: a stack on its own."""
    if arg is None:
        return None
    if not isinstance(arg, (list, tuple)):
        raise TypeError(f"expected (N encoder layers, M decoder layers), got {arg!r}")
    return tuple(arg)


def _layout(arg: Any) -> tuple[str, ...] | None:
    return None if arg is None else tuple(arg)


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
    # DeepNet (deepnet.py): post-LN with alpha * x + f(x) and the beta-scaled init, alpha / beta from the depths
    "deepnorm": flag(residual="deepnorm", placement="post"),
    "deepnorm_depths": Route("deepnorm_depths", _depths),
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
    # sparse attention patterns (attention/patterns/): each writes its piece's options
    "attn_window": Route("attention.pattern.window.size"),
    "attn_window_dilation": Route("attention.pattern.window.dilation", _ints),
    "attn_global_tokens": Route("attention.pattern.global.tokens"),
    "attn_global_projections": Route("attention.pattern.global.projections"),
    "attn_sink_tokens": Route("attention.pattern.sinks.tokens"),
    "attn_random_blocks": Route("attention.pattern.random.blocks"),
    "attn_block_size": Route("attention.pattern.random.block_size"),
    "attn_random_seed": Route("attention.pattern.random.seed"),
    "attn_sparse": Route("attention.pattern.sparse_transformer.kind"),
    "attn_sparse_stride": Route("attention.pattern.sparse_transformer.stride"),
    "attn_sparse_summary": Route("attention.pattern.sparse_transformer.summary"),
    "attn_sparse_mode": Route("attention.pattern.sparse_transformer.mode"),
    "attn_blockwise": Route("attention.pattern.blockwise.blocks"),
    "attn_block_local": Route("attention.pattern.block_local", _block_local),
    "attn_local_2d": Route("attention.pattern.local_2d", _local_2d),
    "attn_dilated": Route("attention.pattern.dilated.segments", _pairs),
    # BigBird's block layout as Hugging Face computes it (attention/patterns/bigbird_blocks.py)
    "attn_bigbird_blocks": Route("attention.pattern.bigbird_blocks", _bigbird_blocks),
    # kernel attention (attention/kernels/linear.py): a recurrent decode state
    "attn_linear": Route("attention.kernel.linear.feature"),
    "attn_linear_chunk": Route("attention.kernel.linear.chunk"),
    "attn_performer": flag(attention__kernel__performer={}),
    "attn_performer_features": Route("attention.kernel.performer.features"),
    "attn_performer_kernel": Route("attention.kernel.performer.kernel"),
    "attn_performer_redraw": Route("attention.kernel.performer.redraw"),
    "attn_performer_orthogonal": Route("attention.kernel.performer.orthogonal"),
    "attn_performer_seed": Route("attention.kernel.performer.seed"),
    "attn_performer_chunk": Route("attention.kernel.performer.chunk"),
    "attn_rfa": flag(attention__kernel__rfa={}),
    "attn_rfa_features": Route("attention.kernel.rfa.features"),
    "attn_rfa_gate": Route("attention.kernel.rfa.gate"),
    "attn_rfa_seed": Route("attention.kernel.rfa.seed"),
    "attn_rfa_chunk": Route("attention.kernel.rfa.chunk"),
    # low-rank attention (attention/kernels/linformer.py, nystrom.py): bidirectional only
    "attn_linformer_k": Route("attention.kernel.linformer.k"),
    "attn_linformer_seq_len": Route("attention.kernel.linformer.seq_len"),
    "attn_linformer_share_kv": Route("attention.kernel.linformer.share_kv"),
    "attn_nystrom_landmarks": Route("attention.kernel.nystrom.landmarks"),
    "attn_nystrom_pinv_iters": Route("attention.kernel.nystrom.pinv_iters"),
    "attn_nystrom_pinv_init": Route("attention.kernel.nystrom.pinv_init"),
    "attn_nystrom_conv": Route("attention.kernel.nystrom.conv"),
    # Attention Free Transformer (attention/kernels/aft.py): keeps keys in a decode state
    "attn_aft": Route("attention.kernel.aft.mode"),
    "attn_aft_window": Route("attention.kernel.aft.window"),
    "attn_aft_max_len": Route("attention.kernel.aft.max_len"),
    # Sparse Sinkhorn attention (attention/kernels/sinkhorn.py): sorted key blocks, keeps keys
    "attn_sinkhorn": flag(attention__kernel__sinkhorn={}),
    "attn_sinkhorn_bucket_size": Route("attention.kernel.sinkhorn.bucket_size"),
    "attn_sinkhorn_iters": Route("attention.kernel.sinkhorn.iters"),
    "attn_sinkhorn_temperature": Route("attention.kernel.sinkhorn.temperature"),
    "attn_sinkhorn_sortcut": Route("attention.kernel.sinkhorn.sortcut"),
    # LSH attention, the Reformer's (attention/kernels/lsh.py): hashed buckets, keeps keys
    "attn_lsh": flag(attention__kernel__lsh={}),
    "attn_lsh_bucket_size": Route("attention.kernel.lsh.bucket_size"),
    "attn_lsh_n_hashes": Route("attention.kernel.lsh.n_hashes"),
    "attn_lsh_seed": Route("attention.kernel.lsh.seed"),
    "attn_lsh_n_buckets": Route("attention.kernel.lsh.n_buckets"),
    "attn_lsh_global_sort": Route("attention.kernel.lsh.global_sort"),
    "attn_shared_qk": Route("attention.kernel.lsh.shared_qk"),
    # Routing attention (attention/kernels/routing.py): k-means clusters, keeps keys; local heads take attn_window
    "attn_routing": flag(attention__kernel__routing={}),
    "attn_routing_clusters": Route("attention.kernel.routing.clusters"),
    "attn_routing_window": Route("attention.kernel.routing.window"),
    "attn_routing_heads": Route("attention.kernel.routing.heads"),
    "attn_routing_decay": Route("attention.kernel.routing.decay"),
    "attn_routing_commitment": Route("attention.kernel.routing.commitment"),
    # FNet (mixers/fnet.py): Fourier mixing instead of self-attention
    "attn_fnet": flag(mixer__fnet={}),
    # FLASH's gated attention unit (mixers/gau.py): attention and feedforward in one block
    "gau": flag(mixer__gau={}),
    "gau_chunk": Route("mixer.gau.chunk"),
    "gau_qk_dim": Route("mixer.gau.qk_dim"),
    "gau_expansion": Route("mixer.gau.expansion"),
    # feedforward
    "ff_mult": Route("ff.mult"),
    "ff_glu": Route("ff.glu"),
    "ff_relu_squared": flag(ff__activation="relu_squared"),
    "ff_swish": flag(ff__activation="swish"),
    "ff_gelu_tanh": flag(ff__activation="gelu_tanh"),
    "ff_dropout": Route("ff.dropout", float),
    "ff_no_bias": flag(ff__bias=False),
    # the Reformer's memory-lean stack (reversible.py; feedforward.py)
    "reversible": Route("reversible"),
    "ff_chunks": Route("ff.chunks"),
    # Hugging Face's Reformer (interop/reformer.py): its concatenated streams, its default ReLU
    "reversible_merge": Route("reversible_merge"),
    "ff_relu": flag(ff__activation="relu"),
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
CHOICE_STAGES = {"attention.pattern.": "pattern", "attention.kernel.": "kernel", "mixer.": "mixer"}


def _choices(stage: str, prefix: str, fields: dict[str, dict[str, Any]], keywords: dict[str, str]
             ) -> tuple[Choice, ...]:
    """The stage's choices, in the registry's order, from their options' fields. A choice missing a
    required option, or given options without the keyword that switches it on, names the keywords
    given and the keyword it needs."""
    import dataclasses

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


def _one(choices: tuple[Choice, ...], prefix: str, keywords: dict[str, str]) -> Choice:
    """The single choice of a stage that takes one (a kernel, a mixer): two are refused by name."""
    if len(choices) > 1:
        named = [sorted({k for p, k in keywords.items() if p.startswith(f"{prefix}{c.name}")})[0] for c in choices]
        raise ValueError(f"{' and '.join(named)} conflict: each chooses how attention is computed; choose one")
    return choices[0]


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
            groups[head][tail] = value
        else:
            groups[""][head] = value
    made = {prefix: _choices(stage, prefix, chosen[prefix], keywords)
            for prefix, stage in CHOICE_STAGES.items() if chosen[prefix]}
    if "attention.pattern." in made:
        groups["attention"]["pattern"] = made["attention.pattern."]
    if "attention.kernel." in made:
        groups["attention"]["kernel"] = _one(made["attention.kernel."], "attention.kernel.", keywords)
    if "mixer." in made:
        groups[""]["mixer"] = _one(made["mixer."], "mixer.", keywords)
    return LayersConfig(
        attention=AttentionConfig(**groups["attention"]),
        ff=FeedForwardConfig(**groups["ff"]),
        **groups[""],
    )


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
