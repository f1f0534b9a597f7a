"""Every Decoder option of the README through the same properties: causality, key padding,
fully masked rows, gradients to every parameter, seeded determinism, and a rebuild from the
saved JSON config."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AttentionLayers, Decoder, Encoder, LayersConfig, TransformerWrapper
from polyformer.config import from_dict, to_dict
from tests.helpers import WRAPPER_KEYS, ids, tiny_lm
from tests.options import (DECODER_KERNELS, DECODER_OPTIONS, DECODER_PATTERNS, ENCODER_ONLY, KERNEL_ENCODER_ONLY,
                           KERNEL_OPTIONS, PATTERN_OPTIONS, perturb)

NUM_TOKENS = 64

OPTIONS = {**DECODER_OPTIONS, **DECODER_PATTERNS, **DECODER_KERNELS}
NAMES = list(OPTIONS)


def test_every_registered_pattern_runs_through_the_contracts():
    """A pattern added to the registry without an option set here is seen by no contract."""
    from polyformer import registry

    seen = set()
    for name, keywords in PATTERN_OPTIONS.items():
        stack = Encoder if name in ENCODER_ONLY else Decoder
        seen |= {c.name for c in tiny_lm(stack, **keywords).attn_layers.cfg.attention.pattern}
    assert seen == set(registry.names("pattern")), sorted(set(registry.names("pattern")) - seen)


def test_every_registered_kernel_and_mixer_runs_through_the_contracts():
    """A kernel or mixer added to the registry without an option set here is seen by no contract."""
    from polyformer import registry

    seen = set()
    for name, keywords in KERNEL_OPTIONS.items():
        cfg = tiny_lm(Encoder if name in KERNEL_ENCODER_ONLY else Decoder, **keywords).attn_layers.cfg
        seen |= {f"kernel.{cfg.attention.kernel.name}"} | ({f"mixer.{cfg.mixer.name}"} if cfg.mixer else set())
    wanted = {f"kernel.{n}" for n in registry.names("kernel")} | {f"mixer.{n}" for n in registry.names("mixer")}
    assert wanted - {"kernel.dense"} <= seen, sorted(wanted - seen - {"kernel.dense"})


def build(name: str, seed: int = 0, depth: int = 2) -> TransformerWrapper:
    torch.manual_seed(seed)
    return perturb(tiny_lm(Decoder, num_tokens=NUM_TOKENS, depth=depth, **dict(OPTIONS[name])), seed + 1)


def other_tokens(x: torch.Tensor, seed: int = 5) -> torch.Tensor:
    """x with every token replaced by a different one."""
    shift = torch.randint(1, NUM_TOKENS, x.shape, generator=torch.Generator().manual_seed(seed))
    return (x + shift) % NUM_TOKENS


@pytest.mark.parametrize("name", NAMES)
def test_causal(name):
    model = build(name)
    x = ids(2, 12)
    out = model(x)
    for t in (0, 4, 9):
        y = x.clone()
        y[:, t + 1:] = other_tokens(x)[:, t + 1:]
        out_y = model(y)
        assert_close(out_y[:, :t + 1], out[:, :t + 1])
        assert not torch.allclose(out_y[:, t + 1:], out[:, t + 1:]), "the future tokens had no effect at all"


@pytest.mark.parametrize("name", NAMES)
def test_left_padding_is_invisible(name):
    model = build(name)
    x = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :4] = False
    mask[1, :2] = False
    y = torch.where(mask, x, other_tokens(x))
    out_x, out_y = model(x, mask=mask), model(y, mask=mask)
    assert_close(out_y[mask], out_x[mask])
    # without the mask the padded tokens do reach the kept positions: the mask is what hides them
    assert not torch.allclose(model(x)[mask], model(y)[mask])


@pytest.mark.parametrize("name", NAMES)
def test_fully_masked_row_is_finite(name):
    model = build(name).train()
    x = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1] = False
    logits = model(x, mask=mask)
    assert torch.isfinite(logits).all()
    logits.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    # the kept row is unaffected by its neighbour being fully masked
    model.eval()
    assert_close(model(x[:1], mask=mask[:1]), model(x, mask=mask)[:1])


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_gets_a_gradient(name):
    model = build(name).train()
    x = ids(2, 12)
    logits = model(x)
    F.cross_entropy(logits.transpose(1, 2), other_tokens(x)).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} received no gradient"
        assert torch.isfinite(p.grad).all(), f"{pname} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{pname} has an all-zero gradient"


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_model(name):
    x = ids(2, 12)
    a, b, c = build(name, seed=3), build(name, seed=3), build(name, seed=4)
    assert_close(a(x), b(x), rtol=0, atol=0)
    assert not torch.allclose(a(x), c(x))


@pytest.mark.parametrize("name", NAMES)
def test_rebuild_from_json_config(name):
    model = build(name)
    cfg = model.attn_layers.cfg
    text = json.dumps(to_dict(cfg))
    revived = from_dict(LayersConfig, json.loads(text))
    assert revived == cfg
    wrap = {k: v for k, v in OPTIONS[name].items() if k in WRAPPER_KEYS}
    torch.manual_seed(123)                   # different init: the state dict must carry everything
    rebuilt = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=32,
                                 attn_layers=AttentionLayers.from_config(revived), **wrap).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    x = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :3] = False
    assert_close(rebuilt(x, mask=mask), model(x, mask=mask), rtol=0, atol=0)
    assert rebuilt.attn_layers.causal
