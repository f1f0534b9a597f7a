"""Encoder options through the same properties: padding is invisible to kept positions (padding
at the end and a hole in the middle), attention is bidirectional, a fully masked row stays finite."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import Encoder, TransformerWrapper
from tests.helpers import ids, tiny_lm

NUM_TOKENS = 64

OPTIONS: dict[str, dict] = {
    "default": {},
    "rel_pos_bias": dict(rel_pos_bias=True),            # bidirectional buckets
    "alibi_pos_emb": dict(alibi_pos_emb=True),
    "alibi_num_heads": dict(alibi_pos_emb=True, alibi_num_heads=2),
    "rotary_pos_emb": dict(rotary_pos_emb=True),
    "position_infused_attn": dict(position_infused_attn=True),
    "shift_tokens": dict(shift_tokens=1),               # shifts (-1, 0, 1): both directions
    "shift_tokens_2": dict(shift_tokens=2),
    "shift_tokens_tuple": dict(shift_tokens=(1, 0, 2, 0)),
    "attn_num_mem_kv": dict(attn_num_mem_kv=4),
    "num_memory_tokens": dict(num_memory_tokens=3),
    "use_scalenorm": dict(use_scalenorm=True),
    "use_rmsnorm": dict(use_rmsnorm=True),
    "use_rezero": dict(use_rezero=True),
    "ff_glu": dict(ff_glu=True),
    "ff_relu_squared": dict(ff_relu_squared=True),
    "attn_sparse_topk": dict(attn_sparse_topk=3),
    "attn_use_entmax15": dict(attn_use_entmax15=True),
    "attn_talking_heads": dict(attn_talking_heads=True),
    "attn_collab_heads": dict(attn_collab_heads=True),
    "attn_on_attn": dict(attn_on_attn=True),
    "gate_values": dict(gate_values=True),
    "attn_kv_heads": dict(attn_kv_heads=2),
    "sandwich_coef": dict(sandwich_coef=1),
    "macaron": dict(macaron=True),
    "post_norm_residual_attn": dict(pre_norm=False, residual_attn=True),
    "gate_residual": dict(gate_residual=True),
    "sandwich_norm": dict(sandwich_norm=True),
    "scaled_sinu_pos_emb": dict(scaled_sinu_pos_emb=True),
    "gradient_checkpointing": dict(gradient_checkpointing=True),
    "emb_dim": dict(emb_dim=24),
    "tie_embedding": dict(tie_embedding=True),
}
NAMES = list(OPTIONS)


def build(name: str, seed: int = 0) -> TransformerWrapper:
    """A tiny Encoder LM with every parameter moved off its init (ReZero's g = 0 would make the
    stack the identity and every test below vacuous)."""
    torch.manual_seed(seed)
    model = tiny_lm(Encoder, num_tokens=NUM_TOKENS, **dict(OPTIONS[name]))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
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
    # position 0 sees the last token (an encoder is not causal)
    assert not torch.allclose(out_x[:, 0], out_y[:, 0])


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
