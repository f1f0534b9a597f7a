"""The package's C++ extensions (the CPU attention kernel, the native decode loop): built once per machine
and source version with `torch.utils.cpp_extension` into PyTorch's extension cache, loaded lazily, and
replaced by their Python / ATen paths (after one warning) where they cannot be built."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import torch


def cache_name(prefix: str, sources: list[Path], flags: list[str]) -> str:
    """The build's name: the sources' bytes, the flags and torch's version decide it, so a checkout with
    other sources never overwrites (or loads) this one's build, and every checkout of the same sources
    shares it."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags).encode() + torch.__version__.encode())
    return f"{prefix}_{digest.hexdigest()[:16]}"


def load_extension(name: str, sources: list[Path], flags: list[str], what: str,
                   ldflags: list[str] | None = None) -> Any:
    """Build (if its cache has no build of this name) and load the extension `name` from `sources`. The
    sources are copied under the cache first: two checkouts then give ninja the same paths, not a rebuild
    each."""
    from torch.utils.cpp_extension import get_default_build_root, load

    if shutil.which("ninja") is None:       # the `ninja` package's binary, when its bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    for path in sources:
        target = src / path.name
        if not target.exists() or target.read_bytes() != path.read_bytes():
            partial = target.with_name(f".{target.name}.{os.getpid()}")
            partial.write_bytes(path.read_bytes())
            os.replace(partial, target)
    if not (root / f"{name}.so").exists():
        print(f"polyformer: building {what} (once per machine and source version, under a minute) in {root}",
              file=sys.stderr, flush=True)
    logging.getLogger("polyformer").info("loading %s from %s", what, root)
    return load(name=name, sources=[str(src / p.name) for p in sources], extra_cflags=flags,
                extra_ldflags=ldflags or [], build_directory=str(root), verbose=False)


class Lazy:
    """An extension built on the first `get()` by `build`; None, after one RuntimeWarning saying what runs
    `instead`, where it cannot be built (no compiler, unwritable cache ...). `error` holds why."""

    def __init__(self, build: Callable[[], Any], what: str, instead: str):
        self.build, self.what, self.instead = build, what, instead
        self.module: Any | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def get(self) -> Any | None:
        if self.module is not None or self.error is not None:
            return self.module
        with self._lock:
            if self.module is None and self.error is None:
                try:
                    self.module = self.build()
                except Exception as error:
                    self.error = error
                    warnings.warn(f"polyformer's {self.what} could not be built ({error!s:.300}); {self.instead}",
                                  RuntimeWarning, stacklevel=3)
        return self.module
