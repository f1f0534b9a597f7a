"""x-transformers 2.31.10's README, section Features from weight-tied layers to the gated residual
(layer orders, residual attention, Transformer-XL recurrence), as tests (see test_xt2_readme.py).

Each block keeps its keywords and call pattern; sizes are ours (xt2_checks: dim 32, depth 2, seq 16,
256 tokens); `.cuda()` is dropped; a block that misses its own import gets it. A block that only builds
`TransformerWrapper(num_tokens, max_seq_len, attn_layers = Decoder(dim, depth, heads, ...))` (or an
Encoder) is built by `lm(...)` (`enc(...)`) with its keywords as written. Each test asserts what the
block claims."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyformer import Decoder, Encoder, TransformerWrapper, XLAutoregressiveWrapper, XTransformer
from polyformer.residual import GRUGate
from tests.readme.xt2_checks import (DEPTH, DIM, NUM, SEQ, assert_bidirectional, assert_causal, assert_trains,
                                     copy_weights, enc, ids, lm)


def _unrolled(model: TransformerWrapper, order: tuple[int, ...], kinds: str) -> TransformerWrapper:
    """A model with one block per entry of `order`, block k holding the weights of model's block order[k]."""
    flat = TransformerWrapper(num_tokens=NUM, max_seq_len=SEQ, attn_layers=type(model.attn_layers)(
        dim=DIM, heads=8, custom_layers=tuple(kinds[i] for i in order)))
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith("attn_layers.blocks."):
            index, rest = key[len("attn_layers.blocks."):].split(".", 1)
            for k, i in enumerate(order):
                if i == int(index):
                    state[f"attn_layers.blocks.{k}.{rest}"] = value
        else:
            state[key] = value
    flat.load_state_dict(state)
    return flat.eval()


def test_weight_tied_layers():
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = 3,
            weight_tie_layers = True   # set this to True to weight tie all the layers
        )
    ).eval()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in enc(depth = 1).parameters())
    with torch.no_grad():               # ALBERT: the one layer applied depth times
        torch.testing.assert_close(model(ids()), _unrolled(model, (0, 1) * 3, "af")(ids()), atol=1e-5, rtol=1e-5)


def test_layers_execute_order():
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            custom_layers = (
                'a', 'f',        # 3 sets of attention and feedforward
                'a', 'f',
                'a', 'f'
            ),
            layers_execute_order = (
                *((0, 1) * 4),   # each done 4 times before sequentially passed forward, but you can probably imagine some more interesting configurations...
                *((2, 3) * 4),
                *((4, 5) * 4),
            )
        )
    ).eval()
    order = (0, 1) * 4 + (2, 3) * 4 + (4, 5) * 4
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), _unrolled(model, order, "afafaf")(ids()), atol=1e-5, rtol=1e-5)
    assert_causal(model, ids())


def test_macaron():
    model = enc(macaron = True).eval()  # use macaron configuration
    assert [b.kind for b in model.attn_layers.blocks] == ["f", "a", "f"] * DEPTH
    plain = copy_weights(model, enc(custom_layers = ("f", "a", "f") * DEPTH))
    with torch.no_grad():               # each feedforward is a half step
        for block in plain.attn_layers.blocks:
            if block.kind == "f":
                block.branch.proj_out.weight.mul_(0.5), block.branch.proj_out.bias.mul_(0.5)
        torch.testing.assert_close(model(ids()), plain(ids()), atol=1e-5, rtol=1e-5)


def test_t5_relative_position_bias():
    model = lm(rel_pos_bias = True).eval()  # adds relative positional bias to all attention layers, a la T5
    pos = torch.arange(10)[None]
    bias = model.attn_layers.shared_bias(pos, pos)[0]            # (h, i, j), one per distance
    torch.testing.assert_close(bias[:, 1:, 1:], bias[:, :-1, :-1])
    assert model.pos_emb is None and model(ids(2 * SEQ)).shape == (1, 2 * SEQ, NUM)
    assert_causal(model, ids())


def _scores(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A post-norm attention block's own pre-softmax scores (1, 8, n, n) for its input h (1, n, dim)."""
    q, k, _ = block.branch.project.to_qkv(h).split(8 * 64, dim=-1)
    q, k = (t.view(1, -1, 8, 64).transpose(1, 2) for t in (q, k))
    return q @ k.transpose(-1, -2) * 64 ** -0.5


def test_residual_attention_post_norm():
    model = enc(
        pre_norm = False,       # in the paper, residual attention had best results with post-layernorm
        residual_attn = True    # add residual attention
    ).eval()
    with torch.no_grad():
        h = model(ids(), return_embeddings = True)      # post-norm: every position leaves a LayerNorm
        torch.testing.assert_close(h.mean(-1), torch.zeros(1, SEQ), atol=1e-5, rtol=0)
        _, record = model(ids(), return_intermediates = True, return_attn = True)
    blocks, hiddens = model.attn_layers.blocks, record.hiddens
    with torch.no_grad():     # the second layer's softmax reads its own scores plus the first layer's
        first, second = _scores(blocks[0], hiddens[0]), _scores(blocks[2], hiddens[2])
    torch.testing.assert_close(record.attn[0], first.softmax(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(record.attn[1], (first + second).softmax(-1), atol=1e-5, rtol=1e-5)
    assert_bidirectional(model, ids())


def test_cross_residual_attention():
    model = XTransformer(
        dim = DIM,
        enc_num_tokens = NUM,
        enc_depth = DEPTH,
        enc_heads = 8,
        enc_max_seq_len = SEQ,
        dec_num_tokens = NUM,
        dec_depth = DEPTH,
        dec_heads = 8,
        dec_max_seq_len = SEQ,
        dec_cross_residual_attn = True     # residualize cross attention
    )
    src, tgt = ids(), ids(seed=1)
    plain = copy_weights(model, XTransformer(dim=DIM, enc_num_tokens=NUM, enc_depth=DEPTH, enc_heads=8,
                                             enc_max_seq_len=SEQ, dec_num_tokens=NUM, dec_depth=DEPTH,
                                             dec_heads=8, dec_max_seq_len=SEQ))
    with torch.no_grad():
        assert model.eval()(src, tgt) != plain(src, tgt)      # the cross-attention scores carry over
    assert_trains(model.train()(src, tgt), model)


# ------------------------------------------------------------------------------------------------
# Transformer-XL recurrence, enhanced recurrence, gated residual

def xl_model() -> TransformerWrapper:
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        max_mem_len = 4 * SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            rel_pos_bias = True
        )
    ).eval()


def test_transformer_xl_recurrence():
    model_xl = xl_model()

    seg1 = torch.randint(0, NUM, (1, SEQ))
    seg2 = torch.randint(0, NUM, (1, SEQ))
    seg3 = torch.randint(0, NUM, (1, SEQ))

    with torch.no_grad():
        logits1, mems1  = model_xl(seg1, return_mems = True)
        logits2, mems2  = model_xl(seg2, mems = mems1, return_mems = True)
        logits3, mems3  = model_xl(seg3, mems = mems2, return_mems = True)
        full = model_xl(torch.cat((seg1, seg2, seg3), dim = 1))

    assert [m.shape for m in mems3] == [(1, 3 * SEQ, DIM)] * DEPTH
    # with the history in memory, the segments' logits are those of one long causal pass
    torch.testing.assert_close(torch.cat((logits1, logits2, logits3), dim = 1), full, atol=1e-4, rtol=1e-4)


def test_xl_autoregressive_wrapper():
    model_xl = xl_model()        # "pass in the above model_xl"

    xl_wrapper = XLAutoregressiveWrapper(model_xl)

    seg = torch.randint(0, NUM, (1, 4 * SEQ))  # sequence exceeding max length, automatically segmented and memory managed

    loss = xl_wrapper(seg)
    assert_trains(loss, model_xl)
    with torch.no_grad():        # memory holds the whole history: the loss of one long pass
        logits = model_xl(seg[:, :-1])
    torch.testing.assert_close(loss.detach(), F.cross_entropy(logits.transpose(1, 2), seg[:, 1:]),
                               atol=1e-4, rtol=1e-4)

    prime = seg[:, :2 * SEQ]     # if prime exceeds max length, memory will be caught up before generating

    generated = xl_wrapper.generate(prime, 4 * SEQ, temperature = 0.0)  # (1, 4096)
    assert generated.shape == (1, 4 * SEQ)
    with torch.no_grad():
        assert generated[0, 0] == model_xl(prime)[0, -1].argmax()


def test_enhanced_recurrence_and_rotate_num_heads():
    torch.manual_seed(0)
    model_xl = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        max_mem_len = 4 * SEQ,
        shift_mem_down = 1,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            rotary_pos_emb = True,
            rotate_num_heads = 4   # only rotate 4 out of the 8 attention heads
        )
    ).eval()

    seg1 = torch.randint(0, NUM, (1, SEQ))
    seg2 = torch.randint(0, NUM, (1, SEQ))

    with torch.no_grad():
        logits1, mems1  = model_xl(seg1, return_mems = True)
        logits2, mems2  = model_xl(seg2, mems = mems1, return_mems = True) # mems1 of layer N are automatically routed to the layer N-1
        # the same weights without the shift, given the memories rolled by one layer, agree
        plain = copy_weights(model_xl, TransformerWrapper(
            num_tokens=NUM, max_seq_len=SEQ, max_mem_len=4 * SEQ,
            attn_layers=Decoder(dim=DIM, depth=DEPTH, heads=8, rotary_pos_emb=True, rotate_num_heads=4)))
        torch.testing.assert_close(plain(seg2, mems = mems1[1:] + mems1[:1]), logits2, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(plain(seg2, mems = mems1), logits2, atol=1e-4)

        # the first 4 heads, unrotated (theirs rotates the last ones), see no positions: over one
        # repeated token they weigh the past uniformly
        _, maps = model_xl(torch.full((1, SEQ), 7), return_attn = True)
    visible = torch.ones(SEQ, SEQ).tril()
    uniform = visible / visible.sum(-1, keepdim=True)
    torch.testing.assert_close(maps[0][0, :4], uniform.expand(4, -1, -1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(maps[0][0, 4:], uniform.expand(4, -1, -1), atol=1e-3)


def test_gated_residual():
    model = TransformerWrapper(
        num_tokens = NUM,
        max_seq_len = SEQ,
        max_mem_len = 2 * SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 16,
            gate_residual = True
        )
    ).eval()
    assert sum(isinstance(m, GRUGate) for m in model.modules()) == 2 * DEPTH
    x = ids()
    with torch.no_grad():
        _, mems = model(x, return_mems = True)
        assert not torch.allclose(model(x, mems = mems), model(x))     # the memories are read
    assert_causal(model, x)
