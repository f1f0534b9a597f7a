"""Mixers: what an 'a' block runs instead of attention (no queries, keys or values), by name. Each
is built as `Mixer(dim, layers_cfg, layer)`, returns `AttnOut` from `forward(x, ctx, prev_scores)`
and declares `options` (its options dataclass or None) and `caps` (an `interfaces.Caps`)."""

from .fnet import FNet
from .gau import GatedAttentionUnit

MIXERS: dict = {}
# FNet (arXiv:2105.03824)
MIXERS["fnet"] = FNet
# FLASH's gated attention unit (arXiv:2202.10447)
MIXERS["gau"] = GatedAttentionUnit
