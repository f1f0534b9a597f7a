"""x-transformers 2.x calls: XTransformer.forward(src, tgt, mask=, attn_mask=, src_prepend_embeds=), the stack's
attn_mask, and AutoregressiveWrapper(mask_prob=) (forgetful causal masking, arXiv:2210.13432)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, TransformerWrapper, XTransformer
from polyformer.generate import forgetful
from tests.helpers import ids, tiny_encoder, tiny_lm

DIM = 32


def xtransformer(**kw) -> XTransformer:
    torch.manual_seed(0)
    return XTransformer(dim=DIM, enc_num_tokens=64, enc_depth=2, enc_heads=4, enc_max_seq_len=16,
                        enc_rotary_pos_emb=True, enc_use_abs_pos_emb=False, dec_num_tokens=64, dec_depth=1,
                        dec_heads=4, dec_max_seq_len=16, **kw).eval()


def block_diagonal(*sizes: int) -> torch.Tensor:
    return torch.block_diag(*[torch.ones(s, s) for s in sizes]).bool()


# ---------------------------------------------------------------- XTransformer.forward's arguments


def test_mask_is_the_source_mask_under_either_name():
    model = xtransformer()
    src, tgt = ids(2, 10), ids(2, 8, seed=1)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    want = model(src, tgt, src_mask=mask)
    assert_close(model(src, tgt, mask=mask), want)
    assert_close(model(src, tgt, mask), want)                  # x-transformers' third positional argument
    assert not torch.allclose(model(src, tgt), want)
    with pytest.raises(TypeError, match="mask= or as src_mask="):
        model(src, tgt, mask=mask, src_mask=mask)
    start = ids(2, 1, seed=2)
    assert torch.equal(model.generate(src, start, 4, mask=mask, temperature=0.0),
                       model.generate(src, start, 4, src_mask=mask, temperature=0.0))


def test_attn_mask_packs_two_sources_into_one_row():
    """A block-diagonal encoder attn_mask makes each block encode as if alone (rotary: relative positions),
    so the decoder's loss equals the one on the two encodings joined."""
    model = xtransformer()
    src, tgt = ids(2, 10), ids(2, 8, seed=1)
    attn_mask = block_diagonal(6, 4)
    apart = torch.cat((model.encoder(src[:, :6], return_embeddings=True),
                       model.encoder(src[:, 6:], return_embeddings=True)), dim=1)
    assert_close(model.encoder(src, attn_mask=attn_mask, return_embeddings=True), apart, atol=1e-5, rtol=1e-5)
    assert_close(model(src, tgt, attn_mask=attn_mask), model.decoder(tgt, context=apart), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model(src, tgt), model(src, tgt, attn_mask=attn_mask))
    start = ids(2, 1, seed=2)
    assert torch.equal(model.generate(src, start, 4, attn_mask=attn_mask, temperature=0.0),
                       model.decoder.generate(start, 4, context=apart, temperature=0.0))


@pytest.mark.skipif("prepend_embeds" not in inspect.signature(TransformerWrapper.forward).parameters,
                    reason="TransformerWrapper.forward(prepend_embeds=) is not there yet")
def test_src_prepend_embeds_are_read_before_the_source_and_stay_visible():
    model = xtransformer()
    src, tgt = ids(2, 6), ids(2, 8, seed=1)
    extra = torch.randn(2, 3, DIM)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    encoded = model.encoder(src, mask=mask, prepend_embeds=extra, return_embeddings=True)
    assert encoded.shape[1] == 9
    context_mask = torch.cat((torch.ones(2, 3, dtype=torch.bool), mask), dim=1)
    assert_close(model(src, tgt, mask=mask, src_prepend_embeds=extra),
                 model.decoder(tgt, context=encoded, context_mask=context_mask))


# ---------------------------------------------------------------- the stack's attn_mask


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_block_diagonal_attn_mask_equals_separate_runs(stack):
    """Causal or not, each block of a block-diagonal mask gives what it gives alone (rotary: relative positions)."""
    build = tiny_encoder if stack == "encoder" else tiny_lm
    model = build(seed=0, depth=2, rotary_pos_emb=True, use_abs_pos_emb=False)
    x = ids(2, 9)
    out = model(x, attn_mask=block_diagonal(5, 4))
    assert_close(out[:, :5], model(x[:, :5]), atol=1e-5, rtol=1e-5)
    assert_close(out[:, 5:], model(x[:, 5:]), atol=1e-5, rtol=1e-5)


def test_attn_mask_leaves_memory_tokens_visible():
    """The mask covers the text; memory tokens see and are seen by every position (depth 1: their outputs
    are never read, so the first block, at the same positions, equals its run alone)."""
    model = tiny_encoder(seed=0, depth=1, num_memory_tokens=2)
    x = ids(2, 9)
    out = model(x, attn_mask=block_diagonal(5, 4))
    assert_close(out[:, :5], model(x[:, :5]), atol=1e-5, rtol=1e-5)


def test_attn_mask_per_head_and_per_row():
    model = tiny_encoder(seed=0, depth=2, heads=4)
    x = ids(2, 8)
    rows = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.4
    rows |= torch.eye(8, dtype=torch.bool)
    per_row = model(x, attn_mask=rows[:, None])                         # (b, 1, i, j)
    assert_close(per_row[0], model(x[:1], attn_mask=rows[0])[0])
    assert_close(per_row[1], model(x[1:], attn_mask=rows[1])[0])
    assert_close(model(x, attn_mask=rows[0][None].expand(4, 8, 8)), model(x, attn_mask=rows[0]))   # (h, i, j)
    heads = rows[0][None].repeat(4, 1, 1)
    heads[2] = torch.eye(8, dtype=torch.bool)                           # one head sees only its own token
    assert not torch.allclose(model(x, attn_mask=heads), model(x, attn_mask=rows[0]))


def test_attn_mask_hides_keys_exactly():
    """A query's output does not change when a key hidden from it changes (first layer's keys: depth 1)."""
    model = tiny_encoder(seed=0, depth=1)
    x = ids(1, 8)
    attn_mask = torch.ones(8, 8, dtype=torch.bool)
    attn_mask[:4, 6] = False                    # queries 0-3 never see key 6
    y = x.clone()
    y[0, 6] = (y[0, 6] + 1) % 64
    a, b = model(x, attn_mask=attn_mask), model(y, attn_mask=attn_mask)
    assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:6], b[:, 4:6])


def test_attn_mask_bad_input():
    model = tiny_encoder(seed=0, depth=1)
    x = ids(2, 8)
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        model(x, attn_mask=torch.ones(8, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="heads axis"):
        model(x, attn_mask=torch.ones(3, 8, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be a bool tensor"):
        model(x, attn_mask=torch.ones(8, 8))
    linear = tiny_lm(seed=0, depth=1, attn_linear="elu")
    with pytest.raises(ValueError, match="attn_mask cannot be used here.*'linear'"):
        linear(x, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    windowed = tiny_lm(seed=0, depth=1, attn_window=4)
    with pytest.raises(ValueError, match="attention pattern"):
        windowed(x, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    lm = tiny_lm(seed=0, depth=1)
    state = lm.new_state(2, 8)
    with pytest.raises(ValueError, match="decode state"):
        lm(x, state=state, attn_mask=torch.ones(8, 8, dtype=torch.bool))


# ---------------------------------------------------------------- mask_prob: forgetful causal masking


def test_hidden_keys_count_and_first_token():
    keep = forgetful.hidden_keys(64, 10, 0.35, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert bool(keep[:, 0].all())                                   # every query still sees the first token
    assert torch.equal((~keep).sum(-1), torch.full((64,), 3))       # floor(10 * 0.35) per row
    assert len({tuple(row.tolist()) for row in keep}) > 10          # drawn per row
    many = forgetful.hidden_keys(4, 5, 0.99, torch.device("cpu"))
    assert torch.equal(many.sum(-1), torch.ones(4, dtype=torch.long))   # at most n - 1 hidden


def test_mask_prob_loss_is_the_loss_with_those_keys_hidden():
    torch.manual_seed(0)
    net = TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=Decoder(dim=DIM, depth=2, heads=4))
    model = AutoregressiveWrapper(net, mask_prob=0.3).train()
    x = ids(2, 12)
    torch.manual_seed(5)
    loss = model(x)
    torch.manual_seed(5)
    keep = forgetful.hidden_keys(2, 11, 0.3, x.device)
    logits = net(x[:, :-1], attn_mask=forgetful.attn_mask(keep))
    assert_close(loss, F.cross_entropy(logits.transpose(1, 2), x[:, 1:]))
    plain = F.cross_entropy(net(x[:, :-1]).transpose(1, 2), x[:, 1:])
    assert not torch.allclose(loss, plain)
    assert_close(model.eval()(x), plain)                          # evaluation scores the whole context


def test_hidden_tokens_reach_no_other_position():
    net = tiny_lm(seed=0, depth=2)
    keep = forgetful.hidden_keys(1, 10, 0.3, torch.device("cpu"), torch.Generator().manual_seed(3))
    j = int((~keep[0]).nonzero()[0])
    x = ids(1, 10)
    y = x.clone()
    y[0, j] = (y[0, j] + 1) % 64
    a, b = (net(t, attn_mask=forgetful.attn_mask(keep)) for t in (x, y))
    others = torch.arange(10) != j
    assert_close(a[:, others], b[:, others])
    assert not torch.allclose(a[:, j], b[:, j])                  # its own position reads it through the residual


def test_mask_prob_refusals():
    net = tiny_lm(seed=0, depth=1)
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match="mask_prob must be a fraction"):
            AutoregressiveWrapper(net, mask_prob=bad)
    with pytest.raises(ValueError, match="mask_prob=0.1 masks self-attention keys.*'linear'"):
        AutoregressiveWrapper(tiny_lm(seed=0, depth=1, attn_linear="elu"), mask_prob=0.1)


# ---------------------------------------------------------------- ContinuousAutoregressiveWrapper, probabilistic


def probabilistic_model():
    from polyformer import ContinuousAutoregressiveWrapper, ContinuousTransformerWrapper

    torch.manual_seed(0)
    net = ContinuousTransformerWrapper(dim_in=4, dim_out=4, max_seq_len=16, probabilistic=True,
                                       attn_layers=Decoder(dim=DIM, depth=2, heads=4, rotary_pos_emb=True))
    return ContinuousAutoregressiveWrapper(net).eval()


def test_probabilistic_loss_is_the_gaussian_nll():
    model = probabilistic_model()
    x = torch.randn(2, 9, 4)
    mean, var = (t.double() for t in model.net(x[:, :-1]))
    nll = 0.5 * (var.log() + (x[:, 1:].double() - mean) ** 2 / var)                  # (b, n, d)
    assert_close(model(x).double(), nll.mean(), rtol=1e-5, atol=1e-6)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    mean, var = (t.double() for t in model.net(x[:, :-1], mask=mask[:, :-1]))
    nll = 0.5 * (var.log() + (x[:, 1:].double() - mean) ** 2 / var)
    assert_close(model(x, mask=mask).double(), nll[mask[:, 1:]].mean(), rtol=1e-5, atol=1e-6)


def test_probabilistic_generation_samples_the_gaussian_and_caches_exactly():
    model = probabilistic_model()
    start = torch.randn(2, 3, 4)
    torch.manual_seed(1)
    cached = model.generate(start, 5)
    torch.manual_seed(1)
    assert_close(model.generate(start, 5, cache_kv=False), cached, atol=1e-5, rtol=1e-5)
    greedy = model.generate(start, 3, temperature=0.0)          # temperature 0 follows the means
    seq = start
    for _ in range(3):
        seq = torch.cat((seq, model.net(seq)[0][:, -1:]), dim=1)
    assert_close(greedy, seq[:, 3:], atol=1e-5, rtol=1e-5)
    torch.manual_seed(2)
    one = model.generate(start[:1].expand(4000, -1, -1), 1)[:, 0]           # (4000, 4) draws of the first step
    mean, var = (t[0, -1] for t in model.net(start[:1]))
    assert_close(one.mean(0), mean, atol=4 * (var.max().sqrt() / 60).item(), rtol=0)
    assert_close(one.var(0), var, rtol=0.1, atol=1e-4)


def test_temperature_needs_a_probabilistic_net():
    from polyformer import ContinuousAutoregressiveWrapper, ContinuousTransformerWrapper

    net = ContinuousTransformerWrapper(dim_in=4, dim_out=4, max_seq_len=16, attn_layers=Decoder(dim=DIM, depth=1))
    with pytest.raises(ValueError, match="temperature"):
        ContinuousAutoregressiveWrapper(net).generate(torch.randn(1, 2, 4), 2, temperature=0.5)
