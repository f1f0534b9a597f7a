"""XLNetModel read as a Transformer-XL (interop/xlnet.py): the content stream's hidden states agree
within 1e-5 on random tiny models of several shapes, with padding and with memories; options and
inputs polyformer does not reproduce are refused by name; to_hf writes it back with a zero segment term."""

import pytest
import torch
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")

from polyformer.interop.hf import from_hf  # noqa: E402
from polyformer.interop.hf_write import to_hf  # noqa: E402
from polyformer.interop.xlnet import XLNET  # noqa: E402

SHAPES = {
    "bi_heads2": dict(vocab_size=50, d_model=16, n_layer=2, n_head=2, d_inner=24),
    "bi_heads3_relu_eps": dict(vocab_size=40, d_model=24, n_layer=3, n_head=3, d_inner=20, ff_activation="relu",
                               layer_norm_eps=1e-5),
    "uni_one_head_tanh_gelu": dict(vocab_size=30, d_model=12, n_layer=2, n_head=1, d_inner=36, attn_type="uni",
                                   ff_activation="gelu_new"),
}


def xlnet(shape: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.XLNetConfig(**{**SHAPES[shape], **extra}, dropout=0.0, mem_len=16, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    model = transformers.XLNetModel(cfg).eval()
    with torch.no_grad():                 # spread out: a wrong mapping cannot hide in 0.02-sized weights
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def tokens(shape: str, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SHAPES[shape]["vocab_size"], (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES)
def test_hidden_states_agree(shape):
    hf = xlnet(shape)
    ours = from_hf(hf)
    assert ours.attn_layers.causal == (SHAPES[shape].get("attn_type") == "uni")
    x = tokens(shape, 9)
    assert_close(ours(x, return_embeddings=True), hf(x).last_hidden_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", ["bi_heads2", "bi_heads3_relu_eps"])   # 5.23's "uni" fails on any attention_mask
def test_padding_agrees_at_the_kept_positions(shape):
    hf, x = xlnet(shape), tokens(shape, 8)
    ours = from_hf(hf)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False                   # right padding: positions stay 0 .. n-1 in both
    theirs = hf(x, attention_mask=mask.long()).last_hidden_state
    assert_close(ours(x, mask=mask, return_embeddings=True)[mask], theirs[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_second_segment_with_memories_agrees(shape):
    hf, x = xlnet(shape), tokens(shape, 12)
    ours = from_hf(hf)
    first = hf(x[:, :7], use_mems=True)
    theirs = hf(x[:, 7:], mems=first.mems, use_mems=True).last_hidden_state
    _, mems = ours(x[:, :7], return_mems=True)
    assert_close(ours(x[:, 7:], mems=mems, return_embeddings=True), theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra, named", [
    (dict(bi_data=True), "bi_data=True"),
    (dict(clamp_len=4), "clamp_len=4"),
    (dict(same_length=True), "same_length=True"),
    (dict(reuse_len=3), "reuse_len=3"),
    (dict(ff_activation="tanh"), "ff_activation='tanh'"),
])
def test_unsupported_options_are_named(extra, named):
    with pytest.raises(ValueError, match=named):
        from_hf(xlnet("bi_heads2", **extra))


def test_the_query_stream_and_segment_term_are_not_part_of_the_model():
    ours = from_hf(xlnet("bi_heads2"))
    with pytest.raises(TypeError, match="perm_mask"):
        ours(tokens("bi_heads2", 5), perm_mask=None)
    with pytest.raises(ValueError, match="no Transformer-XL relative encoding"):
        XLNET.config_of(from_hf(transformers.GPT2Model(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2))))


@pytest.mark.parametrize("shape", SHAPES)
def test_to_hf_writes_the_content_stream_and_a_zero_segment_term(shape):
    hf = xlnet(shape)
    ours = from_hf(hf)
    back = to_hf(ours)
    assert type(back) is transformers.XLNetModel and back.config.attn_type == hf.config.attn_type
    theirs = back.state_dict()
    for name, t in hf.state_dict().items():
        if "seg_embed" in name or "r_s_bias" in name or name == "mask_emb":
            assert not theirs[name].any(), name
        else:
            assert torch.equal(theirs[name], t), name
    x = tokens(shape, 9)
    want = ours(x, return_embeddings=True)
    assert_close(back(x).last_hidden_state, want, atol=1e-5, rtol=1e-5)
    types = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(1))
    assert_close(back(x, token_type_ids=types).last_hidden_state, want, atol=1e-5, rtol=1e-5)
