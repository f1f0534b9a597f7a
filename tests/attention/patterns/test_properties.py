"""What defines each pattern beyond its mask: the Sparse Transformer's two-step connectivity,
BigBird's random blocks, global tokens (Longformer, ETC), the config's JSON round trip, and bad
input refused by name."""

from __future__ import annotations

import pytest
import torch

from polyformer import Decoder, Encoder, TransformerWrapper
from polyformer.config import LayersConfig, from_dict, to_dict

from .definitions import H, window


def dependence(model, n: int) -> torch.Tensor:
    """(n, n) bool: output i depends on input j (a nonzero Jacobian block)."""
    x = torch.randn(1, n, 8)
    jac = torch.autograd.functional.jacobian(lambda t: model(t)[0], x)[:, :, 0]    # (n, dim, n, dim)
    return jac.abs().sum((1, 3)) > 0


@pytest.mark.parametrize("kind, mode", [("strided", "heads"), ("strided", "union"), ("fixed", "heads"),
                                        ("fixed", "union")])
def test_two_sparse_transformer_layers_connect_every_earlier_input(kind, mode):
    torch.manual_seed(0)
    n, l = 16, 4
    two = Decoder(dim=8, depth=2, heads=2, attn_dim_head=4, attn_sparse=kind, attn_sparse_stride=l,
                  attn_sparse_mode=mode, **({"attn_sparse_summary": 1} if kind == "fixed" else {}))
    assert torch.equal(dependence(two, n), torch.ones(n, n, dtype=torch.bool).tril())
    one = Decoder(dim=8, depth=1, heads=2, attn_dim_head=4, attn_window=l)      # A1 alone, one layer
    reach = dependence(one, n)
    assert not reach[n - 1, 0] and torch.equal(reach, torch.ones(n, n, dtype=torch.bool).tril().triu(-(l - 1)))


def random_blocks(model, layer: int, n: int) -> torch.Tensor:
    """Layer `layer`'s table of random key blocks for an input of n positions."""
    stage = model.blocks[2 * layer].branch.pattern
    piece = next(p for p in stage.pieces if type(p).__name__ == "RandomBlocks")
    pos = torch.arange(n)[None]
    return piece.table(stage.geometry(pos, pos, None, None), (n - 1) // piece.b)


def bigbird(causal: bool, seed: int = 0, depth: int = 2):
    torch.manual_seed(0)
    return (Decoder if causal else Encoder)(dim=16, depth=depth, heads=H, attn_dim_head=4, attn_window=6,
                                            attn_global_tokens=4, attn_random_blocks=2, attn_block_size=4,
                                            attn_random_seed=seed)


@pytest.mark.parametrize("causal", [True, False])
def test_bigbird_random_blocks_are_reproducible_differ_by_layer_and_never_look_ahead(causal):
    x = torch.randn(2, 64, 16)
    a, b, other = bigbird(causal), bigbird(causal), bigbird(causal, seed=1)
    assert torch.equal(a(x), b(x))                          # same seed, same input: same output
    assert not torch.allclose(a(x), other(x))               # another seed draws other blocks
    tables = [random_blocks(a, layer, 64) for layer in range(2)]
    assert not torch.equal(tables[0], tables[1])
    _, record = a(x, return_attn=True)
    visible = record.attn[0][0, 0] > 0                       # (i, j), head 0
    i = torch.arange(64)
    local = window(6)(i[:, None], i[None], torch.zeros(1, 1, 1, dtype=torch.long), 64, causal)[0]
    extra = visible & ~local & ~(i[:, None] < 4) & ~(i[None] < 4)
    blocks_seen = extra.view(16, 4, 16, 4).any(3).any(1)    # (query block, key block)
    for q in range(16):
        allowed = tables[0][q][tables[0][q] >= 0]
        assert set(blocks_seen[q].nonzero().flatten().tolist()) <= set(allowed.tolist())
        if causal:
            assert (allowed < q).all()                       # never a future block
        else:
            assert len(allowed) == 2                         # enough candidates: exactly r blocks


def test_global_mask_tokens_see_and_are_seen_by_everything():
    torch.manual_seed(0)
    enc = Encoder(dim=16, depth=1, heads=H, attn_dim_head=4, attn_window=4)
    marked = torch.zeros(2, 30, dtype=torch.bool)
    marked[0, 11] = True
    marked[1, [2, 25]] = True
    _, record = enc(torch.randn(2, 30, 16), global_mask=marked, return_attn=True)
    weights = record.attn[0]
    for row, col in ((0, 11), (1, 2), (1, 25)):
        assert (weights[row, :, col, :] > 0).all() and (weights[row, :, :, col] > 0).all()
    assert (weights[0, :, 0, 20] == 0).all()


def test_etc_memory_tokens_made_global_see_and_are_seen_by_everything():
    """ETC's global-local attention: num_memory_tokens = g with attn_global_tokens = g and a window."""
    torch.manual_seed(0)
    g = 3
    net = TransformerWrapper(num_tokens=20, max_seq_len=40, num_memory_tokens=g,
                             attn_layers=Encoder(dim=16, depth=1, heads=H, attn_dim_head=4, attn_window=4,
                                                 attn_global_tokens=g))
    _, weights = net(torch.randint(0, 20, (1, 30)), return_attn=True)
    w = weights[0][0]                                         # (h, g + n, g + n)
    assert (w[:, :g] > 0).all() and (w[:, :, :g] > 0).all()   # g2g, g2l, l2g
    assert (w[:, g + 20, g + 5] == 0).all()                   # l2l stays local


def test_pattern_config_round_trips_through_json():
    enc = Encoder(dim=16, depth=2, heads=H, attn_window=8, attn_window_dilation=(1, 2, 1, 2), attn_global_tokens=2,
                  attn_random_blocks=1, attn_block_size=4, attn_random_seed=3)
    dec = Decoder(dim=16, depth=2, heads=H, attn_dilated=((8, 1), (16, 2)))
    for stack in (enc, dec):
        again = from_dict(LayersConfig, to_dict(stack.cfg))
        assert again == stack.cfg
        rebuilt = type(stack).from_config(again)
        rebuilt.load_state_dict(stack.state_dict())
        x = torch.randn(1, 40, 16)
        assert torch.equal(rebuilt(x), stack(x))


BAD = [
    (Decoder, dict(attn_window=0), "attn_window must be an integer >= 1"),
    (Encoder, dict(attn_window=1), "attn_window on a bidirectional stack"),
    (Decoder, dict(attn_window=4, attn_window_dilation=(1, 2)), "attn_window_dilation must be"),
    (Decoder, dict(attn_window_dilation=2), "attn_window_dilation need"),
    (Decoder, dict(attn_window=4, attn_random_blocks=2, attn_block_size=0), "attn_block_size must be"),
    (Decoder, dict(attn_sparse="strided"), "attn_sparse need(s) attn_sparse_stride"),
    (Decoder, dict(attn_sparse="diagonal", attn_sparse_stride=4), "attn_sparse must be 'strided' or 'fixed'"),
    (Decoder, dict(attn_sparse="fixed", attn_sparse_stride=4, attn_sparse_summary=5), "attn_sparse_summary must be"),
    (Decoder, dict(attn_sparse="strided", attn_sparse_stride=4, attn_sparse_mode="all"), "attn_sparse_mode must be"),
    (Decoder, dict(attn_blockwise=2), "attn_blockwise lets queries see later keys: it cannot be causal"),
    (Encoder, dict(attn_blockwise=3), "heads (4) must be a multiple"),
    (Encoder, dict(attn_local_2d=dict(image=(6, 8), query=(4, 4))), "must tile the image"),
    (Decoder, dict(attn_dilated=((8, 2), (16, 4))), "needs one (w, 1) configuration"),
    (Decoder, dict(attn_dilated=((6, 4),)), "multiple of its rate"),
    (Encoder, dict(attn_window=4, attn_blockwise=2), "cannot combine with attn_window"),
    (Decoder, dict(attn_sparse="strided", attn_sparse_stride=4, attn_block_local=(4, 2)), "cannot combine"),
    (Encoder, dict(attn_window=4, attn_sink_tokens=2), "attn_sink_tokens needs a causal stack (a Decoder)"),
    (Decoder, dict(attn_sink_tokens=2), "attn_sink_tokens keeps the first tokens beside a window: it needs attn_window"),
    (Decoder, dict(attn_dilated=((8, 1),), attn_global_tokens=2), "cannot combine"),
]


@pytest.mark.parametrize("cls, keywords, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_pattern_settings_are_refused_by_name(cls, keywords, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cls(dim=16, depth=1, heads=H, **keywords)


def test_bad_forward_input_is_refused_by_name():
    enc = Encoder(dim=16, depth=1, heads=H, attn_window=4, attn_random_blocks=5, attn_block_size=4)
    with pytest.raises(ValueError, match="attn_random_blocks = 5: a sequence of 4 blocks"):
        enc(torch.randn(1, 16, 16))
    enc = Encoder(dim=16, depth=1, heads=H, attn_window=4)
    with pytest.raises(ValueError, match="global_mask must have shape"):
        enc(torch.randn(1, 16, 16), global_mask=torch.zeros(1, 15, dtype=torch.bool))
    with pytest.raises(ValueError, match="a Decoder cannot apply"):
        Decoder(dim=16, depth=1, heads=H, attn_window=4)(torch.randn(1, 16, 16),
                                                         global_mask=torch.zeros(1, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="global_mask marks global tokens of an attention pattern"):
        Encoder(dim=16, depth=1, heads=H)(torch.randn(1, 16, 16), global_mask=torch.zeros(1, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="covers an image of 4 x 4 = 16 positions; got position 19"):
        Decoder(dim=16, depth=1, heads=H, attn_local_2d=dict(image=(4, 4), query=(2, 2)))(torch.randn(1, 20, 16))
    with pytest.raises(ValueError, match="prefix_len cannot combine with an attention pattern"):
        Decoder(dim=16, depth=1, heads=H, attn_window=4)(torch.randn(1, 16, 16), prefix_len=4)
