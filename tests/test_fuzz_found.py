"""What the fuzzer (tests/test_fuzz.py) found, kept as plain regression tests."""

from __future__ import annotations

import re

import pytest
import torch

from polyformer import (AutoregressiveWrapper, ContinuousTransformerWrapper, Decoder, Encoder,
                        TransformerWrapper, ViTransformerWrapper, XTransformer)
from tests.fuzz_space import IMAGE, MAX_SEQ_LEN, NUM_TOKENS



def test_vit_refuses_a_stack_with_cross_attention():
    """Was accepted, then every forward failed: an image model has no context to give."""
    for layers in (dict(cross_attend=True), dict(only_cross=True), dict(custom_layers="acf", cross_attend=True)):
        with pytest.raises(ValueError, match="cross_attend / only_cross"):
            ViTransformerWrapper(image_size=IMAGE, patch_size=4, attn_layers=Encoder(dim=16, depth=1, **layers))


def test_xtransformer_refuses_a_decoder_context_width_other_than_dim():
    """Was accepted, then forward failed with 'context has feature size 16, expected dim_context=8'."""
    kw = dict(enc_num_tokens=8, enc_max_seq_len=8, enc_depth=1, dec_num_tokens=8, dec_max_seq_len=8, dec_depth=1)
    with pytest.raises(ValueError, match="dec_dim_context"):
        XTransformer(dim=16, dec_dim_context=8, **kw)
    XTransformer(dim=16, dec_dim_context=16, **kw)


def test_a_custom_layout_without_cross_attention_is_refused_when_cross_attend_is_set():
    """Was accepted (cross_attend silently unused); XTransformer then failed at forward ('context was
    given but the stack has no cross-attention')."""
    with pytest.raises(ValueError, match=r"cross_attend=True .*custom_layers=\('a', 'f'\)"):
        Decoder(dim=16, depth=1, cross_attend=True, custom_layers="af")
    with pytest.raises(ValueError, match="custom_layers"):
        XTransformer(dim=16, enc_num_tokens=8, enc_max_seq_len=8, enc_depth=1, dec_num_tokens=8, dec_max_seq_len=8,
                     dec_depth=1, dec_custom_layers="af")
    Decoder(dim=16, depth=1, cross_attend=True, custom_layers="acf")


def test_a_wrong_shift_tokens_tuple_names_the_keywords_that_set_the_layout():
    """The message said only '3 blocks, got 2': cross_attend, which made the third block, was not named."""
    with pytest.raises(ValueError, match=r"3 blocks \('a', 'c', 'f'\) \(from depth, .*cross_attend"):
        Decoder(dim=16, depth=1, cross_attend=True, shift_tokens=(1, 0))


def test_attn_flash_refusal_names_the_public_keyword_of_the_normaliser():
    """The message said "attn normalize='topk'", a config field, instead of attn_sparse_topk."""
    with pytest.raises(ValueError, match="attn_sparse_topk=2"):
        Encoder(dim=16, depth=1, attn_flash=True, attn_sparse_topk=2)
    with pytest.raises(ValueError, match="attn_use_entmax15=True"):
        Encoder(dim=16, depth=1, attn_flash=True, attn_use_entmax15=True)


def test_too_few_t5_buckets_names_rel_pos_bias():
    """The message named only rel_pos_num_buckets, which alone is valid: it is rel_pos_bias that uses them."""
    with pytest.raises(ValueError, match=r"rel_pos_bias=True .*rel_pos_num_buckets >= 4"):
        Encoder(dim=16, depth=1, rel_pos_bias=True, rel_pos_num_buckets=2)
    with pytest.raises(ValueError, match="rel_pos_bias is not True"):     # without rel_pos_bias: not ignored
        Encoder(dim=16, depth=1, rel_pos_num_buckets=2, rel_pos_max_distance=8)


@pytest.mark.parametrize("layout", ["f", "cf", "fcf"])
def test_a_decoder_without_self_attention_gets_a_decode_state(layout):
    """new_state raised StopIteration (it read the head sizes of the first self-attention block)."""
    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=MAX_SEQ_LEN, attn_layers=Decoder(
        dim=16, depth=1, heads=2, custom_layers=layout, cross_attend="c" in layout, shift_tokens=1)).eval()
    context = torch.randn(2, 3, 16) if "c" in layout else None
    ar = AutoregressiveWrapper(model)
    prompts = torch.randint(0, NUM_TOKENS, (2, 3))
    cached = ar.generate(prompts, 5, temperature=0.0, context=context)
    assert torch.equal(cached, ar.generate(prompts, 5, temperature=0.0, context=context, cache_kv=False))


def test_generation_refuses_a_start_that_keeps_nothing():
    """A fully masked prompt row generated differently cached and uncached (see test_numerics)."""
    from polyformer import ContinuousAutoregressiveWrapper, speculative_generate

    torch.manual_seed(0)
    net = ContinuousTransformerWrapper(dim_in=4, dim_out=4, max_seq_len=8, attn_layers=Decoder(dim=16, depth=1))
    mask = torch.tensor([[True, True], [False, False]])
    with pytest.raises(ValueError, match="without any kept"):
        ContinuousAutoregressiveWrapper(net).generate(torch.randn(2, 2, 4), 3, mask=mask)
    lm = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=MAX_SEQ_LEN, attn_layers=Decoder(dim=16, depth=1)).eval()
    with pytest.raises(ValueError, match="without any kept token"):
        speculative_generate(lm, lm, torch.randint(0, NUM_TOKENS, (2, 2)), 3, mask=mask, temperature=0.0)


def test_scalar_parameters_accept_only_a_single_value():
    """PyTorch's loader takes a (1,) tensor for a 0-dim parameter (ReZero's g, ScaleNorm's g): the same
    single value, kept for old checkpoints; any other shape is named like every other mismatch."""
    model = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=MAX_SEQ_LEN,
                               attn_layers=Decoder(dim=16, depth=1, use_rezero=True))
    sd = model.state_dict()
    key = "attn_layers.blocks.0.combine.g"
    assert sd[key].ndim == 0
    model.load_state_dict({**sd, key: torch.tensor([0.5])})
    assert float(model.state_dict()[key]) == 0.5
    with pytest.raises(RuntimeError, match=f"size mismatch for {re.escape(key)}"):
        model.load_state_dict({**sd, key: torch.tensor([0.5, 0.5])})


def test_hard_attention_over_an_empty_context_gives_zeros():
    """Found by the fuzzer: attn_hard's argmax over a cross-attention context of length 0 raised IndexError."""
    torch.manual_seed(0)
    model = ContinuousTransformerWrapper(dim_in=4, dim_out=4, max_seq_len=8, attn_layers=Decoder(
        dim=16, depth=1, heads=1, cross_attend=True, attn_hard=True))
    x, context = torch.randn(2, 3, 4), torch.randn(2, 0, 16)
    out = model(x, context=context)
    assert out.isfinite().all()
    out.sum().backward()
