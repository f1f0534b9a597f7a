"""Bad input fails early (polyformer/checks.py and the wrappers' own checks): the right exception
type, a message naming the argument, and no block of the stack ever runs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from polyformer import (
    AutoregressiveWrapper,
    ContinuousTransformerWrapper,
    CrossAttender,
    Decoder,
    Encoder,
    TransformerWrapper,
    ViTransformerWrapper,
    XTransformer,
)
from polyformer.embedding import PatchEmbedding
from polyformer.generate.sampling import min_p, top_k, top_p
from polyformer.stack import Block

DIM = 32
NUM_TOKENS = 64


class ComputeRan(AssertionError):
    pass


def _boom(module, args):
    raise ComputeRan(f"{type(module).__name__} ran before the input was refused")


def guard(model: nn.Module) -> nn.Module:
    """Make every block (and the patch embedding) raise if it runs: checks must come first."""
    for m in model.modules():
        if isinstance(m, (Block, PatchEmbedding)):
            m.register_forward_pre_hook(_boom)
    return model


def lm(stack=Decoder, **wrapper) -> TransformerWrapper:
    layers = wrapper.pop("layers", {})
    model = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16,
                               attn_layers=stack(dim=DIM, depth=2, heads=4, **layers), **wrapper)
    return guard(model.eval())


def ids(b=2, n=8):
    return torch.randint(0, NUM_TOKENS, (b, n))


@contextlib.contextmanager
def refused(exc, *parts):
    """pytest.raises(exc), then every part must be in the message."""
    with pytest.raises(exc) as err:
        yield err
    msg = str(err.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"


# ------------------------------------------------------------------------------------------------
# token ids

@pytest.mark.parametrize("bad", [-1, -7, NUM_TOKENS, NUM_TOKENS + 5, 10**6])
def test_token_id_out_of_range(bad):
    x = ids()
    x[1, 3] = bad
    with refused(ValueError, "x", str(bad), f"num_tokens={NUM_TOKENS}"):
        lm()(x)


def test_token_id_out_of_range_under_vmap():
    """vmap cannot read values, so our check steps aside there; the embedding's own index check still
    refuses the id (per-sample gradients batch over token ids this way)."""
    torch.manual_seed(0)
    x = ids()
    model = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16, attn_layers=Decoder(dim=DIM, depth=1, heads=4))
    torch.func.vmap(lambda t: model(t[None]))(x)
    x[1, 3] = NUM_TOKENS
    with pytest.raises(IndexError, match="out of range"):
        torch.func.vmap(lambda t: model(t[None]))(x)


def test_float_token_ids():
    with refused(TypeError, "x", "float"):
        lm()(ids().float())


def test_bool_token_ids():
    with refused(TypeError, "x"):
        lm()(ids() > 3)


def test_not_a_tensor():
    with refused(TypeError, "x", "Tensor"):
        lm()(ids().tolist())


@pytest.mark.parametrize("shape", [(8,), (2, 8, 1), ()])
def test_token_ids_wrong_rank(shape):
    with refused(ValueError, "x", "(batch, seq)"):
        lm()(torch.zeros(shape, dtype=torch.long))


def test_empty_sequence():
    with refused(ValueError, "x", "at least one"):
        lm()(torch.zeros(2, 0, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# masks

def test_mask_not_bool():
    with refused(TypeError, "mask", "bool"):
        lm()(ids(), mask=torch.ones(2, 8))
    with refused(TypeError, "mask", "bool"):
        lm()(ids(), mask=torch.ones(2, 8, dtype=torch.long))


@pytest.mark.parametrize("shape", [(2, 7), (1, 8), (2, 8, 1), (8,)])
def test_mask_wrong_shape(shape):
    with refused(ValueError, "mask", "(2, 8)"):
        lm()(ids(), mask=torch.ones(shape, dtype=torch.bool))


def test_stack_mask_checks():
    stack = guard(Encoder(dim=DIM, depth=2))
    x = torch.randn(2, 8, DIM)
    with refused(TypeError, "mask"):
        stack(x, mask=torch.ones(2, 8))
    with refused(ValueError, "mask"):
        stack(x, mask=torch.ones(2, 9, dtype=torch.bool))


def test_stack_x_checks():
    stack = guard(Encoder(dim=DIM, depth=2))
    with refused(TypeError, "x"):
        stack(torch.ones(2, 8, DIM, dtype=torch.long))
    with refused(ValueError, "x", "(batch, seq, dim)"):
        stack(torch.randn(8, DIM))
    with refused(ValueError, "x", f"dim={DIM}"):
        stack(torch.randn(2, 8, DIM + 1))


def test_stack_pos_wrong_shape():
    stack = guard(Decoder(dim=DIM, depth=2, rotary_pos_emb=True))
    with refused(ValueError, "pos", "8"):
        stack(torch.randn(2, 8, DIM), pos=torch.arange(7)[None])
    with refused(ValueError, "pos"):
        stack(torch.randn(2, 8, DIM), pos=torch.arange(8))
    with refused(ValueError, "pos"):
        stack(torch.randn(2, 8, DIM), pos=torch.arange(8)[None].expand(3, -1))


# ------------------------------------------------------------------------------------------------
# context

def test_context_to_stack_without_cross_attend():
    with refused(ValueError, "context", "cross_attend"):
        guard(Encoder(dim=DIM, depth=2))(torch.randn(2, 8, DIM), context=torch.randn(2, 5, DIM))
    with refused(ValueError, "context", "cross_attend"):
        lm()(ids(), context=torch.randn(2, 5, DIM))


def test_cross_attend_stack_without_context():
    with refused(ValueError, "context"):
        guard(Decoder(dim=DIM, depth=2, cross_attend=True))(torch.randn(2, 8, DIM))
    with refused(ValueError, "context"):
        lm(layers=dict(cross_attend=True))(ids())
    with refused(ValueError, "context"):
        guard(CrossAttender(dim=DIM, depth=2))(torch.randn(2, 8, DIM))


def test_context_wrong_batch_size():
    with refused(ValueError, "context", "batch size", "3"):
        lm(layers=dict(cross_attend=True))(ids(), context=torch.randn(3, 5, DIM))


def test_context_wrong_feature_size():
    with refused(ValueError, "context", f"dim_context={DIM}", "16"):
        lm(layers=dict(cross_attend=True))(ids(), context=torch.randn(2, 5, 16))
    # with dim_context set, the context must have that size
    with refused(ValueError, "context", "dim_context=48"):
        lm(layers=dict(cross_attend=True, dim_context=48))(ids(), context=torch.randn(2, 5, DIM))


def test_context_wrong_rank_or_dtype():
    model = lm(layers=dict(cross_attend=True))
    with refused(ValueError, "context"):
        model(ids(), context=torch.randn(2, DIM))
    with refused(TypeError, "context"):
        model(ids(), context=torch.ones(2, 5, DIM, dtype=torch.long))


def test_context_mask_checks():
    model = lm(layers=dict(cross_attend=True))
    context = torch.randn(2, 5, DIM)
    with refused(ValueError, "context_mask", "(2, 5)"):
        model(ids(), context=context, context_mask=torch.ones(2, 4, dtype=torch.bool))
    with refused(ValueError, "context_mask"):
        model(ids(), context=context, context_mask=torch.ones(2, 8, dtype=torch.bool))
    with refused(TypeError, "context_mask"):
        model(ids(), context=context, context_mask=torch.ones(2, 5))
    with refused(ValueError, "context_mask"):
        lm()(ids(), context_mask=torch.ones(2, 5, dtype=torch.bool))


# ------------------------------------------------------------------------------------------------
# Transformer-XL memories

def xl(**kw):
    return lm(layers=dict(rel_pos_bias=True), max_mem_len=16, **kw)


def mems(n=2, b=2, m=6, d=DIM):
    return [torch.randn(b, m, d) for _ in range(n)]


def test_mems_without_max_mem_len():
    with refused(ValueError, "max_mem_len"):
        lm()(ids(), mems=mems())


def test_return_mems_without_max_mem_len():
    with refused(ValueError, "max_mem_len"):
        lm()(ids(), return_mems=True)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_mems_wrong_length(n):
    with refused(ValueError, "mems", "2"):
        xl()(ids(), mems=mems(n))


def test_mems_not_a_list():
    with refused(ValueError, "mems"):
        xl()(ids(), mems=torch.randn(2, 6, DIM))


@pytest.mark.parametrize("bad", [dict(b=3), dict(d=DIM + 1)], ids=["batch", "dim"])
def test_mems_wrong_shape(bad):
    with refused(ValueError, "mems[0]"):
        xl()(ids(), mems=mems(**bad))


def test_mems_wrong_rank_and_unequal_lengths():
    with refused(ValueError, "mems[1]"):
        xl()(ids(), mems=[torch.randn(2, 6, DIM), torch.randn(6, DIM)])
    with refused(ValueError, "mems", "same length"):
        xl()(ids(), mems=[torch.randn(2, 6, DIM), torch.randn(2, 5, DIM)])


def test_mem_masks_without_mems():
    with refused(ValueError, "mem_masks", "mems"):
        xl()(ids(), mem_masks=torch.ones(2, 6, dtype=torch.bool))


def test_mem_masks_wrong_shape_or_count():
    with refused(ValueError, "mem_masks"):
        xl()(ids(), mems=mems(), mem_masks=torch.ones(2, 5, dtype=torch.bool))
    with refused(ValueError, "mem_masks"):
        xl()(ids(), mems=mems(), mem_masks=[torch.ones(2, 6, dtype=torch.bool)] * 3)
    with refused(TypeError, "mem_masks"):
        xl()(ids(), mems=mems(), mem_masks=torch.ones(2, 6))


def test_return_mems_with_return_attn():
    with refused(ValueError, "return_mems", "return_attn"):
        xl()(ids(), return_mems=True, return_attn=True)


# ------------------------------------------------------------------------------------------------
# sequence length

def test_longer_than_max_seq_len_with_learned_positions():
    with refused(ValueError, "max_seq_len=16", "17"):
        lm()(ids(n=17))
    model = guard(ContinuousTransformerWrapper(max_seq_len=16, attn_layers=Decoder(dim=DIM, depth=2)))
    with refused(ValueError, "max_seq_len=16"):
        model(torch.randn(1, 20, DIM))


@pytest.mark.parametrize("layers", [dict(rotary_pos_emb=True), dict(alibi_pos_emb=True),
                                    dict(rel_pos_bias=True)], ids=["rotary", "alibi", "t5"])
def test_longer_than_max_seq_len_allowed_with_relative_positions(layers):
    model = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16,
                               attn_layers=Decoder(dim=DIM, depth=2, heads=4, **layers)).eval()
    with torch.no_grad():
        out = model(ids(n=40))
    assert out.shape == (2, 40, NUM_TOKENS)
    assert torch.isfinite(out).all()


def test_exactly_max_seq_len_is_fine():
    model = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16, attn_layers=Decoder(dim=DIM, depth=2))
    assert model(ids(n=16)).shape == (2, 16, NUM_TOKENS)


# ------------------------------------------------------------------------------------------------
# images

def vit(**kw):
    model = ViTransformerWrapper(image_size=32, patch_size=8, num_classes=10,
                                 attn_layers=Encoder(dim=DIM, depth=2), **kw)
    return guard(model.eval())


@pytest.mark.parametrize("shape", [(1, 3, 16, 16), (1, 3, 32, 16), (1, 3, 40, 40)])
def test_image_wrong_size(shape):
    with refused(ValueError, "img", "32"):
        vit()(torch.randn(shape))


def test_image_wrong_channels():
    with refused(ValueError, "img", "3"):
        vit()(torch.randn(1, 1, 32, 32))


def test_image_wrong_rank_or_dtype():
    with refused(ValueError, "img"):
        vit()(torch.randn(3, 32, 32))
    with refused(TypeError, "img"):
        vit()(torch.zeros(1, 3, 32, 32, dtype=torch.uint8))


@pytest.mark.parametrize("patch_size", [7, 0, 64])
def test_patch_size_not_dividing_image_size(patch_size):
    with refused(ValueError, "patch_size"):
        ViTransformerWrapper(image_size=32, patch_size=patch_size, attn_layers=Encoder(dim=DIM, depth=2))


def test_vit_refuses_a_decoder():
    with refused(ValueError, "Decoder"):
        ViTransformerWrapper(image_size=32, patch_size=8, attn_layers=Decoder(dim=DIM, depth=2))


def test_nan_in_image():
    img = torch.randn(1, 3, 32, 32)
    img[0, 1, 4, 5] = float("nan")
    with refused(ValueError, "img", "NaN"):
        vit()(img)
    img[0, 1, 4, 5] = float("inf")
    with refused(ValueError, "img"):
        vit()(img)
    model = ViTransformerWrapper(image_size=32, patch_size=8, num_classes=10,
                                 attn_layers=Encoder(dim=DIM, depth=2), allow_nonfinite=True)
    assert model(img).shape == (1, 10)


# ------------------------------------------------------------------------------------------------
# continuous input

def continuous(**kw):
    model = ContinuousTransformerWrapper(dim_in=8, dim_out=4, max_seq_len=16,
                                         attn_layers=Decoder(dim=DIM, depth=2), **kw)
    return guard(model.eval())


def test_nan_in_continuous_input():
    x = torch.randn(2, 8, 8)
    x[1, 2, 3] = float("nan")
    with refused(ValueError, "x", "NaN"):
        continuous()(x)
    x[1, 2, 3] = float("-inf")
    with refused(ValueError, "x"):
        continuous()(x)
    model = ContinuousTransformerWrapper(dim_in=8, dim_out=4, max_seq_len=16,
                                         attn_layers=Decoder(dim=DIM, depth=2), allow_nonfinite=True)
    assert model(x).shape == (2, 8, 4)


def test_continuous_wrong_shape_or_dtype():
    with refused(ValueError, "x", "dim_in=8"):
        continuous()(torch.randn(2, 8, 9))
    with refused(ValueError, "x"):
        continuous()(torch.randn(8, 8))
    with refused(TypeError, "x"):
        continuous()(torch.ones(2, 8, 8, dtype=torch.long))
    with refused(TypeError, "mask"):
        continuous()(torch.randn(2, 8, 8), mask=torch.ones(2, 8))


# ------------------------------------------------------------------------------------------------
# construction

@pytest.mark.parametrize("not_a_stack", [nn.Linear(DIM, DIM), "Decoder", None,
                                         Decoder(dim=DIM, depth=2).cfg], ids=["module", "str", "none", "config"])
def test_attn_layers_not_a_stack(not_a_stack):
    with refused(TypeError, "attn_layers"):
        TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16, attn_layers=not_a_stack)
    with refused(TypeError, "attn_layers"):
        ContinuousTransformerWrapper(max_seq_len=16, attn_layers=not_a_stack)
    with refused(TypeError, "attn_layers"):
        ViTransformerWrapper(image_size=32, patch_size=8, attn_layers=not_a_stack)


def test_zero_heads():
    with refused(ValueError, "heads", "0"):
        Decoder(dim=DIM, depth=2, heads=0)


def test_alibi_num_heads_above_heads():
    with refused(ValueError, "alibi_num_heads", "heads=4"):
        Decoder(dim=DIM, depth=2, heads=4, alibi_pos_emb=True, alibi_num_heads=8)


def test_shift_tokens_tuple_wrong_length():
    with refused(ValueError, "shift_tokens", "4 blocks"):
        Decoder(dim=DIM, depth=2, shift_tokens=(1, 1, 0))
    with refused(ValueError, "shift_tokens", "6 blocks"):
        Decoder(dim=DIM, depth=2, macaron=True, shift_tokens=(1, 1, 0, 0))


@pytest.mark.parametrize("wrapper", [TransformerWrapper, ContinuousTransformerWrapper])
def test_scaled_sinusoidal_picks_the_absolute_kind(wrapper):
    # as in x-transformers, use_abs_pos_emb=True turns absolute positions on and
    # scaled_sinu_pos_emb=True picks sinusoids over learned vectors: one scheme, not two
    from polyformer.embedding import SinusoidalPositions
    extra = dict(num_tokens=NUM_TOKENS) if wrapper is TransformerWrapper else {}
    model = wrapper(max_seq_len=16, attn_layers=Decoder(dim=DIM, depth=2),
                    use_abs_pos_emb=True, scaled_sinu_pos_emb=True, **extra)
    assert isinstance(model.pos_emb, SinusoidalPositions) and model.pos_emb.scale is not None
    assert not model.bounded


@pytest.mark.parametrize("wrapper_kw", [dict(use_abs_pos_emb=True), dict(scaled_sinu_pos_emb=True)])
def test_two_absolute_position_schemes_are_refused(wrapper_kw):
    with refused(ValueError, "position_infused_attn", "two absolute"):
        TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16,
                           attn_layers=Decoder(dim=DIM, depth=2, position_infused_attn=True), **wrapper_kw)


def test_scaled_sinusoidal_with_abs_pos_emb_off():
    with refused(ValueError, "use_abs_pos_emb", "scaled_sinu_pos_emb"):
        TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16, attn_layers=Decoder(dim=DIM, depth=2),
                           use_abs_pos_emb=False, scaled_sinu_pos_emb=True)


def test_tie_token_emb_with_different_vocab_sizes():
    with refused(ValueError, "tie_token_emb", "100", "200"):
        XTransformer(dim=DIM, enc_num_tokens=100, enc_depth=1, enc_max_seq_len=8,
                     dec_num_tokens=200, dec_depth=1, dec_max_seq_len=8, tie_token_emb=True)


def test_tie_embedding_needs_same_width():
    with refused(ValueError, "tie_embedding"):
        TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16, attn_layers=Decoder(dim=DIM, depth=2),
                           emb_dim=16, tie_embedding=True)


@pytest.mark.parametrize("kw, name", [(dict(num_tokens=0), "num_tokens"), (dict(max_seq_len=0), "max_seq_len"),
                                      (dict(emb_dropout=1.0), "emb_dropout"),
                                      (dict(max_mem_len=-1), "max_mem_len"),
                                      (dict(shift_mem_down=1), "shift_mem_down"),
                                      (dict(num_memory_tokens=2, max_mem_len=4), "num_memory_tokens")])
def test_wrapper_arguments_out_of_range(kw, name):
    args = {**dict(num_tokens=NUM_TOKENS, max_seq_len=16), **kw}
    with refused(ValueError, name):
        TransformerWrapper(attn_layers=Decoder(dim=DIM, depth=2), **args)


# ------------------------------------------------------------------------------------------------
# generation

def ar():
    net = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16, attn_layers=Decoder(dim=DIM, depth=2))
    return AutoregressiveWrapper(guard(net))


@pytest.mark.parametrize("seq_len", [0, -1])
def test_generate_seq_len_not_positive(seq_len):
    with refused(ValueError, "seq_len", str(seq_len)):
        ar().generate(ids(n=3), seq_len)


@pytest.mark.parametrize("shape", [(2, 0), (0,)])    # one (n,) prompt is x-transformers' unbatched form (issue 24)
def test_generate_empty_or_flat_prompts(shape):
    with refused(ValueError, "prompts"):
        ar().generate(torch.zeros(shape, dtype=torch.long), 4)


def test_generate_prompt_ids_out_of_range():
    prompts = ids(n=3)
    prompts[0, 0] = NUM_TOKENS
    with refused(ValueError, str(NUM_TOKENS), "num_tokens"):
        ar().generate(prompts, 4)


def test_autoregressive_wrapper_needs_a_decoder():
    net = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16, attn_layers=Encoder(dim=DIM, depth=2))
    with refused(ValueError, "causal"):
        AutoregressiveWrapper(net)
    with refused(TypeError, "TransformerWrapper"):
        AutoregressiveWrapper(Decoder(dim=DIM, depth=2))


def test_autoregressive_loss_needs_two_tokens():
    with refused(ValueError, "x", "seq >= 2"):
        ar()(ids(n=1))


@pytest.mark.parametrize("k", [0, -3])
def test_top_k_below_one(k):
    with refused(ValueError, "top_k", str(k)):
        top_k(torch.randn(2, 10), k=k)
    # through generate: the filter's arguments are checked before the first forward
    model = guard(AutoregressiveWrapper(TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16,
                                                           attn_layers=Decoder(dim=DIM, depth=2))))
    with refused(ValueError, "top_k"):
        model.generate(ids(n=3), 2, filter_logits_fn=top_k, filter_kwargs=dict(k=k))


def test_filter_kwargs_without_a_filter():
    model = guard(AutoregressiveWrapper(TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16,
                                                           attn_layers=Decoder(dim=DIM, depth=2))))
    with refused(ValueError, "filter_kwargs", "filter_logits_fn"):
        model.generate(ids(n=3), 2, filter_kwargs=dict(k=2))


def test_top_k_valid():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    kept = top_k(logits, k=2)
    assert torch.isfinite(kept).tolist() == [[False, True, True, False]]


@pytest.mark.parametrize("p", [0.0, -0.1, 1.01, 2.0])
def test_top_p_outside_unit_interval(p):
    with refused(ValueError, "top_p", str(p)):
        top_p(torch.randn(2, 10), p=p)
    model = AutoregressiveWrapper(TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=16,
                                                     attn_layers=Decoder(dim=DIM, depth=2)))
    with refused(ValueError, "top_p"):
        model.generate(ids(n=3), 2, filter_logits_fn=top_p, filter_kwargs=dict(p=p))


def test_top_p_one_keeps_everything():
    logits = torch.randn(2, 10)
    torch.testing.assert_close(top_p(logits, p=1.0), logits)


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_min_p_outside_unit_interval(p):
    with refused(ValueError, "min_p", str(p)):
        min_p(torch.randn(2, 10), p=p)


@pytest.mark.parametrize("temperature", [-1.0, -0.5])
def test_generate_negative_temperature(temperature):
    # a negative temperature flips the distribution (samples the least likely tokens): refuse it
    with refused(ValueError, "temperature"):
        ar().generate(ids(n=3), 4, temperature=temperature)
