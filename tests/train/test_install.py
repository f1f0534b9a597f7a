"""What a plain install brings, checked offline: `entmax` is a core dependency (so the README's
`attn_use_entmax15 = True` example runs after `pip install polyformer`), small and torch-only."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import requires
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

EXAMPLE = """
import torch
from polyformer import TransformerWrapper, Decoder

model = TransformerWrapper(
    num_tokens = 20000,
    max_seq_len = 64,
    attn_layers = Decoder(
        dim = 64,
        depth = 2,
        heads = 8,
        attn_use_entmax15 = True  # use entmax15 for attention step
    )
)
x = torch.randint(0, 20000, (1, 64))
_, attn = model(x, return_attn = True)
import entmax
print(entmax.__name__, model.attn_layers.cfg.attention.normalize, int((attn[0] == 0).sum()))
"""


def test_entmax_is_a_core_dependency_that_needs_only_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = [d.replace(" ", "") for d in project["dependencies"]]
    assert any(d.startswith("entmax") and ";" not in d for d in core), core
    assert project["optional-dependencies"].get("entmax", []) == []         # the old extra adds nothing
    assert [r.split()[0].split(">")[0].split("(")[0] for r in requires("entmax")] == ["torch"]


def test_the_readme_entmax_example_runs_in_a_fresh_interpreter(tmp_path):
    """-I: no user site, no PYTHONPATH, not the checkout's directory: polyformer and entmax as installed."""
    done = subprocess.run([sys.executable, "-I", "-c", EXAMPLE], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    name, normalize, zeros = done.stdout.split()
    assert name == "entmax" and normalize == "entmax15"
    assert int(zeros) > 8 * 64 * 63 // 2          # the first layer: more zeros than the causal ones
