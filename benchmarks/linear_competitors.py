"""The contenders of `benchmarks/linear_attention.py`: polyformer's linear-time mixers (one attention block
each), our dense attention, and the PyPI packages users would pick instead at the same settings, each a
`sparse_competitors.Contender` whose `call(x)` maps (batch, n, 512) float32 to the same shape.

- polyformer: `Decoder` / `Encoder(dim=512, depth=1, heads=8, custom_layers=("a",), <keywords>)`: pre-norm,
  bias-free q/k/v and output projections, the mixer, residual, the stack's final norm. A mixer still being
  written by a colleague is used when `polyformer.registry` lists it and its keywords exist, and skipped
  with a note otherwise. GAU is attention and feedforward in one unit and refuses custom_layers: it runs as
  `Decoder(depth=1, gau=True, ...)`, one unit.
- The packages' attention modules carry their own projections; `PackageLayer` adds what polyformer's block
  has around them (pre-LayerNorm, residual, final LayerNorm). FLASH-pytorch's `FLASH` has its own pre-norm
  and residual, so it only gets the final LayerNorm.

Dropout is 0 everywhere, so train and eval mode compute the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .common import version
from .sparse_competitors import DIM, DIM_HEAD, HEADS, Contender, polyformer

FEATURES = int(DIM_HEAD * math.log(DIM_HEAD))   # 266: Performer's d ln d, both libraries' default
RFA_FEATURES = DIM_HEAD                          # RFA's D (2D features), polyformer's default
LINFORMER_K = 256                                # linformer's default k
LANDMARKS = 256                                  # nystrom-attention's default num_landmarks
PINV_ITERS = 6
GAU_CHUNK = 256                                  # FLASH-pytorch's default group_size
GAU_QK, GAU_EXPANSION = 128, 2                   # FLASH-pytorch's query_key_dim and expansion_factor


# --- polyformer -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ours:
    """One polyformer mixer: the registry entry it needs (stage "kernel" or "mixer", and the names it
    may have there) and its keywords at length n."""

    name: str
    stage: str
    registry_names: tuple[str, ...]
    keywords: Callable[[int], dict[str, Any]]
    paper: str
    layer_only: bool = True          # custom_layers=("a",); False: a unit that is its own feedforward (GAU)

    def entry(self) -> Any:
        """Its registry entry, or None while it has not landed (no entry or no keyword)."""
        from polyformer import registry
        from polyformer.keywords import KEYWORDS

        if not all(k in KEYWORDS for k in self.keywords(1024)):
            return None
        table = registry.KERNEL if self.stage == "kernel" else registry.MIXER
        return next((table[n] for n in self.registry_names if n in table), None)

    def causal(self) -> bool:
        """Run in a Decoder where the mixer can (causal LM use), else in an Encoder."""
        caps = self.entry().caps
        return caps is None or caps.causal

    def contender(self, n: int, causal: bool | None = None) -> Contender:
        causal = self.causal() if causal is None else causal
        kw = self.keywords(n)
        shape = "custom_layers=('a',)" if self.layer_only else "depth=1"
        shown = ", ".join([shape, *(f"{k}={v!r}" for k, v in kw.items())])
        return polyformer(f"polyformer {self.name}", causal, layer_only=self.layer_only,
                          note=f"{'Decoder' if causal else 'Encoder'}({shown})", **kw)


MIXERS: tuple[Ours, ...] = (
    Ours("linear", "kernel", ("linear",), lambda n: {"attn_linear": "elu"}, "arXiv:2006.16236"),
    Ours("performer", "kernel", ("performer",),
         lambda n: {"attn_performer": True, "attn_performer_features": FEATURES}, "arXiv:2009.14794"),
    Ours("rfa", "kernel", ("rfa",), lambda n: {"attn_rfa": True, "attn_rfa_features": RFA_FEATURES},
         "arXiv:2103.02143"),
    Ours("rfa gate", "kernel", ("rfa",),
         lambda n: {"attn_rfa": True, "attn_rfa_features": RFA_FEATURES, "attn_rfa_gate": True}, "arXiv:2103.02143"),
    Ours("linformer", "kernel", ("linformer",),
         lambda n: {"attn_linformer_k": LINFORMER_K, "attn_linformer_seq_len": n}, "arXiv:2006.04768"),
    Ours("nystrom", "kernel", ("nystrom",),
         lambda n: {"attn_nystrom_landmarks": LANDMARKS, "attn_nystrom_pinv_iters": PINV_ITERS}, "arXiv:2102.03902"),
    Ours("aft simple", "kernel", ("aft",), lambda n: {"attn_aft": "simple"}, "arXiv:2105.14103"),
    Ours("fnet", "mixer", ("fnet",), lambda n: {"attn_fnet": True}, "arXiv:2105.03824"),
    Ours("gau", "mixer", ("gau",), lambda n: {"gau": True, "gau_chunk": GAU_CHUNK, "gau_qk_dim": GAU_QK,
                                             "gau_expansion": GAU_EXPANSION}, "arXiv:2202.10447", layer_only=False),
)
BY_NAME = {m.name: m for m in MIXERS}


def dense(causal: bool) -> Contender:
    return polyformer(f"polyformer dense {'causal' if causal else 'bidirectional'}", causal,
                      note=f"{'Decoder' if causal else 'Encoder'}(custom_layers=('a',)), fused dense attention")


def available(names: list[str] | None = None) -> tuple[list[Ours], dict[str, str]]:
    """The mixers that have landed, and a note for each that has not (or does not build)."""
    ready, missing = [], {}
    for m in MIXERS:
        if names is not None and m.name not in names:
            continue
        try:
            entry = m.entry()
        except Exception as err:                 # a half-written module that does not import yet
            entry, why = None, f"{type(err).__name__}: {err}"[:200]
        else:
            why = (f"not in polyformer.registry.{m.stage.upper()} (or its keywords "
                   f"{', '.join(m.keywords(1024))} not in keywords.KEYWORDS) yet")
        if entry is None:
            missing[m.name] = why
        else:
            ready.append(m)
    return ready, missing


# --- the packages ---------------------------------------------------------------------------------

class PackageLayer(nn.Module):
    """A package's attention module (with its own projections) in the layer polyformer's block is:
    pre-LayerNorm, the module, residual, final LayerNorm."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.norm, self.attn, self.final_norm = nn.LayerNorm(DIM), attn, nn.LayerNorm(DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.final_norm(x + self.attn(self.norm(x)))


class FinalNorm(nn.Module):
    """A module that has its pre-norm and residual already, followed by the stack's final LayerNorm."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.final_norm = inner, nn.LayerNorm(DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.final_norm(self.inner(x))


def _performer(causal: bool, n: int) -> nn.Module:
    from performer_pytorch import SelfAttention

    return PackageLayer(SelfAttention(dim=DIM, causal=causal, heads=HEADS, dim_head=DIM_HEAD, nb_features=FEATURES,
                                      qkv_bias=False, attn_out_bias=False))


def _linformer(causal: bool, n: int) -> nn.Module:
    from linformer import LinformerSelfAttention

    return PackageLayer(LinformerSelfAttention(dim=DIM, seq_len=n, k=LINFORMER_K, heads=HEADS, dim_head=DIM_HEAD))


def _nystrom(causal: bool, n: int) -> nn.Module:
    from nystrom_attention import NystromAttention

    return PackageLayer(NystromAttention(dim=DIM, dim_head=DIM_HEAD, heads=HEADS, num_landmarks=LANDMARKS,
                                         pinv_iterations=PINV_ITERS, residual=False))


def _linear(causal: bool, n: int) -> nn.Module:
    from linear_attention_transformer.linear_attention_transformer import SelfAttention

    return PackageLayer(SelfAttention(DIM, HEADS, causal=causal, dim_head=DIM_HEAD))


def _flash(causal: bool, n: int) -> nn.Module:
    from flash_pytorch import FLASH

    return FinalNorm(FLASH(dim=DIM, group_size=GAU_CHUNK, query_key_dim=GAU_QK, expansion_factor=GAU_EXPANSION,
                           causal=causal))


@dataclass(frozen=True)
class Versus:
    """One comparison: our mixer (by name) against a package's layer, in one direction."""

    ours: str
    causal: bool
    package: str                   # the pip name
    label: str
    build: Callable[[bool, int], nn.Module]
    note: str


VERSUS: dict[str, Versus] = {
    "performer": Versus("performer", False, "performer-pytorch", "performer-pytorch SelfAttention", _performer,
                        f"Both FAVOR+ with {FEATURES} positive orthogonal features per head, features never redrawn, "
                        "bias-free projections; its non-causal path."),
    "performer-causal": Versus("performer", True, "performer-pytorch", "performer-pytorch SelfAttention(causal)",
                               _performer,
                               f"As above, causal. Without the fast-transformers CUDA extension (none on CPU) "
                               "performer-pytorch runs `causal_linear_attention_noncuda`: 128 chunks, each keeping "
                               f"its (chunk, {FEATURES}, 64) running sums of φ(k) vᵀ for the backward."),
    "linformer": Versus("linformer", False, "linformer", "linformer LinformerSelfAttention", _linformer,
                        f"k={LINFORMER_K}, seq_len = n on both sides (E, F of shape (n, k), shared by the heads, not "
                        "between keys and values). linformer's output projection has a bias, ours none."),
    "nystrom": Versus("nystrom", False, "nystrom-attention", "nystrom-attention NystromAttention", _nystrom,
                      f"{LANDMARKS} landmarks (segment means), {PINV_ITERS} pseudo-inverse iterations, no residual "
                      "convolution on either side (residual=False; attn_nystrom_conv=0). Batch 1, so its "
                      "batch-wide pinv initialisation equals ours per row. Its output projection has a bias."),
    "linear-causal": Versus("linear", True, "linear-attention-transformer",
                            "linear-attention-transformer SelfAttention(causal)", _linear,
                            "Same algorithm class, different feature map: theirs softmax(q) over features and "
                            "exp(k), ours elu + 1 on both (attn_linear='elu'). Its default blindspot_size=1 (exact "
                            "causality: a bucket of 1) materialises the running sum Σ φ(k) vᵀ at every position, "
                            "(n, 64, 64) per head. Its output projection has a bias."),
    "flash": Versus("gau", True, "FLASH-pytorch", "FLASH-pytorch FLASH(causal)", _flash,
                    f"FLASH's mixed chunk attention (attention and feedforward in one unit: polyformer "
                    f"`Decoder(depth=1, gau=True, gau_chunk={GAU_CHUNK}, gau_qk_dim={GAU_QK}, "
                    f"gau_expansion={GAU_EXPANSION})`), FLASH(group_size={GAU_CHUNK}, query_key_dim={GAU_QK}, "
                    f"expansion_factor={GAU_EXPANSION}), causal, no rotary on either side. FLASH-pytorch adds a T5 "
                    "relative position bias inside each group (polyformer's gau carries none) and scales scores by "
                    "1 / group size where polyformer divides by the count of keys each query sees."),
}


def versus(which: str, n: int) -> tuple[list[Contender], str | None]:
    """(ours, theirs) of one comparison at length n, or ([], why) when either side is absent."""
    v = VERSUS[which]
    ready, missing = available([v.ours])
    if not ready:
        return [], f"polyformer {v.ours}: {missing[v.ours]}"
    if version(v.package) is None:
        return [], f"{v.package} is not installed (pip install -e .[bench])"
    ours = ready[0].contender(n, v.causal)
    torch.manual_seed(0)
    layer = v.build(v.causal, n)
    return [ours, Contender(v.label, layer, layer, False, v.note)], None
