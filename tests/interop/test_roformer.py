"""RoFormer checkpoints (polyformer/interop/roformer.py): `RoFormerModel`'s last hidden states equal the
converted Encoder's within 1e-5 on random tiny models of several shapes (padding, token types, positions up
to 4096, where a float32 sinusoid table would be off by 7e-5), to_hf writes them back, and what polyformer
cannot reproduce is refused by name."""

from __future__ import annotations

import pytest
import torch

from polyformer import Encoder
from polyformer.interop import from_hf, to_hf
from polyformer.interop.family import Unsupported

from .hf_models import ids, right_padding, spread, transformers

TOL = 1e-5
SHAPES = {
    "heads2": dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                   max_position_embeddings=64),
    "heads3_types3_tanh_gelu": dict(vocab_size=40, hidden_size=24, num_hidden_layers=3, num_attention_heads=3,
                                    intermediate_size=40, max_position_embeddings=32, type_vocab_size=3,
                                    hidden_act="gelu_new", layer_norm_eps=1e-5),
    "one_head_silu": dict(vocab_size=30, hidden_size=12, num_hidden_layers=1, num_attention_heads=1,
                          intermediate_size=20, max_position_embeddings=4100, hidden_act="silu"),
}


def roformer(shape: str, seed: int = 0, **extra) -> torch.nn.Module:
    """A random RoFormerModel; its sinusoid table (a frozen parameter, which `spread` would randomise) is
    rebuilt as RoFormer builds it, in float64."""
    torch.manual_seed(seed)
    hf = spread(transformers.RoFormerModel(transformers.RoFormerConfig(**SHAPES[shape], **extra)), seed)
    table = hf.encoder.embed_positions
    with torch.no_grad():
        table.weight.copy_(table.create_weight())
    return hf


@pytest.mark.parametrize("shape", SHAPES)
def test_hidden_states_agree_with_padding_and_token_types(shape):
    hf = roformer(shape)
    model = from_hf(hf)
    assert isinstance(model.attn_layers, Encoder) and model.attn_layers.cfg.attention.rotary_interleaved
    vocab, types = hf.config.vocab_size, hf.config.type_vocab_size
    x, mask = ids(vocab, b=3, n=11), right_padding(3, 11)
    kinds = torch.randint(0, types, x.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(x).last_hidden_state
        assert theirs.abs().max() > 0.5
        assert (model(x, return_embeddings=True) - theirs).abs().max() <= TOL
        ours = model(x, mask=mask, embed_ids={"token_type": kinds}, return_embeddings=True)
        theirs = hf(x, attention_mask=mask.long(), token_type_ids=kinds).last_hidden_state
        assert (ours[mask] - theirs[mask]).abs().max() <= TOL


def test_positions_up_to_4096_agree():
    hf = roformer("one_head_silu")
    model = from_hf(hf)
    x = ids(hf.config.vocab_size, b=1, n=4096)
    with torch.no_grad():
        assert (model(x, return_embeddings=True) - hf(x).last_hidden_state).abs().max() <= TOL


@pytest.mark.parametrize("shape", ["heads2", "heads3_types3_tanh_gelu"])
def test_to_hf_of_from_hf_is_the_original(shape):
    hf = roformer(shape)
    back = to_hf(from_hf(hf))
    assert type(back).__name__ == "RoFormerModel"
    theirs, ours = hf.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys()
    for name, t in theirs.items():          # every weight, and the float64-built table rebuilt by RoFormer itself
        assert torch.equal(ours[name], t), name


@pytest.mark.parametrize("extra, match", [
    (dict(rotary_value=True), "rotary_value"),
    (dict(embedding_size=8), "embedding_size"),
    (dict(is_decoder=True), "is_decoder"),
])
def test_options_polyformer_cannot_reproduce_are_refused_by_name(extra, match):
    with pytest.raises(Unsupported, match=match):
        from_hf(roformer("heads2", **extra))
