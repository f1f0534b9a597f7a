"""The keywords that let polyformer express published checkpoints exactly (GPT-2, BERT, Llama):
ff_gelu_tanh, attn_qkv_bias, attn_out_bias (stack); logits_bias, post_emb_norm, embed_num_tokens
with embed_ids (wrapper). Each is tested on its defining property."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from polyformer import ContinuousTransformerWrapper, Decoder, Encoder, TransformerWrapper

DIM = 16


def wrapper(stack=Encoder, wrap=None, **layers) -> TransformerWrapper:
    torch.manual_seed(0)
    attn_layers = stack(dim=DIM, depth=2, heads=2, attn_dim_head=8, **layers)
    return TransformerWrapper(num_tokens=20, max_seq_len=12, attn_layers=attn_layers, **(wrap or {})).eval()


def ids(b: int = 2, n: int = 7) -> torch.Tensor:
    return torch.randint(0, 20, (b, n), generator=torch.Generator().manual_seed(1))


def perturb(model: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


# ------------------------------------------------------------------------------------------------
# ff_gelu_tanh

def test_ff_gelu_tanh_is_the_tanh_formula():
    stack = Encoder(dim=DIM, depth=1, heads=2, ff_gelu_tanh=True)
    ff = stack.blocks[1].branch
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    formula = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    torch.testing.assert_close(ff.act(x), formula, atol=1e-12, rtol=0)
    assert (ff.act(x) - F.gelu(x)).abs().max() > 1e-4       # not the exact (erf) GELU
    h = torch.randn(2, 5, DIM)
    inner = ff.proj_in(h)
    expected = ff.proj_out(0.5 * inner * (1 + torch.tanh(math.sqrt(2 / math.pi) * (inner + 0.044715 * inner ** 3))))
    torch.testing.assert_close(ff(h), expected, atol=1e-6, rtol=1e-6)


def test_ff_gelu_tanh_conflicts_with_other_activations():
    with pytest.raises(ValueError, match="'ff_gelu_tanh'.*'ff_swish'|'ff_swish'.*'ff_gelu_tanh'"):
        Encoder(dim=DIM, depth=1, ff_gelu_tanh=True, ff_swish=True)
    assert Encoder(dim=DIM, depth=1, ff_gelu_tanh=False).cfg.ff.activation == "gelu"


# ------------------------------------------------------------------------------------------------
# attn_qkv_bias, attn_out_bias

@pytest.mark.parametrize("layers", [dict(), dict(position_infused_attn=True), dict(attn_kv_heads=1),
                                    dict(attn_collab_heads=True)], ids=["plain", "infused", "mqa", "collab"])
def test_qkv_bias_zero_equals_no_bias_and_nonzero_changes_output(layers):
    plain, biased = wrapper(Decoder, **layers), wrapper(Decoder, attn_qkv_bias=True, **layers)
    assert all(b.branch.project.to_qkv.bias is None for b in plain.attn_layers.blocks if b.kind == "a")
    missing, unexpected = biased.load_state_dict(perturb(plain).state_dict(), strict=False)
    assert not unexpected and missing and all(name.endswith("to_qkv.bias") for name in missing)
    for name in missing:
        biased.get_parameter(name).data.zero_()
    x = ids()
    torch.testing.assert_close(biased(x), plain(x), atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        biased.attn_layers.blocks[0].branch.project.to_qkv.bias.normal_()
    assert not torch.allclose(biased(x), plain(x), atol=1e-3)


def test_qkv_bias_covers_cross_attention_projections():
    torch.manual_seed(0)
    plain = perturb(Decoder(dim=DIM, depth=1, heads=2, cross_attend=True)).eval()
    biased = Decoder(dim=DIM, depth=1, heads=2, cross_attend=True, attn_qkv_bias=True).eval()
    missing, unexpected = biased.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and {name.split(".")[-2] for name in missing} == {"to_qkv", "to_q", "to_kv"}
    for name in missing:
        biased.get_parameter(name).data.zero_()
    x, context = torch.randn(2, 5, DIM), torch.randn(2, 3, DIM)
    torch.testing.assert_close(biased(x, context=context), plain(x, context=context), atol=1e-6, rtol=1e-6)
    with torch.no_grad():                   # a bias on the keys / values of the context changes the output
        next(b.branch for b in biased.blocks if b.kind == "c").project.to_kv.bias.normal_()
    assert not torch.allclose(biased(x, context=context), plain(x, context=context), atol=1e-3)


def test_out_bias_adds_a_constant_to_the_attention_output():
    plain = Encoder(dim=DIM, depth=1, heads=2, attn_dim_head=8).blocks[0].branch.output
    biased = Encoder(dim=DIM, depth=1, heads=2, attn_dim_head=8, attn_out_bias=True).blocks[0].branch.output
    assert plain.proj.bias is None and biased.proj.bias is not None
    with torch.no_grad():
        biased.proj.weight.copy_(plain.proj.weight)
        biased.proj.bias.normal_()
    out, x = torch.randn(2, 2, 5, 8), torch.randn(2, 5, DIM)
    torch.testing.assert_close(biased(out, x), plain(out, x) + biased.proj.bias)


# ------------------------------------------------------------------------------------------------
# logits_bias

def test_logits_bias_false_is_a_plain_matrix_product():
    model = perturb(wrapper(wrap=dict(logits_bias=False)))
    assert model.to_logits.bias is None
    assert "to_logits.bias" not in model.state_dict()
    x = ids()
    h = model(x, return_embeddings=True)
    torch.testing.assert_close(model(x), h @ model.to_logits.weight.t())
    assert wrapper().to_logits.bias is not None             # the default keeps the bias


# ------------------------------------------------------------------------------------------------
# post_emb_norm

@pytest.mark.parametrize("layers, norm", [(dict(norm_eps=1e-12), "layer"), (dict(use_rmsnorm=True, norm_eps=1e-3), "rms")])
def test_post_emb_norm_normalises_the_summed_embeddings(layers, norm):
    model = perturb(wrapper(wrap=dict(post_emb_norm=True), **layers))
    x = ids()
    _, record = model(x, return_intermediates=True)
    summed = model.token_emb(x) + model.pos_emb(torch.arange(x.shape[1])[None])
    eps = layers["norm_eps"]
    n = model.post_emb_norm
    if norm == "layer":
        expected = F.layer_norm(summed, (DIM,), n.weight, n.bias, eps)
    else:
        expected = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps) * n.weight
    torch.testing.assert_close(record.hiddens[0], expected)
    assert wrapper().post_emb_norm is None


def test_post_emb_norm_on_continuous_wrapper():
    torch.manual_seed(0)
    model = ContinuousTransformerWrapper(dim_in=5, max_seq_len=8, post_emb_norm=True,
                                         attn_layers=Encoder(dim=DIM, depth=1, heads=2)).eval()
    _, record = model(torch.randn(2, 4, 5), return_intermediates=True)
    h = record.hiddens[0]
    torch.testing.assert_close(h.mean(-1), torch.zeros(2, 4), atol=1e-5, rtol=0)


def test_post_emb_norm_needs_a_norm():
    with pytest.raises(ValueError, match="post_emb_norm.*use_rezero"):
        wrapper(wrap=dict(post_emb_norm=True), use_rezero=True)


# ------------------------------------------------------------------------------------------------
# embed_num_tokens / embed_ids

def test_extra_embedding_equals_adding_its_vector():
    model = perturb(wrapper(wrap=dict(embed_num_tokens={"token_type": 3})))
    x = ids()
    types = torch.randint(0, 3, x.shape, generator=torch.Generator().manual_seed(3))
    _, record = model(x, embed_ids={"token_type": types}, return_intermediates=True)
    table = model.embeds["token_type"].weight
    expected = (model.token_emb(x) + table[types]) + model.pos_emb(torch.arange(x.shape[1])[None])
    torch.testing.assert_close(record.hiddens[0], expected, atol=0, rtol=0)
    assert not torch.allclose(model(x, embed_ids={"token_type": types}), model(x), atol=1e-4)


def test_extra_embedding_ids_default_to_zero():
    model = perturb(wrapper(wrap=dict(embed_num_tokens={"token_type": 2, "speaker": 4})))
    x = ids()
    zeros = torch.zeros_like(x)
    full = model(x, embed_ids={"token_type": zeros, "speaker": zeros})
    torch.testing.assert_close(model(x), full, atol=0, rtol=0)
    torch.testing.assert_close(model(x, embed_ids={"speaker": zeros}), full, atol=0, rtol=0)


@pytest.mark.parametrize("embed_ids, match", [
    ({"token_typ": torch.zeros(2, 7, dtype=torch.long)}, "token_typ.*did you mean 'token_type'"),
    ({"token_type": torch.full((2, 7), 2)}, r"embed_ids\['token_type'\].*num_tokens=2"),
    ({"token_type": torch.zeros(2, 6, dtype=torch.long)}, r"embed_ids\['token_type'\].*shape"),
    ({"token_type": torch.zeros(2, 7)}, "integer"),
    ([torch.zeros(2, 7)], "dict"),
])
def test_bad_embed_ids(embed_ids, match):
    model = wrapper(wrap=dict(embed_num_tokens={"token_type": 2}))
    with pytest.raises((ValueError, TypeError), match=match):
        model(ids(), embed_ids=embed_ids)


def test_embed_ids_without_tables_and_bad_tables():
    with pytest.raises(ValueError, match="embed_num_tokens"):
        wrapper()(ids(), embed_ids={"token_type": torch.zeros(2, 7, dtype=torch.long)})
    with pytest.raises(ValueError, match="embed_num_tokens"):
        wrapper(wrap=dict(embed_num_tokens={"token_type": 0}))
    with pytest.raises(ValueError, match="identifiers"):
        wrapper(wrap=dict(embed_num_tokens={"token.type": 2}))


def test_unknown_keyword_machinery_knows_the_new_keywords():
    with pytest.raises(TypeError, match="did you mean 'attn_qkv_bias'"):
        Decoder(dim=DIM, depth=1, attn_qkv_bais=True)
    with pytest.raises(TypeError, match="did you mean 'ff_gelu_tanh'"):
        Decoder(dim=DIM, depth=1, ff_gelu_tahn=True)
    with pytest.raises(TypeError, match="did you mean 'post_emb_norm'"):
        wrapper(wrap=dict(post_emb_nrom=True))
    with pytest.raises(TypeError, match="did you mean 'embed_num_tokens'"):
        wrapper(wrap=dict(embed_num_token={"token_type": 2}))
    with pytest.raises(TypeError, match="attn_out_bias.*True or False"):
        Decoder(dim=DIM, depth=1, attn_out_bias="yes")
