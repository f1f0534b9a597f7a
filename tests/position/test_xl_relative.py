"""Transformer-XL's relative encoding (position/xl_relative.py): the four terms against the equation
written out, exactness with XL memories (for every relative scheme), shared u / v, the fused path and
positions far past max_seq_len."""

import math

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.attention.attention import Attention
from polyformer.interfaces import KV, Context
from tests.helpers import assert_same_where_kept, ids, tiny_lm
from tests.options import perturb


def xl_block(**keywords) -> Attention:
    torch.manual_seed(0)
    stack = perturb(Encoder(dim=16, depth=1, heads=2, attn_dim_head=8, rel_pos_xl=True, **keywords))
    return stack.blocks[0].branch.eval()


def direct_terms(attn: Attention, q: torch.Tensor, k: torch.Tensor, q_pos, k_pos) -> tuple:
    """(q·W_R R_{i-j}, u·k_j, v·W_R R_{i-j}) evaluated pair by pair from R_d = [sin(d w), cos(d w)]."""
    stage, dim = attn.relative, 16
    w = 10000.0 ** (-torch.arange(dim // 2, dtype=torch.float64) * 2 / dim)
    d = (q_pos[:, :, None] - k_pos[:, None, :]).double()                          # (b, i, j)
    r = torch.cat(((d[..., None] * w).sin(), (d[..., None] * w).cos()), -1)      # (b, i, j, dim)
    wr = (r.float() @ stage.to_r.weight.t()).unflatten(-1, (2, 8))               # (b, i, j, h, d)
    b_term = torch.einsum("bhid,bijhd->bhij", q, wr)
    c_term = torch.einsum("hd,bhjd->bhj", stage.biases.u, k)[:, :, None].expand_as(b_term)
    d_term = torch.einsum("hd,bijhd->bhij", stage.biases.v, wr)
    return b_term, c_term, d_term


def test_the_four_terms_equal_the_equation_at_any_positions():
    attn = xl_block()
    q, k = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 7, 8)
    q_pos = torch.tensor([[4, 5, 6, 7, 8], [30, 31, 35, 36, 50]])
    k_pos = torch.tensor([[0, 2, 4, 5, 6, 7, 8], [1, 30, 31, 35, 36, 50, 90]])   # later keys too: d < 0
    b_term, c_term, d_term = direct_terms(attn, q, k, q_pos, k_pos)
    ours = attn.relative.terms(q, KV(k, k, k_pos, None), q_pos, scale=1.0)
    assert_close(ours, b_term + c_term + d_term, atol=1e-4, rtol=1e-4)
    # each term matters: dropping any one of them moves the scores
    for term in (b_term, c_term, d_term):
        assert (ours - (b_term + c_term + d_term - term)).abs().max() > 1e-2


def test_the_block_output_is_softmax_of_the_full_score():
    attn = xl_block()
    x = torch.randn(2, 6, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 9, 10, 11, 15, 16]])
    out = attn(x, Context(pos=pos)).out
    q, k, v = attn.project.to_qkv(x).split(attn.project.split, dim=-1)
    q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in (q, k, v))
    a_term = q @ k.transpose(-1, -2)
    score = (a_term + sum(direct_terms(attn, q, k, pos, pos))) / math.sqrt(8)
    expected = attn.output(score.softmax(-1) @ v, x)
    assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keywords", [dict(rel_pos_xl=True), dict(rel_pos_xl=True, attn_kv_heads=2),
                                      dict(rel_pos_shaw=3), dict(attn_distance_aware=True,
                                                                 attn_distance_aware_alpha=-0.3)],
                         ids=["xl", "xl_gqa", "shaw", "distance_aware"])
def test_segment_two_with_segment_one_as_memories_equals_one_forward(keywords):
    model = perturb(tiny_lm(max_mem_len=8, seed=0, **keywords))
    x = ids(2, 14)
    whole = model(x)
    first, mems = model(x[:, :8], return_mems=True)
    second = model(x[:, 8:], mems=mems)
    assert_close(first, whole[:, :8], atol=1e-5, rtol=1e-5)
    assert_close(second, whole[:, 8:], atol=1e-5, rtol=1e-5)


def test_shared_u_and_v_are_held_once_by_the_stack():
    torch.manual_seed(0)
    stack = Decoder(dim=16, depth=3, heads=2, rel_pos_xl=True, rel_pos_xl_shared_uv=True)
    names = [n for n, _ in stack.named_parameters() if n.endswith((".u", ".v"))]
    assert names == ["shared_relative.u", "shared_relative.v"]
    assert all(b.branch.relative.biases is stack.shared_relative for b in stack.blocks if b.kind == "a")
    own = Decoder(dim=16, depth=3, heads=2, rel_pos_xl=True)
    assert len([n for n, _ in own.named_parameters() if n.endswith(".u")]) == 3


def test_fused_path_equals_reference_and_its_gradients():
    fused = perturb(tiny_lm(rel_pos_xl=True, attn_kv_heads=2, seed=0))
    reference = tiny_lm(rel_pos_xl=True, attn_kv_heads=2, attn_flash=False)
    reference.load_state_dict(fused.state_dict())
    x = ids(2, 10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :2] = False
    assert_same_where_kept(fused, reference, x, mask)


def test_positions_far_past_max_seq_len_change_nothing_but_the_offset():
    model = perturb(tiny_lm(rel_pos_xl=True, max_seq_len=8, seed=0))
    assert model.pos_emb is None
    x = ids(1, 12)
    pos = torch.arange(12)[None]
    assert_close(model(x, pos=pos + 5000), model(x, pos=pos), atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_close_to_float32():
    model = perturb(tiny_lm(rel_pos_xl=True, seed=0))
    x = ids(2, 10)
    ref = model(x)
    low = model.to(torch.bfloat16)(x).float()
    assert (low - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("keywords, named", [
    (dict(rel_pos_xl_shared_uv=True), "rel_pos_xl_shared_uv need(s) rel_pos_xl"),
    (dict(rel_pos_xl=True, rel_pos_xl_shared_uv=1), "rel_pos_xl_shared_uv must be True or False"),
    (dict(rel_pos_xl=True, rel_pos_bias=True), "rel_pos_xl and rel_pos_bias conflict"),
    (dict(rel_pos_xl=True, attn_collab_heads=True), "rel_pos_xl .* attn_collab_heads"),
    (dict(rel_pos_xl=True, attn_distance_aware=True), "rel_pos_xl .* attn_distance_aware"),
    (dict(rel_pos_xl=True, attn_fnet=True), "rel_pos_xl .* attn_fnet"),
    (dict(attn_per_layer=[dict(rel_pos_xl=True, rel_pos_xl_shared_uv=True)]), "rel_pos_xl_shared_uv .* attn_per_layer"),
])
def test_bad_input_is_named(keywords, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        Encoder(dim=16, depth=1, heads=2, **keywords)
