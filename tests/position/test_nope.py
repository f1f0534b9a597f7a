"""NoPE (Kazemnejad et al. 2023, arXiv:2305.19466): a Decoder with use_abs_pos_emb=False and no other scheme
builds nothing positional, runs at any length, and still tells positions apart through the causal mask."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder
from tests.helpers import ids, tiny_lm
from tests.options import perturb


def nope(stack=Decoder) -> torch.nn.Module:
    return perturb(tiny_lm(stack, seed=0, max_seq_len=16, use_abs_pos_emb=False), 1, 0.1)


def test_nothing_positional_is_built():
    model = nope()
    stack = model.attn_layers
    assert model.pos_emb is None and stack.layer_pos is None and stack.shared_bias is None
    assert model.randomized_pos is None and not model.bounded and not stack.has_pos_emb
    for a in stack.cfg.self_attention:
        assert a.position == "none" and a.bias == "none"
    for block in stack.blocks:
        if block.kind == "a":
            assert block.branch.position is None and block.branch.project.infusion is None
    named = [name for name, _ in model.named_parameters() if "pos" in name]
    assert named == []


def test_a_causal_stack_tells_positions_apart_without_positions_and_a_bidirectional_one_cannot():
    """Tokens [s, t, t, ..., t]: each t attends to s and to one t more than the previous, so its output
    moves with its position (the paper's point); without a causal mask every t sees the same set."""
    x = torch.tensor([[5] + [9] * 11])
    with torch.no_grad():
        causal, bidirectional = nope(Decoder)(x)[0, 1:], nope(Encoder)(x)[0, 1:]
    gaps = (causal[1:] - causal[:-1]).abs().amax(dim=-1)
    assert (gaps > 1e-4).all()
    assert_close(bidirectional, bidirectional[:1].expand_as(bidirectional))


def test_a_bidirectional_stack_without_positions_is_permutation_equivariant():
    model = nope(Encoder)
    x = ids(1, 10)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(model(x[:, perm]), model(x)[:, perm], atol=1e-5, rtol=1e-5)


def test_it_runs_past_max_seq_len_and_decodes_exactly():
    model = nope()
    x = ids(2, 40)
    full = model(x)
    state = model.new_state(2, 40)
    steps = [model(x[:, :30], state=state)] + [model(x[:, t:t + 1], state=state) for t in range(30, 40)]
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    ar = AutoregressiveWrapper(model)         # (past max_seq_len generation slides a window: tests/generate)
    out = ar.generate(x[:, :6], 10, temperature=0.0)
    assert torch.equal(out, ar.generate(x[:, :6], 10, temperature=0.0, cache_kv=False))
