"""What is wrong with a kernel or mixer choice, read from its declared caps, naming the keywords."""

from __future__ import annotations

from collections.abc import Iterable

from ...config import BIAS_KEYWORD, LayersConfig
from ..hard_attention import keyword as normalizer_keyword


def switch(prefix: str, name: str) -> str:
    """The public keyword that chooses variant `name` of a choice stage ("attention.kernel.",
    "mixer."): the keyword table's first row writing under `<prefix><name>`."""
    from ...keywords import writing

    return writing(f"{prefix}{name}", below=True)[0]


def changed(section: str, given: object, fields: Iterable[str]) -> list[str]:
    """The public keywords that set `fields` of a config section ("attention", "ff": `given`, a
    dataclass) away from their defaults, sorted: what a mixer has no use for and would ignore."""
    from ...keywords import writing

    default = type(given)()
    return sorted({k for f in fields if getattr(given, f) != getattr(default, f) for k in writing(f"{section}.{f}")})


def problems(cfg: LayersConfig) -> list[str]:
    """What a kernel or mixer cannot combine with, read from its declared caps; then its own check."""
    from ...registry import KERNEL, MIXER
    from ..patterns import keyword as pattern_keyword

    found = []
    a = cfg.attention
    if cfg.mixer is not None and a.kernel.name != "dense":
        found.append(f"{switch('mixer.', cfg.mixer.name)} and {switch('attention.kernel.', a.kernel.name)} "
                     "conflict: each replaces attention; choose one")
    for prefix, choice, table in (("attention.kernel.", a.kernel, KERNEL), ("mixer.", cfg.mixer, MIXER)):
        if choice is None or choice.name == "dense":
            continue
        entry = table[choice.name]
        caps, name = entry.caps, switch(prefix, choice.name)
        if cfg.causal and not caps.causal:
            found.append(f"{name} lets every position see later ones: it cannot be causal (causal=True, a "
                         "Decoder); use it on an Encoder")
        if not cfg.causal and not caps.bidirectional:
            found.append(f"{name} needs a causal stack (a Decoder)")
        if a.bias != "none" and not caps.bias:
            found.append(f"{name} cannot take the stack's score bias "
                         f"({BIAS_KEYWORD[a.bias]})")
        if a.normalize != "softmax":
            other = normalizer_keyword(a.normalize)
            found.append(f"{name} replaces the softmax; {other} cannot combine with it")
        for flag, on in (("attn_talking_heads", a.talking_heads), ("residual_attn", cfg.residual_attn)):
            if on:
                found.append(f"{name} keeps no attention scores to share: {flag} needs them")
        foreign = [c for c in a.pattern if c.name not in caps.patterns]    # pieces it does not apply itself
        if foreign:
            named = " / ".join(dict.fromkeys(pattern_keyword(c.name) for c in foreign))
            found.append(f"{name} cannot combine with a sparse attention pattern ({named})")
        if a.fused is True:
            found.append(f"attn_flash=True asks for the fused dense kernel; {name} computes attention its own way")
        check = getattr(entry.build, "check", None)
        if check is not None:
            found += check(choice.options, cfg)
    return found
