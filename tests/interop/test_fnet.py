"""FNet: hidden states equal Hugging Face's `FNetModel` on random models of several shapes (token
types, the embedding projection, tanh and exact GELU, the DFT-matrix path), and back again. Hugging
Face's FNet takes no mask, so the comparison is on unpadded inputs. Also the wrapper keyword
`post_emb_proj` that FNet's embedding projection needed."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from polyformer import Encoder, TransformerWrapper
from polyformer.interop import from_hf, load_hf, save_hf, to_hf

from .hf_models import spread, transformers

SHAPES = {
    "dim12_types3": dict(vocab_size=50, hidden_size=12, num_hidden_layers=2, intermediate_size=20,
                         max_position_embeddings=32, type_vocab_size=3),
    "dim20_exact_gelu_eps": dict(vocab_size=40, hidden_size=20, num_hidden_layers=2, intermediate_size=44,
                                 max_position_embeddings=24, hidden_act="gelu", layer_norm_eps=1e-5),
    "dim8_depth3_one_type": dict(vocab_size=30, hidden_size=8, num_hidden_layers=3, intermediate_size=16,
                                 max_position_embeddings=16, type_vocab_size=1, hidden_act="gelu_pytorch_tanh"),
}
TOL = 1e-5


def fnet(shape: str, seed: int = 0, pooler: bool = False, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.FNetConfig(**SHAPES[shape], **extra)
    return spread(transformers.FNetModel(config, add_pooling_layer=pooler), seed)


@pytest.mark.parametrize("n", [9, 16])
@pytest.mark.parametrize("shape", SHAPES)
def test_hidden_states_equal_hugging_face(shape, n):
    hf = fnet(shape)
    model = from_hf(hf)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, hf.config.vocab_size, (3, n), generator=g)
    types = torch.randint(0, hf.config.type_vocab_size, (3, n), generator=g)
    with torch.no_grad():
        theirs = hf(x).last_hidden_state
        assert theirs.abs().max() > 0.5
        assert (model(x, return_embeddings=True) - theirs).abs().max() <= TOL
        theirs = hf(x, token_type_ids=types).last_hidden_state
        ours = model(x, embed_ids={"token_type": types}, return_embeddings=True)
        assert (ours - theirs).abs().max() <= TOL


def test_the_dft_matrix_path_converts_and_agrees():
    """use_tpu_fourier_optimizations: complex64 DFT matrices, inputs of exactly tpu_short_seq_length."""
    hf = fnet("dim12_types3", use_tpu_fourier_optimizations=True, tpu_short_seq_length=11)
    assert any("dft_mat" in k for k in hf.state_dict())
    model = from_hf(hf)
    x = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(x, return_embeddings=True) - hf(x).last_hidden_state).abs().max() <= TOL
    back = to_hf(model)
    assert back.config.use_tpu_fourier_optimizations is False
    with torch.no_grad():
        assert (back(x).last_hidden_state - hf(x).last_hidden_state).abs().max() <= TOL


def test_to_hf_gives_the_same_model_back(tmp_path):
    hf = fnet("dim12_types3")
    back = to_hf(from_hf(hf))
    assert type(back) is type(hf)
    theirs, ours = hf.state_dict(), back.state_dict()
    assert list(theirs) == list(ours)
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    for key in ("vocab_size", "type_vocab_size", "hidden_act", "layer_norm_eps", "intermediate_size"):
        assert getattr(back.config, key) == getattr(hf.config, key), key
    out = save_hf(from_hf(hf), tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["FNetModel"]
    loaded = transformers.FNetModel.from_pretrained(out, add_pooling_layer=False).eval()
    assert all(torch.equal(theirs[k], loaded.state_dict()[k]) for k in theirs)
    assert all(torch.equal(a, b) for a, b in zip(load_hf(out).state_dict().values(), from_hf(hf).state_dict().values()))


def test_the_pooler_is_named_and_can_be_left_out():
    hf = fnet("dim8_depth3_one_type", pooler=True)
    with pytest.raises(ValueError, match="pooler.dense.weight.*ignore=\\['pooler'\\]"):
        from_hf(hf)
    assert isinstance(from_hf(hf, ignore=["pooler"]), TransformerWrapper)


def test_post_emb_proj_projects_the_normalised_embeddings():
    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=20, max_seq_len=8, post_emb_norm=True, post_emb_proj=True,
                               attn_layers=Encoder(dim=8, depth=1, attn_fnet=True)).eval()
    with torch.no_grad():
        model.post_emb_proj.bias.normal_()
    x = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(1))
    _, record = model(x, return_intermediates=True)
    summed = model.token_emb(x) + model.pos_emb(torch.arange(6)[None])
    assert_close(record.hiddens[0], model.post_emb_proj(model.post_emb_norm(summed)))
    plain = TransformerWrapper(num_tokens=20, max_seq_len=8, post_emb_norm=True,
                               attn_layers=Encoder(dim=8, depth=1, attn_fnet=True))
    assert plain.post_emb_proj is None and "post_emb_proj.weight" not in plain.state_dict()
    with pytest.raises(TypeError, match="post_emb_proj must be True or False"):
        TransformerWrapper(num_tokens=20, max_seq_len=8, post_emb_proj=1, attn_layers=Encoder(dim=8, depth=1))
