"""Which keys a query may see: the causal and prefix-LM rules (`base`), and the sparse pattern
pieces, each a pure definition on positions that yields a dense mask and a block layout."""

from .base import causal, prefix_causal
from .layout import Geometry
from .stage import PIECES, PatternStage, keyword, own_projections, problems, takes_global_mask

__all__ = ["Geometry", "causal", "prefix_causal", "PIECES", "keyword", "PatternStage", "own_projections", "problems",
           "takes_global_mask"]
