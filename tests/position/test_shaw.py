"""Shaw et al.'s relative positions (position/shaw.py): the paper's equation, dependence on the clipped
distance only, the value term, the fused path, and bad input named."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.attention.attention import Attention
from polyformer.interfaces import KV, Context
from tests.helpers import assert_same_where_kept, ids, tiny_lm
from tests.options import perturb


def block(**keywords) -> Attention:
    torch.manual_seed(0)
    stack = perturb(Encoder(dim=16, depth=1, heads=2, attn_dim_head=8, **keywords))
    return stack.blocks[0].branch.eval()


def shaw_reference(attn: Attention, x: torch.Tensor, pos: torch.Tensor, causal: bool, drop=lambda w: w) -> torch.Tensor:
    """e_ij = q_i (k_j + a^K_ij) / sqrt(d), z_i = sum_j a_ij (v_j + a^V_ij), written out (one head group)."""
    h, d = attn.project.heads, attn.project.dim_head
    q, k, v = attn.project.to_qkv(x).split(attn.project.split, dim=-1)
    q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in (q, k, v))        # (b, h, n, d)
    stage = attn.relative
    c = (pos[:, None, :] - pos[:, :, None]).clamp(-stage.k, stage.k) + stage.k    # (b, i, j): j - i clipped
    a_k, a_v = stage.key_emb[c], stage.value_emb[c]                                 # (b, i, j, d)
    scores = (q @ k.transpose(-1, -2) + torch.einsum("bhid,bijd->bhij", q, a_k)) / d ** 0.5
    if causal:
        scores = scores.masked_fill(pos[:, None, :, None] < pos[:, None, None, :], float("-inf"))
    w = drop(scores.softmax(-1))
    z = w @ v + torch.einsum("bhij,bijd->bhid", w, a_v)
    return attn.output(z, x)


@pytest.mark.parametrize("causal", [False, True])
def test_the_block_computes_the_papers_equation(causal):
    attn = block(rel_pos_shaw=2)
    attn.causal = causal
    x = torch.randn(2, 7, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 9, 10, 11, 20, 21]])     # gaps: distances beyond k
    out = attn(x, Context(pos=pos, causal=causal)).out
    assert_close(out, shaw_reference(attn, x, pos, causal), atol=1e-5, rtol=1e-5)


def test_shifting_every_position_changes_nothing():
    torch.manual_seed(0)
    stack = perturb(Decoder(dim=16, depth=2, heads=2, rel_pos_shaw=3)).eval()
    x = torch.randn(2, 9, 16)
    pos = torch.arange(9)[None]
    assert_close(stack(x, pos=pos + 1000), stack(x, pos=pos), atol=1e-6, rtol=1e-6)


def test_distances_beyond_k_share_one_embedding():
    attn = block(rel_pos_shaw=2)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    terms = lambda pos: attn.relative.terms(q, KV(k, k, pos, None), torch.tensor([[0]]), 1.0)
    near = terms(torch.tensor([[-2, -1, 0, 1, 2]]))
    far = terms(torch.tensor([[-9, -1, 0, 1, 40]]))         # -9 and 40 clip to -2 and 2
    assert_close(far, near, rtol=0, atol=0)
    inside = terms(torch.tensor([[-1, -1, 0, 1, 1]]))       # |distance| < k: its own embedding
    assert not torch.allclose(inside[..., [0, 4]], near[..., [0, 4]])


def test_the_value_term_changes_the_output_and_can_be_turned_off():
    torch.manual_seed(0)
    with_values = perturb(tiny_lm(rel_pos_shaw=3))
    keys_only = tiny_lm(rel_pos_shaw=3, rel_pos_shaw_values=False)
    state = {k: v for k, v in with_values.state_dict().items() if "value_emb" not in k}
    keys_only.load_state_dict(state, strict=True)
    x = ids(2, 10)
    assert not torch.allclose(with_values(x), keys_only(x), atol=1e-3)
    with torch.no_grad():
        for b in with_values.attn_layers.blocks:
            if b.kind == "a":
                b.branch.relative.value_emb.zero_()
    assert_close(with_values(x), keys_only(x), atol=1e-5, rtol=1e-5)


def test_keys_only_keeps_the_fused_path_and_equals_the_reference():
    torch.manual_seed(0)
    fused = perturb(tiny_lm(rel_pos_shaw=3, rel_pos_shaw_values=False, attn_kv_heads=2))
    reference = tiny_lm(rel_pos_shaw=3, rel_pos_shaw_values=False, attn_kv_heads=2, attn_flash=False)
    reference.load_state_dict(fused.state_dict())
    assert all(b.branch.kernel.can_fuse for b in fused.attn_layers.blocks if b.kind == "a")
    assert not tiny_lm(rel_pos_shaw=3).attn_layers.blocks[0].branch.kernel.can_fuse   # values read the weights
    x = ids(2, 10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False
    assert_same_where_kept(fused, reference, x, mask)


def test_attention_dropout_reaches_the_value_term_too():
    attn = block(rel_pos_shaw=2, attn_dropout=0.5).train()
    x = torch.randn(2, 6, 16)
    pos = torch.arange(6)[None]
    torch.manual_seed(7)
    out = attn(x, Context(pos=pos)).out

    def drop(w):            # the kernel's own draw (its output is replaced), then the one both terms use
        F.dropout(w, 0.5)
        return F.dropout(w, 0.5)

    torch.manual_seed(7)
    assert_close(out, shaw_reference(attn, x, pos, False, drop), atol=1e-5, rtol=1e-5)


def test_sequences_longer_than_max_seq_len_run():
    model = tiny_lm(rel_pos_shaw=3, max_seq_len=8)
    assert model.pos_emb is None and model(ids(1, 20)).shape == (1, 20, 64)
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny_lm(rel_pos_shaw=3, max_seq_len=8, use_abs_pos_emb=True)(ids(1, 20))


@pytest.mark.parametrize("keywords, named", [
    (dict(rel_pos_shaw=0), "rel_pos_shaw must be an integer >= 1"),
    (dict(rel_pos_shaw=-2), "rel_pos_shaw must be an integer >= 1"),
    (dict(rel_pos_shaw=2.5), "rel_pos_shaw must be an integer >= 1"),
    (dict(rel_pos_shaw=True), "rel_pos_shaw must be an integer >= 1"),
    (dict(rel_pos_shaw=2, rel_pos_shaw_values="yes"), "rel_pos_shaw_values must be True or False"),
    (dict(rel_pos_shaw_values=False), "rel_pos_shaw_values need(s) rel_pos_shaw"),
    (dict(rel_pos_shaw=2, rel_pos_xl=True), "rel_pos_shaw and rel_pos_xl conflict"),
    (dict(rel_pos_shaw=2, rel_pos_bias=True), "rel_pos_shaw and rel_pos_bias conflict"),
    (dict(rel_pos_shaw=2, alibi_pos_emb=True), "rel_pos_shaw and alibi_pos_emb conflict"),
    (dict(rel_pos_shaw=2, attn_flash=True), "attn_flash=True .* rel_pos_shaw_values=True"),
    (dict(rel_pos_shaw=2, attn_performer=True), "rel_pos_shaw adds terms .* attn_performer"),
    (dict(rel_pos_shaw=2, gau=True), "rel_pos_shaw .* gau"),
])
def test_bad_input_is_named(keywords, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        Decoder(dim=16, depth=1, heads=2, **keywords)
