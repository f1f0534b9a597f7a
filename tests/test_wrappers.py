"""The wrappers: memory tokens, Transformer-XL memories (rel-pos and rotary), shift_mem_down,
mem_masks, tied embeddings, absolute positions, ViT, continuous in/out, XTransformer,
CrossAttender, AutoregressiveWrapper loss and greedy generation."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange
from torch.testing import assert_close

from polyformer import (AutoregressiveWrapper, ContinuousTransformerWrapper, CrossAttender, Encoder,
                        ViTransformerWrapper, XTransformer)
from polyformer.embedding import LearnedPositions
from tests.helpers import ids, tiny_lm

DIM = 32


# ---------------------------------------------------------------- memory tokens


def test_memory_tokens_are_prepended_and_dropped():
    model = tiny_lm(num_memory_tokens=3)
    x = ids(2, 10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False
    logits = model(x, mask=mask)
    assert logits.shape[1] == x.shape[1]
    # manual: absolute positions on the tokens, then the memory in front, always visible
    h = model.token_emb(x) + model.pos_emb(torch.arange(10)[None])
    mem = model.memory_tokens.tokens.expand(2, -1, -1)
    full_mask = torch.cat((torch.ones(2, 3, dtype=torch.bool), mask), dim=1)
    out = model.attn_layers(torch.cat((mem, h), dim=1), mask=full_mask)[:, 3:]
    assert_close(logits, model.to_logits(out))


def test_memory_tokens_matter():
    model = tiny_lm(num_memory_tokens=3)
    x = ids(2, 10)
    before = model(x)
    with torch.no_grad():
        model.memory_tokens.tokens.add_(torch.randn_like(model.memory_tokens.tokens))
    assert not torch.allclose(model(x), before)


# ---------------------------------------------------------------- Transformer-XL


@pytest.mark.parametrize("positions", [dict(rel_pos_bias=True), dict(rotary_pos_emb=True),
                                       dict(alibi_pos_emb=True), dict(position_infused_attn=True),
                                       dict(rel_pos_bias=True, attn_num_mem_kv=2)],
                         ids=["rel_pos_bias", "rotary", "alibi", "position_infused", "rel_pos_bias+mem_kv"])
def test_xl_memory_equals_one_long_forward(positions):
    model = tiny_lm(depth=2, max_mem_len=8, **positions)
    seq = ids(2, 12)
    seg1, seg2 = seq[:, :6], seq[:, 6:]
    logits1, mems1 = model(seg1, return_mems=True)
    logits2 = model(seg2, mems=mems1)
    full = model(seq)
    assert_close(logits1, full[:, :6], atol=1e-5, rtol=1e-5)
    assert_close(logits2, full[:, 6:], atol=1e-5, rtol=1e-5)
    # and the memory is what makes it so
    assert not torch.allclose(model(seg2), full[:, 6:], atol=1e-3)


def test_xl_padding_carries_over_through_mem_masks():
    """A left-padded first segment: its padding stays hidden from the second segment when the
    segment's mask is passed along as mem_masks."""
    model = tiny_lm(depth=2, max_mem_len=8, rel_pos_bias=True)
    seq = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :3] = False
    _, mems = model(seq[:, :6], mask=mask[:, :6], return_mems=True)
    logits2 = model(seq[:, 6:], mask=mask[:, 6:], mems=mems, mem_masks=mask[:, :6])
    assert_close(logits2, model(seq, mask=mask)[:, 6:], atol=1e-5, rtol=1e-5)


def test_xl_chain_of_three_without_truncation():
    model = tiny_lm(depth=2, max_mem_len=8, rel_pos_bias=True)
    seq = ids(2, 12)
    segs = seq.split(4, dim=1)
    mems, outs = None, []
    for seg in segs:
        logits, mems = model(seg, mems=mems, return_mems=True)
        outs.append(logits)
    assert_close(torch.cat(outs, dim=1), model(seq), atol=1e-5, rtol=1e-5)


def test_xl_chain_with_truncation_is_a_sliding_window():
    """One layer, max_mem_len=3, segments of 4: each segment sees exactly the 3 tokens before it,
    so its logits equal a forward over (last 3 tokens of the previous segment + the segment)."""
    model = tiny_lm(depth=1, max_mem_len=3, rel_pos_bias=True)
    seq = ids(2, 12)
    segs = seq.split(4, dim=1)
    mems = None
    for i, seg in enumerate(segs):
        logits, mems = model(seg, mems=mems, return_mems=True)
        assert all(m.shape[1] == 3 for m in mems)
        if i == 0:
            assert_close(logits, model(seg))
        else:
            window = torch.cat((segs[i - 1][:, -3:], seg), dim=1)
            assert_close(logits, model(window)[:, 3:], atol=1e-5, rtol=1e-5)
    # with the whole history instead, the last segment would differ
    assert not torch.allclose(logits, model(seq)[:, 8:], atol=1e-4)


def test_return_mems_are_detached_and_bounded():
    model = tiny_lm(depth=2, max_mem_len=5, rel_pos_bias=True).train()
    seg1, seg2 = ids(2, 4), ids(2, 4, seed=1)
    _, mems1 = model(seg1, return_mems=True)
    _, mems2 = model(seg2, mems=mems1, return_mems=True)
    assert len(mems1) == len(mems2) == model.attn_layers.num_self_attn == 2
    for m1, m2 in zip(mems1, mems2):
        assert not m1.requires_grad and not m2.requires_grad and m2.grad_fn is None
        assert m1.shape[1] == 4 and m2.shape[1] == 5      # min(total seen, max_mem_len)
        assert_close(m2[:, :1], m1[:, -1:])               # the newest old memory is kept, the rest dropped
    # the memory of each layer is that layer's (normalised) input
    _, record = model(seg1, return_intermediates=True)
    blocks = model.attn_layers.blocks
    assert_close(mems1[0], blocks[0].norm_in(record.hiddens[0]))
    assert_close(mems1[1], blocks[2].norm_in(record.hiddens[2]))


def test_shift_mem_down_routes_memories_one_layer_down():
    torch.manual_seed(0)
    shifted = tiny_lm(depth=2, max_mem_len=8, shift_mem_down=1, rel_pos_bias=True)
    plain = tiny_lm(depth=2, max_mem_len=8, rel_pos_bias=True)
    plain.load_state_dict(shifted.state_dict())
    seg1, seg2 = ids(2, 6), ids(2, 6, seed=1)
    logits1, m1 = shifted(seg1, return_mems=True)
    assert_close(logits1, plain(seg1))
    rotated = m1[1:] + m1[:1]                 # layer 0 reads layer 1's memory, layer 1 wraps to layer 0's
    out, new = shifted(seg2, mems=m1, return_mems=True)
    ref, ref_new = plain(seg2, mems=rotated, return_mems=True)
    assert_close(out, ref)
    for a, b in zip(new, ref_new):
        assert_close(a, b)
    assert not torch.allclose(out, plain(seg2, mems=m1))


def test_all_false_mem_masks_equal_no_memory():
    model = tiny_lm(depth=2, max_mem_len=8, rel_pos_bias=True)
    seg1, seg2 = ids(2, 6), ids(2, 6, seed=1)
    _, mems = model(seg1, return_mems=True)
    hidden = torch.zeros(2, 6, dtype=torch.bool)
    alone = model(seg2)
    assert_close(model(seg2, mems=mems, mem_masks=[hidden, hidden]), alone)
    assert_close(model(seg2, mems=mems, mem_masks=hidden), alone)
    # masking the first two memory slots equals dropping them
    partial = torch.ones(2, 6, dtype=torch.bool)
    partial[:, :2] = False
    assert_close(model(seg2, mems=mems, mem_masks=partial), model(seg2, mems=[m[:, 2:] for m in mems]))
    assert not torch.allclose(model(seg2, mems=mems), alone)


def test_each_block_reads_its_own_mem_mask():
    model = tiny_lm(depth=2, max_mem_len=8, rel_pos_bias=True)
    seg1, seg2 = ids(2, 6), ids(2, 6, seed=1)
    _, mems = model(seg1, return_mems=True)
    partial = torch.ones(2, 6, dtype=torch.bool)
    partial[:, :2] = False
    masks = [torch.ones(2, 6, dtype=torch.bool), partial]       # block 1 hides its first two slots
    changed = [mems[0], mems[1].clone()]
    changed[1][:, :2] += 1.0
    assert_close(model(seg2, mems=changed, mem_masks=masks), model(seg2, mems=mems, mem_masks=masks))
    assert not torch.allclose(model(seg2, mems=changed), model(seg2, mems=mems))


# ---------------------------------------------------------------- embeddings and positions


def test_tie_embedding():
    model = tiny_lm(tie_embedding=True)
    assert model.to_logits is None
    x = ids(2, 10)
    emb = model(x, return_embeddings=True)
    assert_close(model(x), emb @ model.token_emb.weight.T)
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("to_logits") for n in names)


def test_emb_dim_projects_in():
    model = tiny_lm(emb_dim=24)
    x = ids(2, 10)
    assert model.token_emb.weight.shape[1] == 24
    h = model.project_emb(model.token_emb(x)) + model.pos_emb(torch.arange(10)[None])
    assert_close(model(x), model.to_logits(model.attn_layers(h)))


@pytest.mark.parametrize("positions", [dict(rotary_pos_emb=True), dict(alibi_pos_emb=True),
                                       dict(rel_pos_bias=True), dict(position_infused_attn=True)])
def test_abs_pos_emb_off_when_the_stack_has_positions(positions):
    model = tiny_lm(**positions)
    assert model.pos_emb is None
    assert not any("pos_emb" in n for n, _ in model.named_parameters())
    # still position aware: an encoder with these is not permutation-equivariant
    enc = tiny_lm(Encoder, **positions)
    x = ids(2, 10)
    perm = torch.randperm(10)
    assert not torch.allclose(enc(x[:, perm]), enc(x)[:, perm], atol=1e-4)
    # explicitly asked for, learned positions come back beside a relative scheme; beside the
    # (absolute) position-infused sinusoids they would be a second absolute scheme
    if "position_infused_attn" in positions:
        with pytest.raises(ValueError, match="two absolute"):
            tiny_lm(use_abs_pos_emb=True, **positions)
    else:
        assert isinstance(tiny_lm(use_abs_pos_emb=True, **positions).pos_emb, LearnedPositions)


def test_abs_pos_emb_on_for_a_plain_stack():
    model = tiny_lm()
    assert isinstance(model.pos_emb, LearnedPositions)
    x = ids(2, 10)
    before = model(x)
    with torch.no_grad():
        model.pos_emb.emb.weight.zero_()
    assert not torch.allclose(model(x), before)


def test_no_positions_encoder_is_permutation_equivariant():
    enc = tiny_lm(Encoder, use_abs_pos_emb=False)
    assert enc.pos_emb is None
    x = ids(2, 10)
    perm = torch.randperm(10)
    assert_close(enc(x[:, perm]), enc(x)[:, perm])
    with_pos = tiny_lm(Encoder)
    assert not torch.allclose(with_pos(x[:, perm]), with_pos(x)[:, perm], atol=1e-4)


def test_scaled_sinu_pos_emb_adds_scaled_sinusoids():
    model = tiny_lm(scaled_sinu_pos_emb=True)
    assert_close(model.pos_emb.scale, torch.tensor(DIM ** -0.5))
    x = ids(1, 10)
    pos = torch.arange(10, dtype=torch.float32)[:, None]
    freq = 10000 ** (-torch.arange(16, dtype=torch.float32) / 16)
    sinus = torch.cat(((pos * freq).sin(), (pos * freq).cos()), dim=-1) * DIM ** -0.5
    h = model.token_emb(x) + sinus
    assert_close(model(x), model.to_logits(model.attn_layers(h)))


# ---------------------------------------------------------------- ViT


def vit():
    return ViTransformerWrapper(image_size=8, patch_size=4, num_classes=5,
                                attn_layers=Encoder(dim=DIM, depth=1, heads=4)).eval()


def test_vit_class_logits_come_from_the_class_token():
    model = vit()
    img = torch.randn(2, 3, 8, 8)
    emb = model(img, return_embeddings=True)
    assert emb.shape[1] == 1 + 4
    assert_close(model(img), model.mlp_head(emb[:, 0]))
    # the class token's vector matters
    before = model(img)
    with torch.no_grad():
        model.cls_token.add_(torch.randn_like(model.cls_token))    # not a constant: LayerNorm removes those
    assert not torch.allclose(model(img), before)


def test_vit_patches_matter_only_through_their_positions():
    model = vit()
    img = torch.randn(2, 3, 8, 8)
    patches = rearrange(img, "b c (h p1) (w p2) -> b (h w) c p1 p2", p1=4, p2=4)
    perm = torch.tensor([2, 0, 3, 1])
    shuffled = rearrange(patches[:, perm], "b (h w) c p1 p2 -> b c (h p1) (w p2)", h=2)
    before = model(img)
    assert not torch.allclose(model(shuffled), before)
    with torch.no_grad():                     # move each position vector with its patch
        model.pos_emb[:, 1:] = model.pos_emb[:, 1:][:, perm].clone()
    assert_close(model(shuffled), before)


# ---------------------------------------------------------------- continuous


def test_continuous_wrapper_projections():
    model = ContinuousTransformerWrapper(dim_in=5, dim_out=7, max_seq_len=16,
                                         attn_layers=Encoder(dim=DIM, depth=1, heads=4)).eval()
    x = torch.randn(2, 10, 5)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 8:] = False
    h = model.project_in(x) + model.pos_emb(torch.arange(10)[None])
    expected = model.project_out(model.attn_layers(h, mask=mask))
    assert_close(model(x, mask=mask), expected)
    assert_close(model(x, mask=mask, return_embeddings=True), model.attn_layers(h, mask=mask))


# ---------------------------------------------------------------- XTransformer


def xtransformer(**kw):
    return XTransformer(dim=DIM, enc_num_tokens=64, enc_depth=1, enc_heads=4, enc_max_seq_len=16,
                        dec_num_tokens=64, dec_depth=kw.pop("dec_depth", 1), dec_heads=4,
                        dec_max_seq_len=16, **kw).eval()


def test_xtransformer_loss_is_encoder_then_decoder_cross_entropy():
    model = xtransformer()
    src, tgt = ids(2, 10), ids(2, 8, seed=1)
    src_mask = torch.ones(2, 10, dtype=torch.bool)
    src_mask[1, 6:] = False
    enc, dec = model.encoder, model.decoder.net
    encoded = enc.attn_layers(enc.token_emb(src) + enc.pos_emb(torch.arange(10)[None]), mask=src_mask)
    h = dec.token_emb(tgt[:, :-1]) + dec.pos_emb(torch.arange(7)[None])
    logits = dec.to_logits(dec.attn_layers(h, context=encoded, context_mask=src_mask))
    manual = -logits.log_softmax(-1).gather(-1, tgt[:, 1:, None]).mean()
    assert_close(model(src, tgt, src_mask=src_mask), manual)
    # masked source tokens are invisible to the loss
    other = src.clone()
    other[1, 6:] = (other[1, 6:] + 1) % 64
    assert_close(model(other, tgt, src_mask=src_mask), manual)
    assert not torch.allclose(model(other, tgt), model(src, tgt))


def test_xtransformer_tie_token_emb():
    model = xtransformer(tie_token_emb=True)
    assert model.encoder.token_emb is model.decoder.net.token_emb
    params = list(model.parameters())
    assert sum(p is model.encoder.token_emb.weight for p in params) == 1
    untied = xtransformer()
    assert untied.encoder.token_emb is not untied.decoder.net.token_emb


def test_xtransformer_dec_cross_residual_attn():
    torch.manual_seed(0)
    model = xtransformer(dec_depth=2, dec_cross_residual_attn=True)
    plain = xtransformer(dec_depth=2)
    plain.load_state_dict(model.state_dict())
    assert model.decoder.net.attn_layers.cfg.cross_residual_attn
    src, tgt = ids(2, 10), ids(2, 8, seed=1)
    loss = model(src, tgt)
    assert torch.isfinite(loss)
    assert not torch.allclose(loss, plain(src, tgt))       # the second cross block adds the first's scores


@pytest.mark.parametrize("side", ["enc", "dec"])
def test_xtransformer_forwards_every_wrapper_keyword(side):
    """Each side's wrapper gets its own positional keywords (they were dropped into the layers before)."""
    model = xtransformer(**{f"{side}_abs_pos_per_layer": True, f"{side}_use_abs_pos_emb": False})
    wrapper = model.encoder if side == "enc" else model.decoder.net
    other = model.decoder.net if side == "enc" else model.encoder
    assert wrapper.attn_layers.layer_pos is not None and other.attn_layers.layer_pos is None
    src, tgt = ids(2, 10), ids(2, 8, seed=1)
    before = model(src, tgt)
    with torch.no_grad():
        for p in wrapper.attn_layers.layer_pos.parameters():
            p.add_(torch.randn_like(p))
    assert not torch.allclose(before, model(src, tgt))      # the per-layer table feeds that side

# ---------------------------------------------------------------- CrossAttender


def test_cross_attender_queries_do_not_see_each_other():
    stack = CrossAttender(dim=DIM, depth=2, heads=4).eval()
    assert stack.layout == ("c", "f") * 2
    nodes, context = torch.randn(2, 6, DIM), torch.randn(2, 8, DIM)
    out = stack(nodes, context=context)
    other = nodes.clone()
    other[:, 1:] = torch.randn(2, 5, DIM)
    assert_close(stack(other, context=context)[:, 0], out[:, 0])
    assert not torch.allclose(stack(nodes, context=context + 1.0), out)


# ---------------------------------------------------------------- autoregressive wrapper


def test_autoregressive_loss_is_shifted_cross_entropy_with_ignore_index():
    net = tiny_lm()
    ar = AutoregressiveWrapper(net, ignore_index=0)
    x = ids(2, 12)
    x[0, 5] = 0
    x[1, 9:] = 0
    logits = net(x[:, :-1])
    target = x[:, 1:]
    nll = -logits.log_softmax(-1).gather(-1, target[..., None])[..., 0]
    keep = target != 0
    assert keep.sum() < keep.numel()
    assert_close(ar(x), nll[keep].mean())
    # ignoring is not a no-op here: the mean over every target differs
    assert not torch.allclose(ar(x), nll.mean())


def test_generate_temperature_zero_is_greedy():
    net = tiny_lm()
    ar = AutoregressiveWrapper(net)
    prompt = ids(2, 3)
    for filt in (None, "default"):
        kwargs = {} if filt == "default" else dict(filter_logits_fn=None)
        out = ar.generate(prompt, 6, temperature=0.0, **kwargs)
        seq = prompt
        for _ in range(6):
            nxt = net(seq)[:, -1].argmax(-1)
            seq = torch.cat((seq, nxt[:, None]), dim=1)
        assert torch.equal(out, seq[:, 3:])
