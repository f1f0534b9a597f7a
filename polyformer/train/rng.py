"""Every random number generator a training step draws from, as plain data and back."""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is optional
    np = None


def rng_state() -> dict[str, Any]:
    """Torch CPU (and CUDA, if in use), Python `random` and numpy's global RNG, as tensors and plain types."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "cuda": None, "numpy": None,
                             "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                                        "gauss": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        saved = np.random.get_state(legacy=True)
        if isinstance(saved, tuple):            # MT19937, the global RandomState's generator
            name, keys, pos, has_gauss, cached = saved
            state["numpy"] = {"bit_generator": name, "keys": torch.from_numpy(keys.astype(np.int64)),
                              "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states captured by `rng_state` (ValueError if malformed)."""
    try:
        torch.set_rng_state(state["torch"])
        py = state["python"]
        random.setstate((int(py["version"]), tuple(py["state"].tolist()), py["gauss"]))
        if state.get("cuda") is not None:
            if torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
                torch.cuda.set_rng_state_all(state["cuda"])
            else:
                warnings.warn("the checkpoint holds CUDA RNG states for another set of devices: not restored",
                              stacklevel=2)
        if state.get("numpy") is not None:
            if np is None:
                warnings.warn("the checkpoint holds numpy's RNG state but numpy is not installed: not restored",
                              stacklevel=2)
            else:
                n = state["numpy"]
                np.random.set_state((n["bit_generator"], n["keys"].numpy().astype(np.uint32), n["pos"],
                                     n["has_gauss"], n["cached_gaussian"]))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as error:
        raise ValueError(f"RNG state is malformed ({type(error).__name__}: {error})") from error
