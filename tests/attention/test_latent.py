"""Multi-latent attention (attention/latent.py; DeepSeek-V2, arXiv:2405.04434): the projections through
the latents against the explicit float64 formula, x-transformers' Attention with the same weights, the
decoupled rotary heads, cross-attention latents of the context, and the refused combinations by name.
Causality, padding and cache parity: tests/options.py ("attn_latent_*") through the contract and
decode tests."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.attention.latent import LatentProjection
from polyformer.interfaces import Context, Source
from tests.options import perturb

DIM, HEADS, DIM_HEAD, N = 24, 4, 8, 7
LATENTS = dict(attn_use_latent_q=True, attn_dim_latent_q=10, attn_use_latent_kv=True, attn_dim_latent_kv=6)


def block(seed: int = 0, **keywords):
    torch.manual_seed(seed)
    stack = Decoder(dim=DIM, depth=1, heads=HEADS, attn_dim_head=DIM_HEAD, **keywords)
    return perturb(stack, seed + 1).blocks[0].branch.double()


def rotate_half_split(t: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE on the whole head, feature i paired with i + d/2 (our default), in float64."""
    d = t.shape[-1]
    angles = pos.double()[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)   # (n, d/2)
    x1, x2 = t[..., : d // 2], t[..., d // 2:]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def explicit(attn, x: torch.Tensor, rope: int, rotary: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal) v W_o with q = W_uq W_dq x, c = W_dkv x, k = [W_uk c ; W_kr x],
    v = W_uv c, the last `rope` heads of q and k rotated (all of them when rope is 0 and rotary is on)."""
    p = attn.project
    heads = lambda t: t.view(t.shape[0], -1, DIM_HEAD).transpose(0, 1)       # (n, h d) -> (h, n, d)
    c_q = x @ p.to_latent_q.weight.T if p.to_latent_q is not None else x
    c_kv = x @ p.to_latent_kv.weight.T if p.to_latent_kv is not None else x
    q = heads(c_q @ p.to_q.weight.T)
    k = [heads(c_kv @ p.to_k.weight.T)] if p.to_k is not None else []
    k = torch.cat(k + ([heads(x @ p.to_rope_k.weight.T)] if rope else []), dim=0)
    v = heads(c_kv @ p.to_v.weight.T)
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    if rotary:
        pos, r = torch.arange(x.shape[0]), rope or HEADS
        q = torch.cat((q[:-r] if r < HEADS else q[:0], rotate_half_split(q[-r:], pos)))
        k = torch.cat((k[:-r] if r < HEADS else k[:0], rotate_half_split(k[-r:], pos)))
    scores = q @ k.transpose(-1, -2) / DIM_HEAD ** 0.5
    scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(x.shape[0], -1)
    return out @ attn.output.proj.weight.T


@pytest.mark.parametrize("keywords, rope, rotary", [
    (dict(attn_use_latent_q=True, attn_dim_latent_q=10), 0, False),
    (dict(attn_use_latent_kv=True, attn_dim_latent_kv=6, attn_kv_heads=2), 0, True),
    (dict(LATENTS, attn_latent_rope_subheads=1, rotary_pos_emb=True), 1, True),
    (dict(LATENTS, attn_latent_rope_subheads=HEADS, rotary_pos_emb=True), HEADS, True),
], ids=["latent_q", "latent_kv_gqa_rotary", "rope_subheads", "rope_every_head"])
def test_equals_the_explicit_formula(keywords, rope, rotary):
    keywords = dict(keywords, rotary_pos_emb=True, rotary_emb_dim=DIM_HEAD) if rotary else keywords
    attn = block(**keywords)
    x = torch.randn(1, N, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out = attn(x, Context(pos=torch.arange(N)[None], causal=True)).out
    assert_close(out[0], explicit(attn, x[0], rope, rotary))


def test_keys_and_values_see_the_input_only_through_the_latent():
    """DeepSeek-V2's compression: without decoupled heads, a change of x in the null space of W_dkv changes
    no key and no value (only the queries, which have their own latent)."""
    attn = block(**LATENTS)
    p = attn.project
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    null = torch.linalg.svd(p.to_latent_kv.weight).Vh[p.to_latent_kv.weight.shape[0]:]   # (DIM - dim_kv, DIM)
    y = x + torch.randn(2, N, null.shape[0], dtype=torch.float64) @ null
    kv_x, kv_y = p.keys_values(Source(x, None, None)), p.keys_values(Source(y, None, None))
    assert_close(kv_x.k, kv_y.k)
    assert_close(kv_x.v, kv_y.v)
    assert not torch.allclose(p.queries(x), p.queries(y))


@pytest.mark.parametrize("rope", [0, 2])
def test_matches_x_transformers_attention(rope):
    """x-transformers 2.31.10's Attention with the same weights: its latents, its decoupled heads (the last
    `rope`, rotated by its interleaved rotary of 4 dims) and GQA when there are no decoupled heads (its query
    heads in another order)."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    kv_heads = HEADS if rope else 2
    keywords = dict(LATENTS, attn_kv_heads=kv_heads, rotary_pos_emb=True, rotary_emb_dim=4, rotary_interleaved=True)
    if rope:
        keywords["attn_latent_rope_subheads"] = rope
    ours = block(**keywords).float()
    theirs = xt.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, causal=True, kv_heads=kv_heads, use_latent_q=True,
                          dim_latent_q=10, use_latent_kv=True, dim_latent_kv=6, latent_rope_subheads=rope or None)
    p = ours.project
    pairs = [(theirs.to_latent_q, p.to_latent_q), (theirs.to_latent_kv, p.to_latent_kv), (theirs.to_k, p.to_k),
             (theirs.to_v, p.to_v)]
    if rope:
        pairs.append((theirs.to_rotateable_k, p.to_rope_k))
    # their query head j reads key head j % kv_heads, ours j // group: their head j is our head `order[j]`
    group = HEADS // kv_heads
    order = [(j % kv_heads) * group + j // kv_heads for j in range(HEADS)]
    with torch.no_grad():
        for theirs_linear, mine in pairs:
            theirs_linear.weight.copy_(mine.weight)
        theirs.to_q.weight.copy_(p.to_q.weight.view(HEADS, DIM_HEAD, -1)[order].reshape(HEADS * DIM_HEAD, -1))
        theirs.to_out.weight.copy_(ours.output.proj.weight.view(DIM, HEADS, DIM_HEAD)[:, order].reshape(DIM, -1))
    x = torch.randn(2, N, DIM)
    freqs = xt.RotaryEmbedding(4)(torch.arange(N))
    assert_close(ours(x, Context(pos=torch.arange(N)[None], causal=True)).out, theirs(x, rotary_pos_emb=freqs),
                 atol=1e-5, rtol=1e-5)


def test_only_the_decoupled_heads_carry_position():
    """Moving a key to another position changes the scores of the rotated heads only."""
    attn = block(**LATENTS, attn_latent_rope_subheads=1, rotary_pos_emb=True)
    q, k = torch.randn(2, 1, HEADS, 1, DIM_HEAD, dtype=torch.float64)

    def scores(key_pos: int) -> torch.Tensor:                   # (1, h, 1): q at position 9, k at key_pos
        q_rot, k_rot = attn.position(q, k, torch.tensor([[9]]), torch.tensor([[key_pos]]))
        return (q_rot * k_rot).sum(-1)

    moved = scores(2) - scores(5)
    assert_close(moved[:, :-1], torch.zeros_like(moved[:, :-1]))
    assert moved[:, -1].abs().min() > 1e-6


def test_cross_attention_takes_its_latent_from_the_context():
    torch.manual_seed(0)
    stack = Decoder(dim=DIM, depth=1, heads=HEADS, attn_dim_head=DIM_HEAD, cross_attend=True, dim_context=20,
                    **LATENTS)
    cross = stack.blocks[1].branch.project
    assert isinstance(cross, LatentProjection) and cross.to_latent_kv.in_features == 20
    context = torch.randn(2, 5, 20)
    kv = cross.keys_values(Source(context, None, None))
    c = context @ cross.to_latent_kv.weight.T
    assert_close(kv.v, (c @ cross.to_v.weight.T).view(2, 5, HEADS, DIM_HEAD).transpose(1, 2))
    x = torch.randn(2, N, DIM)
    assert stack(x, context=context).shape == x.shape


@pytest.mark.parametrize("keywords, message", [
    (dict(attn_use_latent_q=True), "attn_use_latent_q=True needs attn_dim_latent_q"),
    (dict(attn_use_latent_kv=True, attn_dim_latent_kv=6, attn_dim_latent_q=4),
     "attn_dim_latent_q is set but attn_use_latent_q"),
    (dict(attn_dim_latent_kv=6), "attn_dim_latent_kv is set but attn_use_latent_kv is not True"),
    (dict(attn_use_latent_kv=1, attn_dim_latent_kv=6), "attn_use_latent_kv expects True or False, got 1"),
    (dict(attn_use_latent_kv=True, attn_dim_latent_kv=0), "attn_dim_latent_kv must be a positive integer"),
    (dict(attn_use_latent_q=True, attn_dim_latent_q=4, attn_latent_rope_subheads=1, rotary_pos_emb=True),
     "attn_latent_rope_subheads needs attn_use_latent_kv=True"),
    (dict(LATENTS, attn_latent_rope_subheads=1), "needs rotary_pos_emb=True"),
    (dict(LATENTS, attn_latent_rope_subheads=5, rotary_pos_emb=True), r"in \[1, heads=4\]"),
    (dict(LATENTS, attn_latent_rope_subheads=1, rotary_pos_emb=True, attn_kv_heads=2),
     "cannot combine with attn_kv_heads / attn_one_kv_head"),
    (dict(LATENTS, attn_latent_rope_subheads=1, rotary_pos_emb=True, rotate_num_heads=2),
     "'rotate_num_heads' and 'attn_latent_rope_subheads' conflict|'attn_latent_rope_subheads' and 'rotate_num_heads' "
     "conflict"),
    (dict(LATENTS, attn_collab_heads=True), "attn_collab_heads"),
    (dict(LATENTS, position_infused_attn=True), "position_infused_attn"),
    (dict(LATENTS, deepnorm=True), "deepnorm=True"),
    (dict(LATENTS, attn_fnet=True), "mixer replaces attention"),
    (dict(LATENTS, attn_lsh=True, attn_shared_qk=True, attn_lsh_n_buckets=2), "attn_shared_qk"),
])
def test_bad_combinations_are_refused_by_name(keywords, message):
    stack = Encoder if keywords.get("attn_fnet") else Decoder
    with pytest.raises((ValueError, TypeError), match=message):
        stack(dim=DIM, depth=1, heads=HEADS, **keywords)


def test_json_round_trip_keeps_the_latents():
    from polyformer.config import LayersConfig, from_dict, to_dict

    cfg = Decoder(dim=DIM, depth=1, heads=HEADS, **LATENTS, attn_latent_rope_subheads=2, rotary_pos_emb=True).cfg
    assert from_dict(LayersConfig, to_dict(cfg)) == cfg
    assert cfg.attention.latent.dim_kv == 6 and cfg.attention.latent.rope_subheads == 2


@pytest.mark.parametrize("keywords", [dict(attn_latent_rope_subheads=2, rotary_pos_emb=True),
                                      dict(rotary_pos_emb=True), dict(attn_kv_heads=2)],
                         ids=["decoupled_rope", "rotary_all_heads", "gqa"])
def test_the_decode_state_keeps_the_latents_and_decodes_as_the_full_forward(keywords):
    """MLA's point: the cache holds c_kv and the unrotated rope heads, dim_kv + r * d numbers per token and layer
    (here 6 + 2 * 8 = 22, or 6) instead of 2 * kv_heads * d (64, or 32); a prompt then one-token steps give the
    full forward's logits, the rope heads rotated by their cached positions."""
    from polyformer import TransformerWrapper

    torch.manual_seed(0)
    model = perturb(TransformerWrapper(num_tokens=32, max_seq_len=32, attn_layers=Decoder(
        dim=DIM, depth=2, heads=HEADS, attn_dim_head=DIM_HEAD, **LATENTS, **keywords)))
    x = torch.randint(0, 32, (2, 12))
    state = model.new_state(2, 12)
    assert state.keeps_latents
    rope = keywords.get("attn_latent_rope_subheads", 0)
    assert state.k.shape == (2, 2, 1, 12, 6 + rope * DIM_HEAD) and state.v.shape[-1] == 0
    steps = [model(x[:, :5], state=state)] + [model(x[:, t: t + 1], state=state) for t in range(5, 12)]
    assert_close(torch.cat(steps, dim=1), model(x), atol=1e-5, rtol=1e-5)


def test_a_block_that_needs_its_cached_keys_keeps_keys():
    """A value residual mixes in the first block's cached values: the state keeps keys and values then, with
    the same outputs."""
    from polyformer import TransformerWrapper

    torch.manual_seed(0)
    model = perturb(TransformerWrapper(num_tokens=32, max_seq_len=32, attn_layers=Decoder(
        dim=DIM, depth=2, heads=HEADS, attn_dim_head=DIM_HEAD, add_value_residual=True, **LATENTS)))
    state = model.new_state(1, 8)
    assert not state.keeps_latents and state.k.shape[2:] == (HEADS, 8, DIM_HEAD)
    x = torch.randint(0, 32, (1, 8))
    steps = [model(x[:, :3], state=state)] + [model(x[:, t: t + 1], state=state) for t in range(3, 8)]
    assert_close(torch.cat(steps, dim=1), model(x), atol=1e-5, rtol=1e-5)
