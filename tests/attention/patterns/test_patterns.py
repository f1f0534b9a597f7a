"""Every pattern against its definition (the issue's table, `definitions.py`), the block-sparse
kernel against the dense reference with the pattern's mask (outputs and gradients, padding, rotary,
ALiBi), and the cost: the keys a query sees, the pairs the kernel computes."""

from __future__ import annotations

import math

import pytest
import torch

from polyformer import Decoder, Encoder
from polyformer.attention.kernels import block_sparse
from polyformer.attention.patterns import PatternStage

from .definitions import CASES, H, dense, dilated_counts

N = 48


def stack(causal: bool, seed: int = 0, **keywords):
    torch.manual_seed(seed)
    return (Decoder if causal else Encoder)(dim=32, depth=1, heads=H, attn_dim_head=8, **keywords)


def pairs():
    for name, (_, _, kinds) in CASES.items():
        for causal in kinds:
            yield pytest.param(name, causal, id=f"{name}-{'causal' if causal else 'bidirectional'}")


@pytest.mark.parametrize("name, causal", list(pairs()))
def test_the_keys_each_query_sees_are_the_definitions(name, causal):
    keywords, rule, _ = CASES[name]
    x = torch.randn(2, N, 32)
    _, record = stack(causal, **keywords)(x, return_attn=True)
    visible = record.attn[0] > 0                                  # (b, h, i, j)
    expected = dense(rule, N, causal)
    assert torch.equal(visible, expected.expand_as(visible)), name


EXTRAS = {
    "plain": {}, "left_padding": {}, "middle_padding": {},
    "rotary": dict(rotary_pos_emb=True), "alibi": dict(alibi_pos_emb=True), "t5": dict(rel_pos_bias=True),
    "memory_kv_gqa": dict(attn_num_mem_kv=2, attn_kv_heads=2),
}


@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("name, causal", list(pairs()))
def test_block_sparse_kernel_equals_the_dense_reference(name, causal, extra, monkeypatch):
    keywords = {**CASES[name][0], **EXTRAS[extra]}
    if name == "local_2d" and extra == "t5":
        pytest.skip("covered by the other biases")
    sparse, reference = stack(causal, **keywords), stack(causal, attn_flash=False, **keywords)
    reference.load_state_dict(sparse.state_dict())
    calls = []
    original = block_sparse.attention
    monkeypatch.setattr(block_sparse, "attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    windowed = []
    band = block_sparse.cpu.attention
    monkeypatch.setattr(block_sparse.cpu, "attention", lambda *a, **k: windowed.append(k.get("window")) or band(*a, **k))
    mask = torch.ones(2, N, dtype=torch.bool)     # "plain" passes none: a causal window then runs on the
    if extra == "left_padding":                   # compiled CPU kernel's band (kernels/cpu.py)
        mask[0, :7] = False
    if extra == "middle_padding":
        mask[1, 20:25] = False
    x = torch.randn(2, N, 32, requires_grad=True)
    grad_out = torch.randn(2, N, 32)
    results = []
    for model in (sparse, reference):
        x.grad = None
        y = model(x, mask=None if extra == "plain" else mask)
        (y * grad_out).sum().backward()
        results.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in model.parameters()]))
    assert calls, "the block-sparse kernel did not run"
    if extra == "plain" and name == "window" and causal:
        assert windowed, "the causal window did not take the compiled kernel's band"
    (y1, g1, p1), (y2, g2, p2) = results
    assert torch.allclose(y1, y2, atol=1e-5), (y1 - y2).abs().max()
    assert torch.allclose(g1, g2, atol=1e-5), (g1 - g2).abs().max()
    for a, b in zip(p1, p2):
        assert torch.allclose(a, b, atol=1e-5)


def test_longnet_mixes_its_configurations_by_their_softmax_denominators():
    """LongNet: O = sum_k s_k O_k / sum_k s_k, s_k the softmax denominator of configuration k,
    computed here per configuration with dense masked attention."""
    segments = ((8, 1), (16, 2), (32, 4))
    torch.manual_seed(0)
    n, d = 40, 8
    q, k, v = (torch.randn(1, H, n, d) for _ in range(3))
    pos = torch.arange(n)[None]
    from polyformer.attention.patterns.longnet import DilatedOptions
    from polyformer.config import Choice
    from polyformer.interfaces import KV

    for causal in (True, False):
        stage = PatternStage((Choice("pattern", "dilated", DilatedOptions(segments)),), H, causal, 0)
        parts = stage.parts(stage.geometry(pos, pos, None, None))
        out = block_sparse.attention(q, KV(k, v, pos, None), pos, parts, None, None, d ** -0.5, torch.nn.Identity())
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * d ** -0.5
        num, den = torch.zeros_like(out), torch.zeros(1, H, n, 1)
        for w, r in segments:
            keep = dense(dilated_counts(((w, r),)), n, causal)[None] > 0
            e = torch.exp(scores).masked_fill(~keep, 0)
            num += e @ v
            den += e.sum(-1, keepdim=True)
        expected = num / den.clamp(min=1e-30)
        assert torch.allclose(out, expected, atol=1e-5), (out - expected).abs().max()
        _, record = stack(causal, attn_dilated=segments)(torch.randn(1, n, 32), return_attn=True)
        assert torch.equal(record.attn[0][0] > 0, dense(dilated_counts(segments), n, causal) > 0)


def test_strided_union_shows_about_two_sqrt_n_keys_per_query():
    n = 64
    l = int(math.sqrt(n))
    _, record = stack(True, attn_sparse="strided", attn_sparse_stride=l, attn_sparse_mode="union")(
        torch.randn(1, n, 32), return_attn=True)
    counts = (record.attn[0][0] > 0).sum(-1)                      # (h, i)
    expected = torch.tensor([min(i + 1, l) + i // l for i in range(n)])     # A1, and A2 but i itself
    assert torch.equal(counts, expected.expand_as(counts))
    assert int(counts.max()) <= 2 * l


def computed_pairs(keywords: dict, n: int, causal: bool) -> int:
    """How many (query, key) products the kernel computes for the pattern: the layout, checked."""
    model = stack(causal, **keywords)
    stage = model.blocks[0].branch.pattern
    pos = torch.arange(n)[None]
    total = 0
    for part in stage.parts(stage.geometry(pos, pos, None, None)):
        heads = len(part.heads) if part.heads is not None else H
        q = (part.queries >= 0).sum(-1).expand(-1, heads, -1)
        k = (part.keys >= 0).sum(-1).expand(-1, heads, -1)
        total += int((q * k).sum())
    return total


@pytest.mark.parametrize("causal", [True, False])
def test_no_block_outside_the_layout_is_computed(causal):
    """A window of w: at most (w + group) keys per query, never n^2; doubling n doubles the work."""
    w = 16
    one, two = (computed_pairs(dict(attn_window=w), n, causal) for n in (1024, 2048))
    assert one <= H * 1024 * (w + 128 + 1)
    assert one < H * 1024 ** 2 / 16
    assert two <= 2 * one + H * 128 * (w + 128)


def test_every_registered_pattern_is_held_to_a_definition_here():
    """A new registry entry without a case in definitions.py (or a dedicated test) fails here."""
    from polyformer import registry

    covered = set()
    for keywords, _, kinds in CASES.values():
        covered |= {c.name for c in stack(kinds[0], **keywords).cfg.attention.pattern}
    covered |= {"random", "dilated"}     # BigBird's draws and LongNet's mixture: test_properties / above
    assert set(registry.names("pattern")) <= covered, sorted(set(registry.names("pattern")) - covered)


@pytest.mark.parametrize("causal", [True, False])
def test_local_2d_computes_only_the_rectangles_holding_a_query(causal):
    """A sequence shorter than the image fills few query rectangles, a decode step one: the empty ones are not
    computed (they once cost as much as full ones: 14x dense's time at 1k tokens of a 128 x 128 image)."""
    model = stack(causal, attn_local_2d=dict(image=(16, 16), query=(4, 4), memory=(4, 4)))
    stage = model.blocks[0].branch.pattern

    def groups(q_pos, k_pos):
        return sum(part.queries.shape[-2] for part in stage.parts(stage.geometry(q_pos, k_pos, None, None)))

    pos = torch.arange(32)[None]                  # two raster rows: the first row of 4 x 4 rectangles
    assert groups(pos, pos) == 4
    (part,) = stage.parts(stage.geometry(pos, pos, None, None))
    assert part.queries.shape[-1] == 2 * 4 and part.keys.shape[-1] == 2 * 12     # two rows of each: no empty slots
    assert groups(torch.arange(256)[None], torch.arange(256)[None]) == 16
    assert groups(torch.tensor([[200]]), torch.arange(201)[None]) == 1      # a decode step at row 12, column 8
