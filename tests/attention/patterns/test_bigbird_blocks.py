"""BigBird's block layout (attn_bigbird_blocks) against Hugging Face's block-sparse attention: the
count of each (query block, key block) equals the key-block lists of Hugging Face's five query parts
with its own eval-mode random table; one attention layer equals `BigBirdBlockSparseAttention` through
both our paths (the block-sparse kernel and the dense reference with the log-multiplicity); short
inputs get full attention; bad input is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polyformer import Decoder, Encoder, TransformerWrapper
from polyformer.attention.kernels import block_sparse
from polyformer.attention.patterns import PatternStage
from polyformer.attention.patterns.bigbird_blocks import BigBirdBlocksOptions
from polyformer.config import Choice
from polyformer.interfaces import KV

transformers = pytest.importorskip("transformers")
hf_bigbird = pytest.importorskip("transformers.models.big_bird.modeling_big_bird")

# (block size, random blocks, blocks): every one long enough for the block-sparse path; Hugging
# Face's forward fails with no random blocks, its layout lists still define the counts
SHAPES = [(2, 1, 8), (3, 2, 11), (4, 3, 12)]


def hf_attention(b: int, r: int, nb: int, heads: int = 2, dim: int = 8) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BigBirdConfig(hidden_size=dim, num_attention_heads=heads, block_size=b,
                                        num_random_blocks=r, max_position_embeddings=nb * b + 8)
    return hf_bigbird.BigBirdBlockSparseAttention(config, seed=0).eval()


def hf_counts(b: int, r: int, nb: int) -> torch.Tensor:
    """(heads, nb, nb): the key blocks each query block's part lists in Hugging Face's forward, with
    the random table its eval mode draws."""
    att = hf_attention(b, r, nb)
    plan = att._get_rand_attn_plan(nb * b, b, r)
    tables = att._bigbird_block_rand_mask_with_head(nb * b, nb * b, b, b, 2, *plan)     # per head (nb - 2, r)
    rand = torch.stack([torch.as_tensor(t, dtype=torch.long) for t in tables])
    out = torch.zeros(rand.shape[0], nb, nb, dtype=torch.int32)
    for h in range(rand.shape[0]):
        lists = {0: list(range(nb)), nb - 1: list(range(nb)), 1: [0, 1, 2, nb - 1] + rand[h, 0].tolist(),
                 nb - 2: [0, nb - 3, nb - 2, nb - 1] + rand[h, -1].tolist()}
        for q in range(2, nb - 2):
            lists[q] = [0, q - 1, q, q + 1, nb - 1] + rand[h, q - 1].tolist()
        for q, ks in lists.items():
            for k in ks:
                out[h, q, k] += 1
    return out


def stage(b: int, r: int, heads: int = 2) -> PatternStage:
    return PatternStage((Choice("pattern", "bigbird_blocks", BigBirdBlocksOptions(b, r)),), heads, False, 0)


@pytest.mark.parametrize("b, r, nb", SHAPES + [(2, 0, 7)])
def test_counts_equal_hugging_face_layout(b, r, nb):
    expected = hf_counts(b, r, nb)
    st = stage(b, r)
    pos = torch.arange(nb * b)[None]
    ours = st.counts(st.geometry(pos, pos, None, None))[0]                 # (h, n, n)
    blocked = ours[:, ::b, ::b]
    assert torch.equal(blocked, expected)
    assert torch.equal(ours, blocked.repeat_interleave(b, 1).repeat_interleave(b, 2))
    assert (blocked[:, 1:-1, 0] == 1 + r).all() and (blocked == 0).any()


@pytest.mark.parametrize("b, r, nb", SHAPES)
def test_one_layer_equals_hugging_face_block_sparse_attention(b, r, nb):
    heads, dim, n = 2, 8, nb * b
    att = hf_attention(b, r, nb, heads, dim)
    x = torch.randn(2, n, dim, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n - b - 1:] = False
    mask[1, b + 1] = False
    blocked, band, from_mask, to_mask = hf_bigbird.BigBirdModel.create_masks_for_block_sparse_attn(mask.float(), b)
    with torch.no_grad():
        theirs = att(x, band, from_mask, to_mask, blocked, blocked)[0]     # (2, n, dim)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(2, n, heads, dim // heads).transpose(1, 2)

        q, k, v = split(att.query(x)), split(att.key(x)), split(att.value(x))
        st, pos = stage(b, r, heads), torch.arange(n)[None]
        geo = st.geometry(pos, pos, mask, None)
        fast = block_sparse.attention(q, KV(k, v, pos, mask), pos, st.parts(geo), mask, None,
                                      (dim // heads) ** -0.5, nn.Dropout(0.0))
        counts = st.counts(geo)
        scores = (q @ k.transpose(-1, -2)) * (dim // heads) ** -0.5 + counts.clamp(min=1).float().log()
        scores = scores.masked_fill((counts == 0) | ~mask[:, None, None, :], float("-inf"))
        dense = scores.softmax(-1) @ v
    for ours in (fast, dense):
        ours = ours.transpose(1, 2).reshape(2, n, dim)
        assert (ours[mask] - theirs[mask]).abs().max() <= 1e-5


@pytest.mark.parametrize("b, r", [(2, 1), (3, 2)])
def test_short_inputs_get_full_attention(b, r):
    st = stage(b, r)
    short = (5 + 2 * r) * b
    for n, full in ((short, True), (short + 1, False)):
        pos = torch.arange(n)[None]
        counts = st.counts(st.geometry(pos, pos, None, None))
        assert bool((counts == 1).all()) is full


def test_the_last_partial_block_is_global():
    st = stage(3, 1)
    pos = torch.arange(23)[None]                    # blocks of 3: 8 blocks, the last holds positions 21, 22
    counts = st.counts(st.geometry(pos, pos, None, None))[0, 0]
    assert (counts[21:] > 0).all() and (counts[:, 21:] > 0).all()
    assert counts[9, 21] == 1 and counts[9, 18] == 0


@pytest.mark.parametrize("keywords, match", [
    (dict(attn_bigbird_blocks=dict(block_size=0)), "block_size must be an integer >= 1"),
    (dict(attn_bigbird_blocks=dict(block_size=2, random_blocks=-1)), "random_blocks must be an integer >= 0"),
    (dict(attn_bigbird_blocks=dict(block_size=2), attn_global_tokens=1), "attn_bigbird_blocks .* attn_global_tokens"),
])
def test_bad_input_is_refused_by_name(keywords, match):
    with pytest.raises(ValueError, match=match):
        Encoder(dim=8, depth=1, heads=2, **keywords)


def test_refused_in_a_decoder_and_with_a_global_mask():
    with pytest.raises(ValueError, match="attn_bigbird_blocks .* cannot be causal"):
        Decoder(dim=8, depth=1, heads=2, attn_bigbird_blocks=dict(block_size=2))
    with pytest.raises(TypeError, match="block_size=b, random_blocks=r"):
        Encoder(dim=8, depth=1, heads=2, attn_bigbird_blocks=dict(size=2))
    model = TransformerWrapper(num_tokens=10, max_seq_len=32, attn_layers=Encoder(
        dim=8, depth=1, heads=2, attn_bigbird_blocks=dict(block_size=2, random_blocks=1)))
    with pytest.raises(ValueError, match="attn_bigbird_blocks take none"):
        model(torch.zeros(1, 20, dtype=torch.long), global_mask=torch.zeros(1, 20, dtype=torch.bool))
