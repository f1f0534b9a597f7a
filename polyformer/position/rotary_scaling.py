"""Rotary scalings that stretch a model's context: YaRN (arXiv:2309.00071), dynamic NTK scaling (bloc97 and
emozilla, 2023; the base grows with the current length) and LongRoPE (arXiv:2402.13753: per-pair factors, a short
set and a long one chosen by the current length). Each is an options dataclass (what `rotary_yarn`,
`rotary_dynamic_ntk`, `rotary_longrope` write into `AttentionConfig.rotary_scaling`) and a module that gives
the inverse frequencies, from the unscaled ones w_i = base^(-2i/r), and the attention factor m by which
queries and keys are both multiplied (q.k by m^2: YaRN's temperature sqrt(1/t) = m).

Dynamic NTK and LongRoPE follow the length n = max position + 1 of the current forward, as Hugging Face does,
so every position of an uncached forward depends on n. Under a decode state we keep Hugging Face's convention
(and so equal its `generate`): a cached key keeps the rotation of the step that computed it. Cached steps equal
the uncached forward while n <= original_max_len, where the frequencies do not change; past it they differ.
Re-rotating the cached keys would not make them equal: from the second layer on, the cached keys were computed
from hidden states of the shorter lengths. YaRN is static, so exact under the decode state."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor, nn

from .. import checks

if TYPE_CHECKING:
    from ..config import LayersConfig


@dataclass(frozen=True)
class YarnOptions:
    factor: float                       # s: the context is stretched s times
    original_max_len: int               # L: the context the model was trained on
    beta_fast: float = 32.0             # pairs turning more than beta_fast times in L keep their frequency
    beta_slow: float = 1.0              # pairs turning less than beta_slow times in L are interpolated (w / s)
    attention_factor: float | None = None   # m; None: 0.1 ln(s) + 1
    truncate: bool = True               # round the ramp's ends to whole pairs (the authors' code, Hugging Face)


@dataclass(frozen=True)
class DynamicNtkOptions:
    factor: float                       # s
    original_max_len: int               # L: below it the frequencies are the unscaled ones


@dataclass(frozen=True)
class LongRopeOptions:
    short_factor: tuple[float, ...]     # per pair: w_i / short_factor[i] while n <= original_max_len
    long_factor: tuple[float, ...]      # per pair: w_i / long_factor[i] beyond it
    original_max_len: int
    factor: float = 1.0                 # the context extension s, for the default attention factor
    attention_factor: float | None = None   # m; None: sqrt(1 + ln(s) / ln(L)) (1 when s <= 1)


class RotaryScaling(nn.Module):
    """A scaling: `forward(length)` gives the inverse frequencies (r/2,) in float32 for a forward whose positions
    reach length - 1 (None: no length, the unstretched ones); `attention_factor` m multiplies q and k;
    `follows_length` says whether the frequencies depend on the length; `check` names its out-of-range options."""

    options: type
    keyword: str
    follows_length = False
    attention_factor = 1.0

    @staticmethod
    def check(o: object, pairs: int) -> list[str]:
        """This scaling's own out-of-range options (`pairs`: r / 2 rotated pairs), each named after `keyword`."""
        return []

    def forward(self, length: Tensor | None) -> Tensor:
        raise NotImplementedError


def _stretch(kw: str, factor: object) -> list[str]:
    return [] if checks.number(factor) and factor >= 1 else [f"{kw} needs factor >= 1, got {factor!r}"]


def yarn_frequencies(r: int, base: float, o: YarnOptions) -> Tensor:
    """The r/2 frequencies of NTK-by-parts, float32: w_i = base^(-2i/r) kept where pair i turns more than
    beta_fast times in L, w_i / s where it turns fewer than beta_slow times, a linear ramp over the pair index
    between (the YaRN authors' code; the paper writes the ramp over the turn count L / wavelength, with the
    same ends)."""

    def pair_turning(turns: float) -> float:      # the (fractional) pair index whose wavelength is L / turns
        return r * math.log(o.original_max_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(o.beta_fast), pair_turning(o.beta_slow)
    if o.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    w_inverse = base ** (torch.arange(0, r, 2).float() / r)      # 1 / w_i in float32, in Hugging Face's order
    return 1 / w_inverse * (1 - ramp) + 1 / (o.factor * w_inverse) * ramp


def yarn_attention_factor(o: YarnOptions) -> float:
    if o.attention_factor is not None:
        return float(o.attention_factor)
    return 0.1 * math.log(o.factor) + 1.0 if o.factor > 1 else 1.0


class Yarn(RotaryScaling):
    """YaRN: static frequencies and temperature, so exact under the decode state as plain rotary is."""

    options = YarnOptions
    keyword = "rotary_yarn"

    def __init__(self, inv_freq: Tensor, base: float, o: YarnOptions):
        super().__init__()
        self.register_buffer("inv_freq", yarn_frequencies(2 * inv_freq.shape[-1], base, o), persistent=False)
        self.attention_factor = yarn_attention_factor(o)

    @staticmethod
    def check(o: YarnOptions, pairs: int) -> list[str]:
        kw, found = Yarn.keyword, _stretch(Yarn.keyword, o.factor)
        if not (checks.number(o.beta_fast) and checks.number(o.beta_slow) and o.beta_fast > o.beta_slow > 0):
            found.append(f"{kw} needs beta_fast > beta_slow > 0, got {o.beta_fast!r} and {o.beta_slow!r}")
        found += checks.flag(o.truncate, f"{kw} truncate")
        return found

    def forward(self, length: Tensor | None) -> Tensor:
        return self.inv_freq


class DynamicNtk(RotaryScaling):
    """Dynamic NTK: w'_i = base'^(-2i/r), base' = base * (s n / L - (s - 1))^(r / (r - 2)) with n = max(length, L),
    in float32 in Hugging Face's order of operations (a float64 base' shifts long-context logits by ~1e-5)."""

    options = DynamicNtkOptions
    keyword = "rotary_dynamic_ntk"
    follows_length = True

    def __init__(self, inv_freq: Tensor, base: float, o: DynamicNtkOptions):
        super().__init__()
        r = 2 * inv_freq.shape[-1]
        self.factor, self.original, self.base, self.power = float(o.factor), int(o.original_max_len), base, r / (r - 2)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("exponents", torch.arange(0, r, 2).float() / r, persistent=False)

    @staticmethod
    def check(o: DynamicNtkOptions, pairs: int) -> list[str]:
        kw, found = DynamicNtk.keyword, _stretch(DynamicNtk.keyword, o.factor)
        if pairs < 2:
            found.append(f"{kw} rescales the base by an exponent r / (r - 2): it needs a rotary dimension r >= 4")
        return found

    def forward(self, length: Tensor | None) -> Tensor:
        if length is None:
            return self.inv_freq
        n = length.clamp(min=self.original)
        base = self.base * (self.factor * n / self.original - (self.factor - 1)) ** self.power
        return 1.0 / base ** self.exponents


def longrope_attention_factor(o: LongRopeOptions) -> float:
    if o.attention_factor is not None:
        return float(o.attention_factor)
    s, n = float(o.factor), o.original_max_len
    return math.sqrt(1 + math.log(s) / math.log(n)) if s > 1 and n > 1 else 1.0


class LongRope(RotaryScaling):
    """LongRoPE: w_i / short_factor[i] up to L, w_i / long_factor[i] beyond (by the current length)."""

    options = LongRopeOptions
    keyword = "rotary_longrope"
    follows_length = True

    def __init__(self, inv_freq: Tensor, base: float, o: LongRopeOptions):
        super().__init__()
        self.original = int(o.original_max_len)
        short, long = (torch.tensor(f, dtype=torch.float64) for f in (o.short_factor, o.long_factor))
        self.register_buffer("short", (inv_freq / short).float(), persistent=False)
        self.register_buffer("long", (inv_freq / long).float(), persistent=False)
        self.attention_factor = longrope_attention_factor(o)

    @staticmethod
    def check(o: LongRopeOptions, pairs: int) -> list[str]:
        kw, found = LongRope.keyword, []
        for name in ("short_factor", "long_factor"):
            given = getattr(o, name)
            if len(given) != pairs or not all(checks.number(f) and f > 0 for f in given):
                found.append(f"{kw} {name} needs {pairs} positive numbers (one per rotated pair), got {given!r}")
        if not (checks.number(o.factor) and o.factor > 0):
            found.append(f"{kw} factor must be a positive number, got {o.factor!r}")
        return found

    def forward(self, length: Tensor | None) -> Tensor:
        if length is None:
            return self.short
        return torch.where(length > self.original, self.long, self.short)


@dataclass(frozen=True)
class NtkOptions:
    factor: float                       # s: the base becomes base * s^(r / (r - 2))


class StaticNtk(RotaryScaling):
    """NTK-aware scaling with a fixed factor (bloc97, 2023; x-transformers' rotary_base_rescale_factor): base' =
    base * s^(r / (r - 2)), so w'_i = w_i * s^(-2i / (r - 2)); static, so exact under the decode state. It may
    join position interpolation (rotary_interpolation_factor), as x-transformers allows."""

    options = NtkOptions
    keyword = "rotary_base_rescale_factor"

    def __init__(self, inv_freq: Tensor, base: float, o: NtkOptions):
        super().__init__()
        r = 2 * inv_freq.shape[-1]
        exponents = torch.arange(0, r, 2, dtype=torch.float64) / max(r - 2, 1)
        self.register_buffer("inv_freq", (inv_freq * float(o.factor) ** -exponents).float(), persistent=False)

    @staticmethod
    def check(o: NtkOptions, pairs: int) -> list[str]:
        found = [] if checks.number(o.factor) and o.factor > 0 else [
            f"{StaticNtk.keyword} must be a positive number, got {o.factor!r}"]
        if pairs < 2:
            found.append(f"{StaticNtk.keyword} rescales the base by an exponent r / (r - 2): it needs a rotary "
                         "dimension r >= 4")
        return found

    def forward(self, length: Tensor | None) -> Tensor:
        return self.inv_freq


def ntk_keyword(arg: object) -> object:
    """rotary_base_rescale_factor=s -> `Choice("rotary_scaling", "ntk", NtkOptions(s))`."""
    from ..config import Choice

    if not checks.number(arg):
        raise TypeError(f"expected a positive number, got {arg!r}")
    return Choice("rotary_scaling", "ntk", NtkOptions(float(arg)))


SCALINGS: dict[str, type[RotaryScaling]] = {"yarn": Yarn, "dynamic": DynamicNtk, "longrope": LongRope,
                                            "ntk": StaticNtk}


def _keyword(name: str) -> Callable[[object], object]:
    """The converter of a scaling keyword: None (off), a dict of its options' fields, or (yarn, dynamic NTK) the
    pair (factor, original_max_len) -> `Choice("rotary_scaling", name, options)`."""
    cls = SCALINGS[name].options
    fields = list(cls.__dataclass_fields__)
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]

    def convert(arg: object) -> object:
        from ..config import Choice

        if arg is None:
            return None
        if isinstance(arg, (tuple, list)) and len(arg) == 2 and required == ["factor", "original_max_len"]:
            arg = dict(zip(required, arg))
        if not isinstance(arg, dict) or not set(required) <= set(arg) <= set(fields):
            pair = "(factor, original_max_len) or " if len(required) == 2 else ""
            raise TypeError(f"expected {pair}a dict with the keys {required} and optionally "
                            f"{[f for f in fields if f not in required]}, got {arg!r}")
        values = {k: tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else v for k, v in arg.items()}
        return Choice("rotary_scaling", name, cls(**values))

    return convert


yarn_keyword, dynamic_ntk_keyword, longrope_keyword = _keyword("yarn"), _keyword("dynamic"), _keyword("longrope")


def _option_problems(scaling: type[RotaryScaling], o: object, pairs: int) -> list[str]:
    """The out-of-range options of one scaling, naming its keyword: those every scaling has, then its own."""
    kw = scaling.keyword
    found = checks.whole(o.original_max_len, f"{kw} original_max_len") if hasattr(o, "original_max_len") else []
    m = getattr(o, "attention_factor", None)
    if m is not None and not (checks.number(m) and m > 0):
        found.append(f"{kw} attention_factor must be a positive number or None, got {m!r}")
    return found + scaling.check(o, pairs)


def problems(cfg: "LayersConfig") -> list[str]:
    """What a rotary scaling cannot do in this stack, naming its keyword."""
    found: list[str] = []
    for a in cfg.self_attention:
        if a.rotary_scaling is None:
            continue
        scaling = SCALINGS[a.rotary_scaling.name]
        kw = scaling.keyword
        if a.position != "rotary":
            found.append(f"{kw} scales rotary positions but rotary_pos_emb is not True")
        if (a.rotary_interpolation != 1.0 and scaling is not StaticNtk) or a.rotary_llama3 is not None:
            found.append(f"{kw} and rotary_interpolation_factor / rotary_llama3_scaling are two rotary scalings; "
                         "choose one")
        if cfg.mixer is not None:
            found.append(f"{kw} scales the rotary of attention blocks; a mixer (attn_fnet, gau) does not take it")
        r = a.rotary_dim or a.dim_head - a.dim_head % 2
        found += _option_problems(scaling, a.rotary_scaling.options, r // 2)
    return found
