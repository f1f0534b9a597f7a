"""Encoder options through the same properties: padding is invisible to kept positions (padding
at the end and a hole in the middle), attention is bidirectional, a fully masked row stays finite."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import Encoder, TransformerWrapper
from tests.helpers import ids, tiny_lm
from tests.options import ENCODER_KERNELS, ENCODER_OPTIONS, ENCODER_PATTERNS, perturb

NUM_TOKENS = 64

OPTIONS = {**ENCODER_OPTIONS, **ENCODER_PATTERNS, **ENCODER_KERNELS}
NAMES = list(OPTIONS)


def build(name: str, seed: int = 0) -> TransformerWrapper:
    """A tiny Encoder LM with every parameter moved off its init (ReZero's g = 0 would make the
    stack the identity and every test below vacuous)."""
    torch.manual_seed(seed)
    model = perturb(tiny_lm(Encoder, num_tokens=NUM_TOKENS, **dict(OPTIONS[name])), seed + 1)
    return model


def other_tokens(x: torch.Tensor, seed: int = 5) -> torch.Tensor:
    shift = torch.randint(1, NUM_TOKENS, x.shape, generator=torch.Generator().manual_seed(seed))
    return (x + shift) % NUM_TOKENS


def padding_mask() -> torch.Tensor:
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, 9:] = False          # right padding
    mask[1, 4:6] = False         # a hole in the middle: shifts from both sides must see zeros
    mask[1, 11] = False
    return mask


@pytest.mark.parametrize("name", NAMES)
def test_padding_is_invisible(name):
    model = build(name)
    x = ids(2, 12)
    mask = padding_mask()
    y = torch.where(mask, x, other_tokens(x))
    assert_close(model(y, mask=mask)[mask], model(x, mask=mask)[mask])
    # without the mask the padded tokens do reach the kept positions
    assert not torch.allclose(model(y)[mask], model(x)[mask])


@pytest.mark.parametrize("name", NAMES)
def test_bidirectional(name):
    model = build(name)
    x = ids(2, 12)
    y = x.clone()
    y[:, -1] = other_tokens(x)[:, -1]
    out_x, out_y = model(x), model(y)
    # an earlier position sees the last token (an encoder is not causal): position 0 in a dense
    # stack; with an attention pattern, the one before it (position 0 may be out of its reach)
    earlier = 0 if name not in ENCODER_PATTERNS else -2
    assert not torch.allclose(out_x[:, earlier], out_y[:, earlier])


@pytest.mark.parametrize("name", NAMES)
def test_fully_masked_row_is_finite(name):
    model = build(name).train()
    x = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0] = False
    logits = model(x, mask=mask)
    assert torch.isfinite(logits).all()
    logits.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    model.eval()
    assert_close(model(x[1:], mask=mask[1:]), model(x, mask=mask)[1:])
