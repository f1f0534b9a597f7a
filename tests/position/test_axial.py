"""Axial positional embeddings (polyformer/position/axial.py, the Reformer's): position p of an a x b grid
-> concat(E1[p // b], E2[p % b]); equal to Hugging Face's AxialPositionEmbeddings with the same weights;
wired into TransformerWrapper (decoding included); bad input refused by name."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper
from polyformer.position.axial import AxialPositions
from tests.helpers import ids
from tests.options import perturb


def test_equals_the_formula():
    torch.manual_seed(0)
    axial = AxialPositions((3, 5), (4, 6))
    pos = torch.tensor([[0, 1, 4, 5, 9, 14], [14, 2, 7, 10, 0, 6]])
    rows, cols = axial.weights[0], axial.weights[1]
    expected = torch.stack([torch.stack([torch.cat((rows[int(p) // 5, 0], cols[0, int(p) % 5])) for p in row])
                            for row in pos])
    assert_close(axial(pos), expected)
    assert axial(pos[:1]).shape == (1, 6, 10)


def test_equals_hugging_faces_axial_embeddings_with_copied_weights():
    from transformers import ReformerConfig
    from transformers.models.reformer.modeling_reformer import AxialPositionEmbeddings

    config = ReformerConfig(hidden_size=16, axial_pos_shape=(4, 8), axial_pos_embds_dim=(6, 10),
                            max_position_embeddings=32)
    theirs = AxialPositionEmbeddings(config).eval()
    torch.manual_seed(0)
    ours = AxialPositions((4, 8), (6, 10))
    assert [tuple(w.shape) for w in ours.weights] == [tuple(w.shape) for w in theirs.weights]
    theirs.load_state_dict(ours.state_dict())
    for n in (32, 19, 1):
        pos = torch.arange(n)[None]
        assert_close(ours(pos), theirs(pos))
    pos = torch.tensor([[5, 0, 31, 8], [1, 2, 3, 4]])     # per-row positions (a left-padded batch)
    assert_close(ours(pos), theirs(pos))


def lm(seed: int = 0, **keywords) -> TransformerWrapper:
    torch.manual_seed(seed)
    layers = Decoder(dim=16, depth=2, heads=2, attn_dim_head=8)
    return perturb(TransformerWrapper(num_tokens=32, max_seq_len=24, attn_layers=layers, **keywords), seed + 1).eval()


def test_the_wrapper_adds_row_and_column_vectors_at_each_position():
    model = lm(axial_pos_emb=(4, 6))
    assert model.pos_emb.weights[0].shape == (4, 1, 8) and model.pos_emb.weights[1].shape == (1, 6, 8)
    x = ids(2, 20, 32)
    out = model(x)
    with torch.no_grad():
        model.pos_emb.weights[0][2] += 1.0          # the row of positions 12 .. 17
    moved = model(x)
    assert_close(moved[:, :12], out[:, :12])        # causal: earlier positions see no change
    assert not torch.allclose(moved[:, 12], out[:, 12])
    with torch.no_grad():
        model.pos_emb.weights[0][2] -= 1.0
        model.pos_emb.weights[1][0, 5] += 1.0       # the column of positions 5, 11, 17
    moved = model(x)
    assert_close(moved[:, :5], out[:, :5])
    assert not torch.allclose(moved[:, 5], out[:, 5])


def test_dims_default_to_halves_and_may_be_chosen():
    assert [w.shape[-1] for w in lm(axial_pos_emb=(4, 6)).pos_emb.weights] == [8, 8]
    assert [w.shape[-1] for w in lm(axial_pos_emb=[4, 6], axial_pos_emb_dims=[3, 13]).pos_emb.weights] == [3, 13]


def test_cached_decoding_with_left_padding_equals_the_uncached_forward():
    model = lm(axial_pos_emb=(4, 6), axial_pos_emb_dims=(6, 10))
    x = ids(2, 14, 32)
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[1, :3] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    full = model(x, mask=mask, pos=pos)
    state = model.new_state(2, 14)
    steps = [model(x[:, :6], mask=mask[:, :6], pos=pos[:, :6], state=state)]
    steps += [model(x[:, t:t + 1], state=state) for t in range(6, 14)]
    keep = mask[:, :, None].expand_as(full)
    assert_close(torch.cat(steps, dim=1)[keep], full[keep], atol=1e-5, rtol=1e-5)
    ar = AutoregressiveWrapper(model)
    assert torch.equal(ar.generate(x[:, :4], 6, temperature=0.0), ar.generate(x[:, :4], 6, temperature=0.0,
                                                                               cache_kv=False))


def test_positions_beyond_max_seq_len_are_refused():
    model = lm(axial_pos_emb=(5, 5))
    with pytest.raises(ValueError, match="max_seq_len=24"):
        model(ids(1, 25, 32))


@pytest.mark.parametrize("keywords, message", [
    (dict(axial_pos_emb=(4, 5)), r"axial_pos_emb=\(4, 5\) lays out a \* b = 20 positions, fewer than max_seq_len=24"),
    (dict(axial_pos_emb=(4, 6), axial_pos_emb_dims=(8, 9)), "axial_pos_emb_dims=.* must add up to the model's dim"),
    (dict(axial_pos_emb_dims=(8, 8)), "axial_pos_emb_dims is set but axial_pos_emb is not"),
    (dict(axial_pos_emb=(4, 6), use_abs_pos_emb=True), "cannot combine with use_abs_pos_emb"),
    (dict(axial_pos_emb=(4, 6), use_abs_pos_emb=False), "cannot combine with use_abs_pos_emb"),
    (dict(axial_pos_emb=(4, 6), scaled_sinu_pos_emb=True), "cannot combine with scaled_sinu_pos_emb"),
])
def test_bad_values_and_clashes_are_refused_by_name(keywords, message):
    with pytest.raises(ValueError, match=message):
        lm(**keywords)


@pytest.mark.parametrize("shape", [(4,), (4, 6, 1), (0, 24), (4.0, 6), (True, 24), "4x6"])
def test_malformed_shapes_are_refused_by_name(shape):
    with pytest.raises(TypeError, match="axial_pos_emb must be two positive integers"):
        lm(axial_pos_emb=shape)


def test_position_infused_attention_is_another_absolute_scheme():
    layers = Encoder(dim=16, depth=1, heads=2, position_infused_attn=True)
    with pytest.raises(ValueError, match="cannot combine with position_infused_attn"):
        TransformerWrapper(num_tokens=32, max_seq_len=24, attn_layers=layers, axial_pos_emb=(4, 6))
