"""Mixture-of-experts feedforwards (`ff_moe=True`): options.py (the keywords' dataclass and checks),
router.py, capacity.py, experts.py (stacked weights, dispatch, combine), layer.py (the module; import it
from there: config.py imports this package)."""

from .options import MoeOptions, is_moe, problems

__all__ = ["MoeOptions", "is_moe", "problems"]
