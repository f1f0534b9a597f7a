"""Sinusoids and position-infused attention, polyformer/position/sinusoidal.py (arXiv:1706.03762,
Shortformer arXiv:2012.15832): sinusoids are added to the inputs of the query / key projections of
every layer, never to the values."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.interfaces import Source
from polyformer.position.sinusoidal import PositionInfusion, sinusoidal
from tests.helpers import ids, tiny_lm



@pytest.mark.parametrize("dim", [8, 32, 7])
def test_sinusoidal_equals_formula(dim):
    """emb[p] = [sin(p w_0) .. sin(p w_{h-1}), cos(p w_0) .. cos(p w_{h-1})], w_i = 10000^(-2i/dim'),
    h = dim // 2, dim' = 2h; an odd dim gets one trailing zero."""
    pos = torch.tensor([[0, 1, 2, 5, 17, 100], [3, 3, 0, 40, 1, 999]])
    emb = sinusoidal(pos, dim)
    half = dim // 2
    expected = torch.zeros(2, 6, dim, dtype=torch.float64)
    for b in range(2):
        for n in range(6):
            p = int(pos[b, n])
            for i in range(half):
                w = 10000.0 ** (-2.0 * i / (2 * half))
                expected[b, n, i] = math.sin(p * w)
                expected[b, n, half + i] = math.cos(p * w)
    assert_close(emb, expected.float(), atol=2e-5, rtol=1e-5)


def test_sinusoidal_offsets_are_rotations():
    """The paper's reason for sinusoids: PE(p + k) is a fixed linear map (a rotation per frequency)
    of PE(p), the same map for every p."""
    dim, half, k = 16, 8, 5
    pos = torch.arange(0, 30)[None]
    pe, pe_k = sinusoidal(pos, dim)[0].double(), sinusoidal(pos + k, dim)[0].double()
    w = torch.tensor([10000.0 ** (-2.0 * i / dim) for i in range(half)], dtype=torch.float64)
    c, s = torch.cos(k * w), torch.sin(k * w)
    sin_p, cos_p = pe[:, :half], pe[:, half:]
    assert_close(pe_k[:, :half], sin_p * c + cos_p * s, atol=1e-5, rtol=1e-5)
    assert_close(pe_k[:, half:], cos_p * c - sin_p * s, atol=1e-5, rtol=1e-5)


def test_position_infusion_adds_the_sinusoids():
    x = torch.randn(2, 6, 32)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [9, 8, 7, 1, 2, 3]])
    assert_close(PositionInfusion(32)(x, pos), x + sinusoidal(pos, 32))


def infused_projection():
    return Decoder(dim=32, depth=1, heads=4, position_infused_attn=True).blocks[0].branch.project


def test_infused_projection_colours_queries_and_keys_not_values():
    """q = W_q (x + P), k = W_k (x + P), v = W_v x, with W_q | W_k | W_v the fused projection."""
    proj = infused_projection()
    x = torch.randn(2, 6, 32)
    pos = torch.tensor([[3, 4, 5, 6, 7, 8]])
    q, kv = proj(x, Source(x, pos, None), pos)
    w_q, w_k, w_v = proj.to_qkv.weight.split(proj.split, dim=0)
    xp = x + sinusoidal(pos, 32)

    def heads(t):
        return t.unflatten(-1, (proj.heads, proj.dim_head)).transpose(1, 2)

    assert_close(q, heads(xp @ w_q.t()))
    assert_close(kv.k, heads(xp @ w_k.t()))
    assert_close(kv.v, heads(x @ w_v.t()))
    # moving positions moves q and k, never v
    q2, kv2 = proj(x, Source(x, pos + 4, None), pos + 4)
    assert torch.equal(kv2.v, kv.v)
    assert not torch.allclose(q2, q, atol=1e-3)
    assert not torch.allclose(kv2.k, kv.k, atol=1e-3)


@pytest.mark.parametrize("stack", [Decoder, Encoder])
def test_stack_values_uncoloured_by_positions(stack):
    """With the query / key weights zeroed, attention is uniform over the visible keys, so whatever
    positions are used the output is the same: positions reach the stack only through q and k."""
    layers = stack(dim=32, depth=2, heads=4, position_infused_attn=True).eval()
    x = torch.randn(2, 10, 32)
    pos = torch.arange(10)[None]
    out = layers(x, pos=pos)
    assert not torch.allclose(layers(x, pos=pos + 7), out, atol=1e-4)     # positions matter...
    with torch.no_grad():
        for block in layers.blocks:
            if block.kind == "a":
                qk = sum(block.branch.project.split[:2])
                block.branch.project.to_qkv.weight[:qk] = 0
    out = layers(x, pos=pos)
    for other in (pos + 7, pos * 3, torch.randperm(10)[None]):
        assert_close(layers(x, pos=other), out, atol=1e-5, rtol=1e-5)   # ...only through q and k


def test_wrapper_adds_no_absolute_positions_to_the_values():
    """Wrapper level: no learned absolute positions either. With q / k weights zeroed a one-layer
    decoder adds the mean of the prefix's values to each token, so swapping tokens 0 and 1 leaves
    logits at t >= 2 unchanged."""
    model = tiny_lm(depth=1, position_infused_attn=True)
    assert model.pos_emb is None
    proj = model.attn_layers.blocks[0].branch.project
    with torch.no_grad():
        proj.to_qkv.weight[: sum(proj.split[:2])] = 0
    x = ids(batch=2, n=10)
    swapped = x.clone()
    swapped[:, [0, 1]] = x[:, [1, 0]]
    assert_close(model(swapped)[:, 2:], model(x)[:, 2:], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model(swapped)[:, :2], model(x)[:, :2], atol=1e-3)
