"""Generate docs/compatibility.md: which options combine, and which keep the fused attention path.

The matrix is computed, not written by hand: every on/off option of the keyword table
(`polyformer.keywords.KEYWORDS`: the flags, the boolean fields, and a representative "on" value
for the few numeric switches) and of `TransformerWrapper` is built alone and in every pair. A pair
is refused when building raises (the message comes from `polyformer.rules.RULES`, the keyword
table or the wrapper); an accepted build takes the fused `scaled_dot_product_attention` path
unless `polyformer.rules.needs_explicit_path` or the kernel's declared `caps` say otherwise.

    python scripts/compat_matrix.py            # rewrite docs/compatibility.md
    python scripts/compat_matrix.py --check    # exit 1 when the file is out of date
"""

from __future__ import annotations

import argparse
import inspect
import sys
import typing
from pathlib import Path
from typing import Any

from polyformer import AttentionLayers, LayersConfig, TransformerWrapper
from polyformer.config import stack_options
from polyformer.keywords import KEYWORDS
from polyformer.registry import KERNEL
from polyformer.rules import RULES, needs_explicit_path

OUT = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"

# numeric switches, at a value that turns the option on (every other numeric keyword is a size)
SWITCHES: dict[str, Any] = {
    "pre_norm": False, "attn_kv_heads": 2, "attn_num_mem_kv": 2, "attn_sparse_topk": 2, "shift_tokens": 1,
    "sandwich_coef": 1, "custom_layers": ("a", "f", "a", "f"), "rotary_emb_dim": 4, "alibi_num_heads": 1,
    # attention patterns that stand alone (the others need a companion keyword: see tests/attention/patterns)
    "attn_window": 4, "attn_blockwise": 2, "attn_block_local": (4, 2), "attn_dilated": ((4, 1), (8, 2)),
    # attention kernels chosen by a value (the others are flags)
    "attn_linear": "elu",
    # a relative scheme chosen by a value (position/shaw.py)
    "rel_pos_shaw": 2,
}
# `TransformerWrapper` keywords that switch a feature on
WRAPPER_SWITCHES: dict[str, Any] = {
    "use_abs_pos_emb": True, "scaled_sinu_pos_emb": True, "num_memory_tokens": 2, "max_mem_len": 4,
    "shift_mem_down": 1, "max_cmem_len": 2, "tie_embedding": True, "logits_bias": False, "post_emb_norm": True,
    "embed_num_tokens": {"token_type": 2},
}
# boolean keywords whose False is an option too, not just the default
BOTH_VALUES = ("attn_flash",)
# the stack every cell is built on: small, two layers, bidirectional unless `causal` is drawn
BASE = dict(dim=16, depth=2, heads=2, attn_dim_head=8)


def _field_type(path: str) -> Any:
    if path.startswith(("attention.pattern.", "attention.kernel.", "mixer.", "attention.relative.",
                        *(f"{piece}." for piece in stack_options()))):
        return None                 # a variant's option: a switch only when listed above
    cls: Any = LayersConfig
    *heads, last = path.split(".")
    for name in heads:
        cls = typing.get_type_hints(cls)[name]
    return typing.get_type_hints(cls)[last]


def _aliases() -> dict[str, str]:
    """Later spellings of the same option (identical route): alias -> first spelling."""
    seen: dict[Any, str] = {}
    aliases = {}
    for name, route in KEYWORDS.items():
        key = (route.path, route.convert, repr(sorted((route.when_true or {}).items())))
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
    return aliases


def options() -> list[tuple[str, Any]]:
    """(keyword, value) for every on/off option: flags, boolean fields, switches, wrapper switches."""
    aliases = _aliases()
    found: list[tuple[str, Any]] = []
    for name, route in KEYWORDS.items():
        if name in aliases or name in BASE:
            continue
        if route.when_true is not None:
            found.append((name, True))
        elif name in SWITCHES:
            found.append((name, SWITCHES[name]))
        elif _field_type(route.path) in (bool, bool | None):
            found.append((name, True))
            if name in BOTH_VALUES:
                found.append((name, False))
    params = inspect.signature(TransformerWrapper.__init__).parameters
    found += [(name, value) for name, value in WRAPPER_SWITCHES.items() if name in params]
    return found


def label(option: tuple[str, Any]) -> str:
    name, value = option
    if value is True and name not in BOTH_VALUES:
        return name
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return f"{name}={''.join(value)}"
    if isinstance(value, tuple):
        return f"{name}={str(value).replace(' ', '')}"
    return f"{name}={value}"


def attempt(chosen: list[tuple[str, Any]]) -> tuple[str, str]:
    """("ok" | "ref" | "refused", detail) for building these options together."""
    layers = {k: v for k, v in chosen if k in KEYWORDS}
    wrap = {k: v for k, v in chosen if k not in KEYWORDS}
    try:
        stack = AttentionLayers(**BASE, **layers)
        TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=stack, **wrap)
    except (ValueError, TypeError) as err:
        return "refused", str(err)
    return fast_path(stack.cfg)


def fast_path(cfg: LayersConfig) -> tuple[str, str]:
    reasons = list(needs_explicit_path(cfg))
    if cfg.attention.fused is False:
        reasons.append("attn_flash=False")
    if cfg.mixer is not None:
        reasons.append(f"mixer {cfg.mixer.name!r} replaces attention")
    elif not KERNEL[cfg.attention.kernel.name].caps.fused:
        reasons.append(f"kernel {cfg.attention.kernel.name!r} has no fused path")
    return ("ref", ", ".join(reasons)) if reasons else ("ok", "")


def matrix() -> tuple[list[tuple[str, Any]], dict[tuple[int, int], tuple[str, str]]]:
    opts = options()
    cells = {}
    for i, a in enumerate(opts):
        for j in range(i, len(opts)):
            b = opts[j]
            if i == j:
                cells[i, j] = attempt([a])
            elif a[0] == b[0]:
                cells[i, j] = ("same", "")
            else:
                cells[i, j] = attempt([a, b])
            cells[j, i] = cells[i, j]
    return opts, cells


def render(computed: tuple[list, dict] | None = None) -> str:
    """The markdown text; `computed` is a `matrix()` result to reuse."""
    opts, cells = computed if computed is not None else matrix()
    alone_refused = {i for i in range(len(opts)) if cells[i, i][0] == "refused"}
    refusals: dict[str, int] = {}
    pairs: list[tuple[str, str, str]] = []
    for i in range(len(opts)):
        for j in range(i + 1, len(opts)):
            kind, detail = cells[i, j]
            if kind == "refused" and i not in alone_refused and j not in alone_refused:
                if detail not in refusals:
                    refusals[detail] = len(refusals) + 1
                pairs.append((label(opts[i]), label(opts[j]), detail))

    def cell(i: int, j: int) -> str:
        kind, detail = cells[i, j]
        if i == j:
            return {"ok": "F", "ref": "R", "refused": "n"}[kind]
        if kind == "same":
            return "-"
        if kind == "refused":
            return "-" if i in alone_refused or j in alone_refused else f"✗{refusals[detail]}"
        return "·" if kind == "ok" else "r"

    lines = [
        "# Compatibility matrix",
        "",
        "Generated by `python scripts/compat_matrix.py` from the rules table (`polyformer/rules.py`),",
        "the keyword table (`polyformer/keywords.py`), the `TransformerWrapper` keywords and the kernels'",
        "declared capabilities (`polyformer/registry.py`); do not edit by hand. `tests/test_compat_matrix.py`",
        "checks that it is up to date.",
        "",
        "Each option below was built alone and with every other one, on",
        f"`TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=AttentionLayers({', '.join(f'{k}={v}' for k, v in BASE.items())}, ...))`.",
        "Options that are sizes (dim, heads, dropouts, buckets, ...) combine with everything and are left out;",
        "later spellings (" + ", ".join(f"`{a}` = `{b}`" for a, b in _aliases().items()) + ") behave as the first.",
        "",
        "## Attention kernels",
        "",
        "| kernel | exact | score bias | fused SDPA path |",
        "|---|---|---|---|",
    ]
    for name, cls in sorted(KERNEL.items()):
        caps = cls.caps
        lines.append(f"| `{name}` | {'yes' if caps.exact else 'no'} | {'yes' if caps.bias else 'no'} | "
                     f"{'yes' if caps.fused else 'no'} |")
    fused = [label(o) for i, o in enumerate(opts) if cells[i, i][0] == "ok"]
    explicit = [(label(o), cells[i, i][1]) for i, o in enumerate(opts) if cells[i, i][0] == "ref"]
    lines += [
        "",
        "## The fused attention path",
        "",
        "The dense kernel runs on `torch.nn.functional.scaled_dot_product_attention` (biases and masks folded",
        "into one additive mask) unless an option needs the explicit reference path. At run time",
        "`return_attn=True` also takes the reference path (it returns the weights).",
        "",
        "Keep the fused path: " + ", ".join(f"`{o}`" for o in fused) + ".",
        "",
        "Need the reference path:",
        "",
    ]
    lines += [f"- `{o}` ({reason})" for o, reason in explicit]
    lines += [
        "",
        "## Pairs",
        "",
        "Diagonal: `F` builds alone on the fused path, `R` builds alone on the reference path, `n` is refused",
        "alone (it needs another option: see its row). Elsewhere: `·` builds on the fused path, `r` builds on",
        "the reference path, `✗k` is refused with message k below, `-` is not a pair (the same keyword, or an",
        "option that is refused alone and the other one does not supply what it needs).",
        "",
        "| # | option | " + " | ".join(str(i + 1) for i in range(len(opts))) + " |",
        "|---|---|" + "---|" * len(opts),
    ]
    for i, o in enumerate(opts):
        lines.append(f"| {i + 1} | `{label(o)}` | " + " | ".join(cell(i, j) for j in range(len(opts))) + " |")
    lines += ["", "### Options refused alone", ""]
    for i in sorted(alone_refused):
        lines.append(f"- `{label(opts[i])}`: {cells[i, i][1]}")
    lines += ["", "### Refused pairs", ""]
    by_message: dict[str, list[str]] = {}
    for a, b, detail in pairs:
        by_message.setdefault(detail, []).append(f"`{a}` + `{b}`")
    for detail, k in refusals.items():
        lines.append(f"{k}. {detail} — " + ", ".join(by_message[detail]))
    lines += ["", "## Every rule", "",
              f"The {len(RULES)} rows of `polyformer.rules.RULES`, checked in this order when a stack is built",
              "(`{...}` is filled from the config); two keywords writing one config field differently are refused",
              "by the keyword table itself, naming both.", ""]
    lines += [f"- {rule.message}" for rule in RULES]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/compatibility.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date: run python scripts/compat_matrix.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
