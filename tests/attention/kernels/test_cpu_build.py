"""The compiled kernel's build is named by what it is built from: other sources never share (or
overwrite) a build, two checkouts of the same sources do."""

from __future__ import annotations

import shutil

from polyformer.attention.kernels import cpu
from polyformer.native_build import cache_name


def test_the_build_name_follows_the_sources_bytes_not_their_place(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        folder.mkdir()
        for path in cpu.SOURCES:
            shutil.copy(path, folder / path.name)
    flags = ["-O3"]
    here = cache_name("avx2", list(cpu.SOURCES), flags)
    assert cache_name("avx2", [one / p.name for p in cpu.SOURCES], flags) == here
    assert cache_name("avx2", [two / p.name for p in cpu.SOURCES], flags) == here
    edited = two / cpu.SOURCES[0].name
    edited.write_bytes(edited.read_bytes() + b"\n// changed\n")
    assert cache_name("avx2", [two / p.name for p in cpu.SOURCES], flags) != here
    assert cache_name("avx2", list(cpu.SOURCES), ["-O2"]) != here
