"""Attention kernels: the dense kernel (`dense.py`: queries, keys / values, a keep-mask and a bias ->
AttnOut) and the kernels of form "direct" that compute attention without the score matrix, each a
small module of its own, listed here by name (the registry reads this table)."""

from .adaptive_span import AdaptiveSpan
from .aft import Aft
from .distance_aware import DistanceAware
from .infini import Infini
from .landmark import Landmark
from .linear import KERNELS as _KERNEL_METHODS
from .linformer import Linformer
from .lsh import Lsh
from .nystrom import Nystrom
from .routing import Routing
from .sinkhorn import Sinkhorn

DIRECT_KERNELS: dict = {**_KERNEL_METHODS, "linformer": Linformer, "nystrom": Nystrom}
DIRECT_KERNELS["aft"] = Aft
DIRECT_KERNELS["sinkhorn"] = Sinkhorn
DIRECT_KERNELS["lsh"] = Lsh
DIRECT_KERNELS["routing"] = Routing
DIRECT_KERNELS["adaptive_span"] = AdaptiveSpan
DIRECT_KERNELS["distance_aware"] = DistanceAware
DIRECT_KERNELS["landmark"] = Landmark
DIRECT_KERNELS["infini"] = Infini
