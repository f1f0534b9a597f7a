"""The wrappers' x-transformers options and forward arguments (polyformer/wrap/): each by its defining
property against an explicit formula or a twin model with the same weights, cache= against the uncached
forward, and the named errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyformer import ContinuousTransformerWrapper, Decoder, Encoder, TransformerWrapper

V, D = 40, 16


def lm(stack=Decoder, seed: int = 0, **wrap) -> TransformerWrapper:
    torch.manual_seed(seed)
    layers = stack(dim=D, depth=2, heads=2, rotary_pos_emb=True)
    return TransformerWrapper(num_tokens=V, max_seq_len=24, attn_layers=layers, **wrap).eval()


def twin(model: TransformerWrapper, stack=Decoder, **wrap) -> TransformerWrapper:
    """A model without the option under test, holding model's weights (those it has)."""
    other = lm(stack, **wrap)
    missing, _ = other.load_state_dict(model.state_dict(), strict=False)
    assert set(missing) <= {"to_logits.weight", "to_logits.bias"}     # a model without an output head
    return other


def ids(b: int = 2, n: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


# cache=

@pytest.mark.parametrize("wrap", [{}, dict(num_memory_tokens=2), dict(use_abs_pos_emb=True)])
def test_cache_steps_equal_the_uncached_forward(wrap):
    model, x = lm(**wrap), ids()
    full = model(x)
    out, record = model(x[:, :4], return_intermediates=True)
    steps = [out]
    for t in (5, 7, 8, 9):                     # one and two new tokens per call
        out, record = model(x[:, :t], cache=record, return_intermediates=True)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert record.cache_length == 9


def test_an_older_cache_record_is_run_again():
    model, x = lm(), ids()
    _, first = model(x[:, :5], return_intermediates=True)
    _, later = model(x[:, :6], cache=first, return_intermediates=True)
    model(x[:, :7], cache=later, return_intermediates=True)            # the run's state moves on
    y = x.clone()
    y[:, 5] = (y[:, 5] + 1) % V                                         # a branch from the first record
    out, _ = model(y[:, :6], cache=first, return_intermediates=True)
    torch.testing.assert_close(out, model(y[:, :6])[:, 5:], atol=1e-5, rtol=1e-5)


def test_cache_with_left_padding_and_prepended_embeddings():
    model, x = lm(), ids()
    start = torch.tensor([0, 3])
    prepend = torch.randn(2, 2, D)
    full = model(x, seq_start_pos=start, prepend_embeds=prepend)
    _, record = model(x[:, :5], seq_start_pos=start, prepend_embeds=prepend, return_intermediates=True)
    outs = []
    for t in range(6, 10):
        out, record = model(x[:, :t], seq_start_pos=start, prepend_embeds=prepend, cache=record,
                            return_intermediates=True)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full[:, 7:], atol=1e-5, rtol=1e-5)


def test_cache_errors_name_the_problem():
    model, x = lm(), ids()
    with pytest.raises(TypeError, match="cache must be the record"):
        model(x, cache=[])
    _, record = model(x, return_intermediates=True)
    with pytest.raises(ValueError, match="longer than the 9 cached"):
        model(x, cache=record)
    encoder = lm(Encoder)
    _, record = encoder(x[:, :4], return_intermediates=True)
    with pytest.raises(ValueError, match="causal"):
        encoder(x, cache=record)


# inputs

def test_l2norm_embed_unit_norm_embeddings_and_small_init():
    model = lm(l2norm_embed=True, use_abs_pos_emb=True)
    x = ids()
    assert model.token_emb.weight.std() < 1e-4 and model.pos_emb.emb.weight.std() < 1e-4
    torch.testing.assert_close(model.token_emb(x).norm(dim=-1), torch.ones(x.shape))
    torch.testing.assert_close(model.pos_emb(torch.arange(5)[None]).norm(dim=-1), torch.ones(1, 5))
    expected = F.normalize(model.token_emb.weight[x].double(), dim=-1)
    torch.testing.assert_close(model.embed(x).double(), expected)


def test_emb_frac_gradient_scales_only_the_embedding_gradient():
    model = lm(emb_frac_gradient=0.25, use_abs_pos_emb=True)
    plain = twin(model, use_abs_pos_emb=True)
    x = ids()
    out, ref = model(x), plain(x)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(model.token_emb.weight.grad, 0.25 * plain.token_emb.weight.grad)
    torch.testing.assert_close(model.pos_emb.emb.weight.grad, 0.25 * plain.pos_emb.emb.weight.grad)
    torch.testing.assert_close(model.to_logits.weight.grad, plain.to_logits.weight.grad)


def test_sum_embeds_is_added_to_the_token_embedding():
    model, x, y = lm(), ids(), ids(seed=2)
    shift = model.token_emb(y) - model.token_emb(x)
    torch.testing.assert_close(model(x, sum_embeds=shift), model(y), atol=1e-5, rtol=1e-5)


def test_prepend_embeds_act_as_tokens_in_front():
    model, x = lm(), ids()                       # rotary only: a prepended token embedding is that token
    out = model(x[:, 3:], prepend_embeds=model.token_emb(x[:, :3]))
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    cut = model(x[:, 3:], prepend_embeds=model.token_emb(x[:, :3]), excise_prepend_embeds=True)
    torch.testing.assert_close(cut, model(x)[:, 3:], atol=1e-5, rtol=1e-5)


def test_prepended_embeddings_take_no_absolute_position():
    """As x-transformers: the text's learned positions are 0 .. n-1 whatever is prepended, so a full-length
    text with a front still runs, and the front reaches the text only through attention."""
    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=V, max_seq_len=8, use_abs_pos_emb=True,
                               attn_layers=Encoder(dim=D, depth=1, heads=2)).eval()
    x, front = ids(2, 8), torch.randn(2, 3, D)
    out = model(x, prepend_embeds=front, return_embeddings=True)
    _, record = model(x, prepend_embeds=front, return_intermediates=True)
    text_in = record.hiddens[0][:, 3:]
    torch.testing.assert_close(text_in, model.token_emb(x) + model.pos_emb(torch.arange(8)[None]))
    torch.testing.assert_close(record.hiddens[0][:, :3], front)
    assert out.shape == (2, 11, D)


def test_prepend_mask_hides_the_masked_prepended_positions():
    model, x = lm(Encoder), ids()
    prepend = torch.randn(2, 3, D)
    keep = torch.tensor([[True, False, True]] * 2)
    other = prepend.clone()
    other[:, 1] += 5.0
    a = model(x, prepend_embeds=prepend, prepend_mask=keep, excise_prepend_embeds=True)
    b = model(x, prepend_embeds=other, prepend_mask=keep, excise_prepend_embeds=True)
    torch.testing.assert_close(a, b)


def test_seq_start_pos_makes_left_padded_rows_equal_their_unpadded_run():
    model = lm(use_abs_pos_emb=True)
    x = ids(1, 6)
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), x), 1)
    out = model(torch.cat((padded, torch.cat((x, x[:, :3]), 1))), seq_start_pos=torch.tensor([3, 0]))
    torch.testing.assert_close(out[0, 3:], model(x)[0], atol=1e-5, rtol=1e-5)


def test_decoder_options_stay_causal():
    model = lm(l2norm_embed=True, emb_frac_gradient=0.5, mixture_of_softmax=True)
    x = ids()
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % V
    torch.testing.assert_close(model(x)[:, :6], model(y)[:, :6])


# outputs

def test_return_only_embed_gives_the_stack_output():
    model = lm(return_only_embed=True)
    x = ids()
    torch.testing.assert_close(model(x), twin(model)(x, return_embeddings=True))


def test_average_pool_embed_is_the_masked_mean():
    model = lm(Encoder, average_pool_embed=True)
    plain = twin(model, Encoder)
    x, mask = ids(), torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    h = plain(x, mask=mask, return_embeddings=True).double()
    expected = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    torch.testing.assert_close(model(x, mask=mask, return_embeddings=True).double(), expected)
    torch.testing.assert_close(model(x, mask=mask), plain.to_logits(expected.float()))


@pytest.mark.parametrize("k", [1, 2])
def test_cls_tokens_are_learned_tokens_in_front(k):
    model = lm(Encoder, use_cls_token=True, num_cls_tokens=k)
    plain = twin(model, Encoder)
    x = ids()
    cls = model.cls_tokens[None].expand(2, -1, -1)
    expected = plain(x, prepend_embeds=cls)[:, :k]
    torch.testing.assert_close(model(x), expected[:, 0] if k == 1 else expected)


def test_num_output_heads_are_separate_linear_heads():
    model = lm(num_output_heads=3)
    x = ids()
    h = model(x, return_embeddings=True)
    logits = model(x)
    assert len(logits) == 3
    for head, out in zip(model.output_heads, logits):
        torch.testing.assert_close(out, h @ head.weight.t() + head.bias)


def test_mixture_of_softmax_equals_the_formula():
    model = lm(mixture_of_softmax=True, mixture_of_softmax_k=3)
    x = ids()
    h = model(x, return_embeddings=True).double()
    mos, out = model.mixture, model.to_logits
    parts = torch.tanh(h @ mos.to_components.weight.double().t()).view(2, 9, 3, D)
    probs = torch.softmax(parts @ out.weight.double().t() + out.bias.double(), -1)
    prior = torch.softmax(h @ mos.to_prior.weight.double().t(), -1)
    expected = (prior[..., None] * probs).sum(-2).log()
    torch.testing.assert_close(model(x).double(), expected, atol=1e-5, rtol=1e-5)


def test_return_logit_entropies():
    model, x = lm(), ids()
    logits, record = model(x, return_logit_entropies=True)
    p = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(record.logit_entropies.double(), -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)


def test_recycling_runs_the_stack_again_on_its_own_output():
    model = lm(recycling=True)
    plain = twin(model)
    x = ids()
    torch.testing.assert_close(model(x, recycle_steps=1), plain(x))
    first = plain(x, return_embeddings=True)
    again = model.recycling.proj(first)
    expected = plain.to_logits(plain._run(plain.embed(x) + again, None, None, None, None, None, False, False)[0])
    torch.testing.assert_close(model(x, recycle_steps=2), expected)
    model(x, recycle_steps=2).sum().backward()      # the first run takes no gradient: proj's input is detached
    assert model.recycling.proj.weight.grad is not None
    with pytest.raises(ValueError, match="recycle_steps"):
        model(x)


def test_continuous_probabilistic_gives_mean_and_variance():
    torch.manual_seed(0)
    model = ContinuousTransformerWrapper(max_seq_len=16, dim_in=3, dim_out=2, probabilistic=True,
                                         attn_layers=Decoder(dim=D, depth=1, heads=2)).eval()
    x = torch.randn(2, 5, 3)
    out = model(x)
    raw = model.project_out(model(x, return_embeddings=True)).view(2, 5, 2, 2)
    torch.testing.assert_close(out[0], raw[..., 0])
    torch.testing.assert_close(out[1], raw[..., 1].exp())
    steps, record = model(x[:, :3], return_intermediates=True)
    rest, _ = model(x, cache=record, return_intermediates=True)
    torch.testing.assert_close(torch.cat((steps, rest), 2), out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wrap, match", [
    (dict(num_output_heads=0), "num_output_heads"),
    (dict(emb_frac_gradient=0.0), "emb_frac_gradient"),
    (dict(average_pool_embed=True, use_cls_token=True), "average_pool_embed"),
    (dict(mixture_of_softmax=True, num_output_heads=2), "mixture_of_softmax"),
    (dict(mixture_of_softmax=True, mixture_of_softmax_k=0), "mixture_of_softmax_k"),
    (dict(num_cls_tokens=0, use_cls_token=True), "num_cls_tokens"),
    (dict(train_max_recycle_steps=0, recycling=True), "train_max_recycle_steps"),
])
def test_bad_options_fail_at_build(wrap, match):
    with pytest.raises((ValueError, TypeError), match=match):
        lm(**wrap)
    with pytest.raises(ValueError, match="dim_out"):
        ContinuousTransformerWrapper(max_seq_len=8, probabilistic=True, attn_layers=Decoder(dim=D, depth=1))


def test_bad_forward_arguments_are_named():
    model, x = lm(), ids()
    with pytest.raises(ValueError, match="recycle_steps"):
        model(x, recycle_steps=2)
    with pytest.raises(ValueError, match="prepend_mask"):
        model(x, prepend_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="seq_start_pos"):
        model(x, seq_start_pos=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="sum_embeds"):
        model(x, sum_embeds=torch.zeros(2, 9, D + 1))
    with pytest.raises(ValueError, match="average_pool_embed"):
        lm(average_pool_embed=True).new_state(2, 8)


def test_vit_register_tokens_join_the_stack_and_leave_the_output():
    from polyformer import ViTransformerWrapper
    torch.manual_seed(0)
    vit = ViTransformerWrapper(image_size=8, patch_size=4, num_classes=3, num_register_tokens=2,
                               attn_layers=Encoder(dim=D, depth=1, heads=2)).eval()
    img = torch.randn(2, 3, 8, 8)
    x = torch.cat((vit.cls_token.expand(2, -1, -1), vit.patch_embed(img)), 1) + vit.pos_emb
    h = vit.attn_layers(torch.cat((x, vit.register_tokens[None].expand(2, -1, -1)), 1))[:, :5]
    torch.testing.assert_close(vit(img, return_embeddings=True), h)
    torch.testing.assert_close(vit(img), vit.mlp_head(h[:, 0]))
    with pytest.raises(ValueError, match="num_register_tokens"):
        ViTransformerWrapper(image_size=8, patch_size=4, num_register_tokens=-1, attn_layers=Encoder(dim=D, depth=1))
