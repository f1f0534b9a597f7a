"""BigBird: hidden states equal Hugging Face's `BigBirdModel` (attention_type="block_sparse", eval
mode) on random models of several shapes (block sizes, random block counts, q / k / v biases or
none), at lengths that are a multiple of the block size and lengths Hugging Face pads inside, with
right padding, a hole and token types; short inputs (full attention in both); "original_full"; and
back again. Train mode is not reproduced (Hugging Face's NumPy random table), so not tested."""

from __future__ import annotations

import pytest
import torch

from polyformer.interop import from_hf, to_hf
from polyformer.interop.family import Unsupported

from .hf_models import spread, transformers

SHAPES = {
    "heads4_block4_rand1": dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=24, max_position_embeddings=80, block_size=4, num_random_blocks=1),
    "heads3_block3_rand2_types3": dict(vocab_size=40, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
                                       intermediate_size=20, max_position_embeddings=80, block_size=3,
                                       num_random_blocks=2, type_vocab_size=3, layer_norm_eps=1e-5),
    "one_head_block2_rand3_no_bias_gelu": dict(vocab_size=30, hidden_size=8, num_hidden_layers=3,
                                               num_attention_heads=1, intermediate_size=16,
                                               max_position_embeddings=80, block_size=2, num_random_blocks=3,
                                               use_bias=False, hidden_act="gelu"),
}
TOL = 1e-5


def bigbird(shape: str, seed: int = 0, **changes) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.BigBirdConfig(**{**SHAPES[shape], **changes})
    return spread(transformers.BigBirdModel(config, add_pooling_layer=False), seed)


def inputs(n: int, vocab: int, types: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, vocab, (3, n), generator=g)
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, n - 5:] = False
    mask[2, n - 9:] = False
    mask[2, 3:5] = False
    return x, mask, torch.randint(0, types, (3, n), generator=g)


@pytest.mark.parametrize("extra", [0, 3, 5])       # tokens past (5 + 2 r) b + 1: each shape pads some, not all
@pytest.mark.parametrize("shape", SHAPES)
def test_hidden_states_equal_hugging_face(shape, extra):
    c = SHAPES[shape]
    n = (5 + 2 * c["num_random_blocks"]) * c["block_size"] + 1 + extra     # long enough for block_sparse
    hf = bigbird(shape)
    model = from_hf(hf)
    assert any(p.name == "bigbird_blocks" for p in model.attn_layers.cfg.attention.pattern)
    x, mask, types = inputs(n, c["vocab_size"], c.get("type_vocab_size", 2))
    with torch.no_grad():
        theirs = hf(x).last_hidden_state
        assert hf.attention_type == "block_sparse" and theirs.abs().max() > 0.5
        assert (model(x, return_embeddings=True) - theirs).abs().max() <= TOL
        theirs = hf(x, attention_mask=mask.long(), token_type_ids=types).last_hidden_state
        ours = model(x, mask=mask, embed_ids={"token_type": types}, return_embeddings=True)
        assert (ours[mask] - theirs[mask]).abs().max() <= TOL
        # the same weights with full attention differ: the sparse layout is what matched
        dense = from_hf(bigbird(shape, attention_type="original_full"))
        assert (dense(x, mask=mask, embed_ids={"token_type": types}, return_embeddings=True)[mask]
                - theirs[mask]).abs().max() > 1e-3


@pytest.mark.parametrize("shape", ["heads4_block4_rand1", "heads3_block3_rand2_types3"])
def test_short_inputs_and_original_full_equal_hugging_face(shape):
    c = SHAPES[shape]
    short = (5 + 2 * c["num_random_blocks"]) * c["block_size"] - 2      # Hugging Face switches to full attention
    x, mask, types = inputs(short, c["vocab_size"], c.get("type_vocab_size", 2))
    for changes in ({}, {"attention_type": "original_full"}):
        hf = bigbird(shape, **changes)
        model = from_hf(hf)
        with torch.no_grad():
            theirs = hf(x, attention_mask=mask.long(), token_type_ids=types).last_hidden_state
            ours = model(x, mask=mask, embed_ids={"token_type": types}, return_embeddings=True)
        assert hf.attention_type == "original_full"
        assert (ours[mask] - theirs[mask]).abs().max() <= TOL


@pytest.mark.parametrize("shape", ["heads3_block3_rand2_types3", "one_head_block2_rand3_no_bias_gelu"])
def test_to_hf_gives_the_same_model_back(shape):
    hf = bigbird(shape)
    back = to_hf(from_hf(hf))
    assert type(back) is type(hf)
    assert (back.config.block_size, back.config.num_random_blocks, back.config.use_bias) == \
        (hf.config.block_size, hf.config.num_random_blocks, hf.config.use_bias)
    theirs, ours = hf.state_dict(), back.state_dict()
    assert list(theirs) == list(ours)
    for name in theirs:
        assert torch.equal(theirs[name], ours[name]), name


@pytest.mark.parametrize("changes, match", [
    (dict(rescale_embeddings=True), "rescale_embeddings"),
    (dict(is_decoder=True), "is_decoder"),
])
def test_what_cannot_be_reproduced_is_refused_by_name(changes, match):
    with pytest.raises(Unsupported, match=match):
        from_hf(bigbird("heads4_block4_rand1", **changes))
