"""The Universal Transformer (polyformer/universal.py): depth d equals one unit of blocks applied d times by
hand with the paper's coordinate embedding; parameters independent of depth; each application its own layer
of the decode state and of Transformer-XL memories; bad input named."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper
from polyformer.generate.fast import FastStep
from polyformer.interfaces import Context
from tests.helpers import ids, tiny_lm
from tests.options import perturb

DIM, N = 16, 7


def stack(cls=Decoder, depth: int = 3, seed: int = 0, **keywords) -> torch.nn.Module:
    torch.manual_seed(seed)
    return perturb(cls(dim=DIM, depth=depth, heads=2, attn_dim_head=8, universal=True, **keywords), seed + 1).eval()


def unit_once(s: torch.nn.Module, h: torch.Tensor, ctx: Context) -> torch.Tensor:
    """One application of the stack's shared blocks to h, block by block."""
    for block in s.blocks:
        h = block(h, ctx, None)[0]
    return h


def coordinate(n: int, t: int, dim: int) -> torch.Tensor:
    """The paper's 2D coordinate embedding P^t (n, dim), entry by entry (arXiv:1807.03819, section 2.1)."""
    p = torch.zeros(n, dim)
    for pos in range(n):
        for i in range(dim):
            w = 10000 ** (-(i - i % 2) / dim)
            p[pos, i] = math.sin(pos * w) + math.sin(t * w) if i % 2 == 0 else math.cos(pos * w) + math.cos(t * w)
    return p


@pytest.mark.parametrize("cls", [Decoder, Encoder])
@pytest.mark.parametrize("timestep", [True, False])
def test_depth_d_equals_the_unit_applied_d_times_by_hand(cls, timestep):
    s = stack(cls, depth=3, ut_timestep_emb=timestep)
    assert [b.kind for b in s.blocks] == ["a", "f"]
    x = torch.randn(2, N, DIM)
    ctx = Context(pos=torch.arange(N)[None], causal=s.causal)
    h = x
    for t in (1, 2, 3):
        if timestep:
            h = h + coordinate(N, t, DIM)
        h = unit_once(s, h, ctx)
    assert_close(s(x), s.final_norm(h))
    assert not torch.allclose(s(x), stack(cls, depth=2, ut_timestep_emb=timestep)(x))


def test_custom_layers_are_the_unit():
    s = stack(depth=2, custom_layers=("a", "a", "f"))
    assert [b.kind for b in s.blocks] == ["a", "a", "f"] and s.num_self_attn == 4
    x = torch.randn(1, N, DIM)
    ctx = Context(pos=torch.arange(N)[None], causal=True)
    h = x
    for _ in range(2):
        h = unit_once(s, h, ctx)
    assert_close(s(x), s.final_norm(h))


def test_parameter_count_is_independent_of_depth():
    def count(**keywords) -> int:
        return sum(p.numel() for p in Decoder(dim=DIM, heads=2, **keywords).parameters())

    shared = {count(depth=d, universal=True, ut_timestep_emb=True) for d in (1, 2, 6)}
    assert shared == {count(depth=1)}
    assert count(depth=6) > count(depth=1)


def test_each_application_keeps_its_own_keys_in_the_decode_state():
    """... and its own token-shift inputs (shift_tokens reads earlier steps' inputs from the state)."""
    model = perturb(tiny_lm(depth=3, universal=True, ut_timestep_emb=True, shift_tokens=1, seed=0), scale=0.05)
    state = model.new_state(2, 10)
    assert state.layers == 3 == model.attn_layers.num_self_attn
    x = ids(2, 10)
    cached = torch.cat([model(x[:, :4], state=state)] + [model(x[:, t:t + 1], state=state) for t in range(4, 10)], 1)
    assert_close(cached, model(x), atol=1e-5, rtol=1e-5)
    k = state.k[:, :, :, :10]
    assert all(not torch.allclose(k[a], k[b]) for a, b in ((0, 1), (1, 2), (0, 2)))


def test_generation_goes_around_the_fast_step():
    model = perturb(tiny_lm(depth=2, universal=True, seed=0), scale=0.05)
    assert "universal" in FastStep.unsupported(model)
    ar = AutoregressiveWrapper(model)
    prompts = ids(2, 4)
    assert torch.equal(ar.generate(prompts, 5, temperature=0.0),
                       ar.generate(prompts, 5, temperature=0.0, cache_kv=False))


def test_xl_memories_come_one_per_application():
    torch.manual_seed(0)
    model = perturb(TransformerWrapper(num_tokens=64, max_seq_len=32, max_mem_len=6, use_abs_pos_emb=False,
                                       attn_layers=Decoder(dim=DIM, depth=3, heads=2, universal=True,
                                                           ut_timestep_emb=True, rotary_pos_emb=True)), scale=0.05).eval()
    x = ids(2, 12)
    first, mems = model(x[:, :6], return_mems=True)
    assert len(mems) == 3 and all(m.shape == (2, 6, DIM) for m in mems)
    second = model(x[:, 6:], mems=mems)
    assert_close(torch.cat((first, second), 1), model(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(second, model(x[:, 6:]))


@pytest.mark.parametrize("keywords, named", [
    (dict(ut_timestep_emb=True), "ut_timestep_emb"),
    (dict(universal=1), "universal"),
    (dict(universal=True, reversible=True), "reversible"),
    (dict(universal=True, deepnorm=True), "deepnorm"),
    (dict(universal=True, sandwich_coef=1), "sandwich_coef"),
    (dict(universal=True, shift_tokens=(1, 0, 1, 0)), "shift_tokens"),
])
def test_bad_input_is_named(keywords, named):
    with pytest.raises(ValueError, match=named):
        Decoder(dim=DIM, depth=2, heads=2, **keywords)
