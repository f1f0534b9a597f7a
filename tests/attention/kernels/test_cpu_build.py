"""The compiled kernel's build is named by what it is built from: other sources never share (or
overwrite) a build, two checkouts of the same sources do."""

from __future__ import annotations

import shutil

from polyformer.attention.kernels import cpu


def test_the_build_name_follows_the_sources_bytes_not_their_place(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        folder.mkdir()
        for path in cpu.SOURCES:
            shutil.copy(path, folder / path.name)
    flags = ["-O3"]
    here = cpu.cache_name(list(cpu.SOURCES), flags, "AVX2")
    assert cpu.cache_name([one / p.name for p in cpu.SOURCES], flags, "AVX2") == here
    assert cpu.cache_name([two / p.name for p in cpu.SOURCES], flags, "AVX2") == here
    edited = two / cpu.SOURCES[0].name
    edited.write_bytes(edited.read_bytes() + b"\n// changed\n")
    assert cpu.cache_name([two / p.name for p in cpu.SOURCES], flags, "AVX2") != here
    assert cpu.cache_name(list(cpu.SOURCES), ["-O2"], "AVX2") != here
    assert cpu.cache_name(list(cpu.SOURCES), flags, "AVX512") != here
