"""Longformer: hidden states equal Hugging Face's `LongformerModel` on random models of several
shapes, with global tokens (their own projections), right padding, lengths that are not a multiple
of the window (Hugging Face pads inside; we need not), token types; and back again."""

from __future__ import annotations

import pytest
import torch

from polyformer.interop import from_hf, to_hf
from polyformer.interop.family import Unsupported

from .hf_models import spread, transformers

SHAPES = {
    "heads4_window8": dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=24, max_position_embeddings=80, attention_window=8),
    "heads3_window6_types3": dict(vocab_size=40, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
                                  intermediate_size=20, max_position_embeddings=70, attention_window=[6, 6],
                                  type_vocab_size=3, layer_norm_eps=1e-5),
    "one_head_window16_tanh": dict(vocab_size=30, hidden_size=8, num_hidden_layers=3, num_attention_heads=1,
                                   intermediate_size=16, max_position_embeddings=60, attention_window=16,
                                   hidden_act="gelu_new"),
}
TOL = 1e-5


def longformer(shape: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LongformerConfig(**SHAPES[shape])
    return spread(transformers.LongformerModel(config, add_pooling_layer=False), seed)


@pytest.mark.parametrize("n", [24, 29])        # a multiple of every window, and not
@pytest.mark.parametrize("shape", SHAPES)
def test_hidden_states_equal_hugging_face(shape, n):
    hf = longformer(shape)
    model = from_hf(hf)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(2, hf.config.vocab_size, (3, n), generator=g)        # ids 0 / 1 are bos / pad
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, n - 5:] = False
    mask[2, n - 9:] = False
    marked = torch.zeros(3, n, dtype=torch.bool)
    marked[0, [0, 7]] = True
    marked[1, 0] = True
    types = torch.randint(0, hf.config.type_vocab_size, (3, n), generator=g)
    with torch.no_grad():
        theirs = hf(x).last_hidden_state
        assert theirs.abs().max() > 0.5
        assert (model(x, return_embeddings=True) - theirs).abs().max() <= TOL
        theirs = hf(x, attention_mask=mask.long(), global_attention_mask=marked.long(),
                    token_type_ids=types).last_hidden_state
        ours = model(x, mask=mask, global_mask=marked, embed_ids={"token_type": types}, return_embeddings=True)
        assert (ours[mask] - theirs[mask]).abs().max() <= TOL


def test_to_hf_gives_the_same_model_back():
    hf = longformer("heads3_window6_types3")
    back = to_hf(from_hf(hf))
    assert type(back) is type(hf) and back.config.attention_window in (6, [6, 6])
    theirs, ours = hf.state_dict(), back.state_dict()
    assert list(theirs) == list(ours)
    for name in theirs:
        if name == "embeddings.position_embeddings.weight":     # rows below pad_token_id + 1 are never read
            assert torch.equal(theirs[name][2:], ours[name][2:])
        else:
            assert torch.equal(theirs[name], ours[name]), name


def test_a_window_per_layer_is_refused_by_name():
    torch.manual_seed(0)
    config = transformers.LongformerConfig(**{**SHAPES["heads4_window8"], "attention_window": [8, 4]})
    with pytest.raises(Unsupported, match="attention_window differs by layer"):
        from_hf(transformers.LongformerModel(config, add_pooling_layer=False))
