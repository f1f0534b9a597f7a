"""Every code example of the spec README (spec/000_2775ee658e3949c1.txt, the x-transformers README),
in order, with `x_transformers` -> `polyformer` and `.cuda()` dropped.

Each example keeps its keywords and call pattern exactly; only sizes are reduced for CI (dim, depth,
sequence length, image size). Each test asserts the shape stated by the README's comment and one
behavioural property (causality, masking, memory use, loss going down, ...).
"""

from __future__ import annotations

import pytest
import torch

from polyformer import (
    ContinuousTransformerWrapper,
    CrossAttender,
    Decoder,
    Encoder,
    TransformerWrapper,
    ViTransformerWrapper,
    XTransformer,
)
from polyformer.norm import ScaleNorm
from polyformer.residual import GRUGate, ReZero

DIM = 64        # README: 512
DEPTH = 2       # README: 6 or 12
SEQ = 64        # README: 1024 (512 for the Transformer-XL examples)
IMAGE = 64      # README: 256
PATCH = 16      # README: 32


# ------------------------------------------------------------------------------------------------
# helpers

def assert_finite(t: torch.Tensor) -> None:
    assert torch.isfinite(t).all(), "output holds NaN or inf"


@torch.no_grad()
def assert_causal(model: torch.nn.Module, x: torch.Tensor, split: int | None = None, **kwargs) -> None:
    """Changing positions >= split leaves the outputs before split unchanged, and changes the rest."""
    was_training = model.training
    model.eval()
    split = x.shape[1] // 2 if split is None else split
    y = x.clone()
    if x.dtype.is_floating_point:
        y[:, split:] = torch.randn_like(y[:, split:])
    else:
        y[:, split:] = (y[:, split:] + 1) % 256
    out_x, out_y = model(x, **kwargs), model(y, **kwargs)
    model.train(was_training)
    torch.testing.assert_close(out_x[:, :split], out_y[:, :split], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out_x[:, split:], out_y[:, split:]), "the future positions ignored their input"


@torch.no_grad()
def assert_bidirectional(model: torch.nn.Module, x: torch.Tensor, **kwargs) -> None:
    """An encoder: changing the last token changes the output at the first position."""
    model.eval()
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 256
    assert not torch.allclose(model(x, **kwargs)[:, 0], model(y, **kwargs)[:, 0])


# ------------------------------------------------------------------------------------------------
# Usage

def test_full_encoder_decoder():
    model = XTransformer(
        dim = DIM,
        enc_num_tokens = 256,
        enc_depth = DEPTH,
        enc_heads = 8,
        enc_max_seq_len = SEQ,
        dec_num_tokens = 256,
        dec_depth = DEPTH,
        dec_heads = 8,
        dec_max_seq_len = SEQ,
        tie_token_emb = True      # tie embeddings of encoder and decoder
    )

    src = torch.randint(0, 256, (1, SEQ))
    src_mask = torch.ones_like(src).bool()
    tgt = torch.randint(0, 256, (1, SEQ))
    tgt_mask = torch.ones_like(tgt).bool()

    loss = model(src, tgt, src_mask = src_mask, tgt_mask = tgt_mask) # (1, 1024, 512)
    loss.backward()

    # The README's comment "(1, 1024, 512)" is a leftover: x-transformers' XTransformer returns the
    # decoder's scalar next-token loss, which is what `loss.backward()` needs.
    assert loss.shape == ()
    assert_finite(loss)
    assert model.decoder.net.token_emb is model.encoder.token_emb      # tie_token_emb
    assert model.encoder.token_emb.weight.grad is not None

    # one optimizer step on this batch lowers the loss
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        after = model(src, tgt, src_mask = src_mask, tgt_mask = tgt_mask)
    assert after < loss.detach()


def test_decoder_only_gpt_like():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    x = torch.randint(0, 256, (1, SEQ))

    out = model(x) # (1, 1024, 20000)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert_causal(model, x)


@pytest.mark.slow
def test_decoder_only_gpt_like_full_readme_sizes():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 512,
            depth = 12,
            heads = 8
        )
    ).eval()

    x = torch.randint(0, 256, (1, 1024))

    with torch.no_grad():
        out = model(x) # (1, 1024, 20000)
    assert out.shape == (1, 1024, 20000)
    assert_finite(out)


def _gpt_param_count(V: int, n: int, d: int, L: int, h: int, dh: int) -> int:
    """Parameters of a TransformerWrapper(Decoder) with learned positions and an untied head."""
    attn = d * 3 * h * dh + h * dh * d               # fused qkv (no bias) + out projection (no bias)
    ff = d * 4 * d + 4 * d + 4 * d * d + d           # two Linear layers with bias
    norms = 2 * 2 * d                                # two pre-norm LayerNorms per layer
    return V * d + n * d + L * (attn + ff + norms) + 2 * d + d * V + V


def test_gpt3_reduced():
    # The README's GPT-3 (num_tokens 50000, seq 2048, dim 12288, depth 96, heads 96, dim_head 128)
    # is never allocated: the same keywords at reduced sizes, with heads * attn_dim_head == dim as
    # in GPT-3, and the parameter count formula checked here and evaluated at the real sizes.
    gpt3 = TransformerWrapper(
        num_tokens = 500,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 4,
            attn_dim_head = 16
        )
    )
    assert gpt3.attn_layers.cfg.attention.dim_head == 16
    n_params = sum(p.numel() for p in gpt3.parameters())
    assert n_params == _gpt_param_count(500, SEQ, DIM, DEPTH, 4, 16)
    assert 170e9 < _gpt_param_count(50000, 2048, 12288, 96, 96, 128) < 180e9     # "175B"

    x = torch.randint(0, 500, (2, SEQ))
    out = gpt3(x)
    assert out.shape == (2, SEQ, 500)
    assert_finite(out)
    assert_causal(gpt3, x)


def test_encoder_only_bert_like():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    x = torch.randint(0, 256, (1, SEQ))
    mask = torch.ones_like(x).bool()

    out = model(x, mask = mask) # (1, 1024, 20000)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert_bidirectional(model, x, mask = mask)

    # a masked-out token is invisible to every other position
    model.eval()
    mask[:, -1] = False
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(x, mask = mask)[:, :-1], model(y, mask = mask)[:, :-1])


def test_image_classification():
    model = ViTransformerWrapper(
        image_size = IMAGE,
        patch_size = PATCH,
        num_classes = 1000,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
        )
    )

    img = torch.randn(1, 3, IMAGE, IMAGE)
    out = model(img) # (1, 1000)
    assert out.shape == (1, 1000)
    assert_finite(out)

    # the class logits depend on the image; a batch gives each image its own result
    model.eval()
    other = torch.randn(1, 3, IMAGE, IMAGE)
    with torch.no_grad():
        both = model(torch.cat((img, other)))
        torch.testing.assert_close(both[:1], model(img), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(both[0], both[1])
        emb = model(img, return_embeddings = True)
    assert emb.shape == (1, 1 + (IMAGE // PATCH) ** 2, DIM)


def test_image_to_caption():
    encoder = ViTransformerWrapper(
        image_size = IMAGE,
        patch_size = PATCH,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    decoder = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            cross_attend = True
        )
    )

    img = torch.randn(1, 3, IMAGE, IMAGE)
    caption = torch.randint(0, 20000, (1, SEQ))

    encoded = encoder(img, return_embeddings = True)
    out = decoder(caption, context = encoded) # (1, 1024, 20000)
    assert encoded.shape == (1, 1 + (IMAGE // PATCH) ** 2, DIM)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)

    # the caption logits depend on the image, and stay causal in the caption
    with torch.no_grad():
        other = encoder(torch.randn(1, 3, IMAGE, IMAGE), return_embeddings = True)
        assert not torch.allclose(decoder(caption, context = encoded), decoder(caption, context = other))
    assert_causal(decoder, caption, context = encoded.detach())


def test_dropouts():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        emb_dropout = 0.1,         # dropout after embedding
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_dropout = 0.1,    # dropout post-attention
            ff_dropout = 0.1       # feedforward dropout
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)

    cfg = model.attn_layers.cfg
    assert (cfg.attention.dropout, cfg.ff.dropout) == (0.1, 0.1)
    # dropout is active in training (two passes differ) and off in eval (two passes agree)
    assert not torch.allclose(model(x), model(x))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x))


# ------------------------------------------------------------------------------------------------
# Features

def test_persistent_memory():
    enc = Encoder(
        dim = DIM,
        depth = DEPTH,
        heads = 8,
        attn_num_mem_kv = 16 # 16 memory key / values
    )

    x = torch.randn(1, SEQ, DIM)
    out = enc(x)
    assert out.shape == (1, SEQ, DIM)
    assert_finite(out)
    # every attention map has 16 extra (memory) keys in front of the sequence's keys
    _, record = enc(x, return_attn = True)
    assert len(record.attn) == DEPTH
    for weights in record.attn:
        assert weights.shape == (1, 8, SEQ, 16 + SEQ)
        torch.testing.assert_close(weights.sum(-1), torch.ones(1, 8, SEQ))
        assert (weights[..., :16] > 0).all()


def test_memory_tokens():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        num_memory_tokens = 20, # 20 memory tokens
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    ).eval()

    x = torch.randint(0, 20000, (1, SEQ))
    with torch.no_grad():
        out = model(x)
        # memory tokens pass through the layers but are dropped from the output
        assert out.shape == (1, SEQ, 20000)
        assert_finite(out)
        model.memory_tokens.tokens.mul_(10.0)
        assert not torch.allclose(model(x), out)       # and they do take part in attention


def test_scalenorm():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            use_scalenorm = True # set to true to use for all layers
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.norm == "scale"
    norms = [m for m in model.modules() if isinstance(m, ScaleNorm)]
    assert len(norms) == 2 * DEPTH + 1          # one per block, plus the final norm
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert_causal(model, x)


def test_ff_glu():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            ff_glu = True # set to true to use for all feedforwards
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.ff.glu
    ff = model.attn_layers.blocks[1].branch
    assert ff.proj_in.out_features == 2 * 4 * DIM        # value and gate halves
    assert_causal(model, x)


def test_ff_relu_squared():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            ff_relu_squared = True
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.ff.activation == "relu_squared"
    act = model.attn_layers.blocks[1].branch.act
    t = torch.tensor([-2.0, 0.0, 3.0])
    torch.testing.assert_close(act(t), torch.tensor([0.0, 0.0, 9.0]))
    assert_causal(model, x)


def test_rezero():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            use_rezero = True # set to true to use for all layers
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert sum(isinstance(m, ReZero) for m in model.modules()) == 2 * DEPTH
    # every gate starts at zero, so the stack starts as the identity: logits = head(emb + pos)
    with torch.no_grad():
        h = model.token_emb(x) + model.pos_emb(torch.arange(SEQ)[None])
        torch.testing.assert_close(model.eval()(x), model.to_logits(h))


def test_sparse_topk():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_sparse_topk = 8 # keep only the top 8 values before attention (softmax)
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    # each query keeps at most 8 keys (fewer while fewer are visible), weights sum to one
    with torch.no_grad():
        _, attn = model(x, return_attn = True)
    for weights in attn:
        nonzero = (weights > 0).sum(-1)
        visible = torch.arange(1, SEQ + 1)
        assert (nonzero <= 8).all()
        assert (nonzero == visible.clamp(max=8)).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))


def test_entmax15():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_use_entmax15 = True  # use entmax15 for attention step
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.attention.normalize == "entmax15"
    with torch.no_grad():
        _, attn = model(x, return_attn = True)
    future = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    for weights in attn:
        assert (weights >= 0).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
        assert (weights[..., future] == 0).all()                # still causal
    # the normaliser in use is entmax15, which (unlike softmax) gives exact zeros
    normalize = model.attn_layers.blocks[0].branch.kernel.normalize
    sharp = normalize(torch.tensor([[3.0, 1.0, -2.0]]), None)
    assert sharp[0, 2] == 0 and sharp[0, 0] > 0
    assert_causal(model, x)


def test_talking_heads():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_talking_heads = True  # turn on information exchange between attention heads
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    kernel = model.attn_layers.blocks[0].branch.kernel
    assert kernel.pre_mix is not None and kernel.post_mix is not None
    assert kernel.pre_mix.weight.shape == (8, 8)
    assert_causal(model, x)


def test_collaborative_heads():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_collab_heads = True,
            attn_collab_compression = .3,
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    # collaborative heads share the query / key projections: fewer parameters than vanilla
    vanilla = Decoder(dim = DIM, depth = DEPTH, heads = 8)
    count = lambda m: sum(p.numel() for p in m.parameters())   # noqa: E731
    assert count(model.attn_layers) < count(vanilla)
    assert_causal(model, x)


def test_attention_on_attention():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            attn_on_attn = True  # gate output of attention layer, by queries
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.blocks[0].branch.output.on_attn
    assert model.attn_layers.blocks[0].branch.output.proj.out_features == 2 * DIM   # value and gate
    assert_bidirectional(model, x)


def test_gate_values():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            gate_values = True  # gate aggregated values with the input
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.attention.gate_values
    assert model.attn_layers.blocks[0].branch.output.gate is not None
    assert_bidirectional(model, x)


def test_sandwich_coef():
    # depth 6 is kept here: sandwich_coef = 6 must not exceed the depth
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = 6,
            heads = 8,
            sandwich_coef = 6  # interleave attention and feedforwards with sandwich coefficient of 6
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.layout == ("a",) * 6 + ("f",) * 6
    assert [b.kind for b in model.attn_layers.blocks] == ["a"] * 6 + ["f"] * 6


def test_macaron():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            macaron = True  # use macaron configuration
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.layout == ("f", "a", "f") * DEPTH
    assert all(b.scale == 0.5 for b in model.attn_layers.blocks if b.kind == "f")   # half-step FFNs


def test_t5_relative_position_bias():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            rel_pos_bias = True  # adds relative positional bias to all attention layers, a la T5
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.shared_bias is not None
    assert model.pos_emb is None                  # the bias carries the positions
    assert_causal(model, x)
    # relative positions: longer than max_seq_len is fine
    assert model(torch.randint(0, 20000, (1, 2 * SEQ))).shape == (1, 2 * SEQ, 20000)


def test_position_infused_attention():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            position_infused_attn = True  # turns on position infused attention
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.attention.position == "infused"
    assert model.attn_layers.blocks[0].branch.project.infusion is not None
    assert_causal(model, x)


def test_residual_attention():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Encoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            pre_norm = False,       # in the paper, residual attention had best results with post-layernorm
            residual_attn = True    # add residual attention
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    cfg = model.attn_layers.cfg
    assert cfg.placement == "post" and cfg.residual_attn
    assert all(b.post_norm is not None and b.norm_in is None for b in model.attn_layers.blocks)
    assert_bidirectional(model, x)


def test_cross_residual_attention():
    model = XTransformer(
        dim = DIM,
        enc_num_tokens = 256,
        enc_depth = DEPTH,
        enc_heads = 8,
        enc_max_seq_len = SEQ,
        dec_num_tokens = 256,
        dec_depth = DEPTH,
        dec_heads = 8,
        dec_max_seq_len = SEQ,
        dec_cross_residual_attn = True     # residualize cross attention
    )

    src = torch.randint(0, 256, (1, SEQ))
    tgt = torch.randint(0, 256, (1, SEQ))
    loss = model(src, tgt)
    assert loss.shape == ()
    assert_finite(loss)
    loss.backward()
    assert model.decoder.net.attn_layers.cfg.cross_residual_attn
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # without tie_token_emb the two sides have their own embeddings
    assert model.decoder.net.token_emb is not model.encoder.token_emb


def test_transformer_xl_recurrence():
    MEM = 2 * SEQ       # README: max_seq_len 512, max_mem_len 2048
    model_xl = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        max_mem_len = MEM,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            rel_pos_bias = True
        )
    ).eval()

    seg1 = torch.randint(0, 20000, (1, SEQ))
    seg2 = torch.randint(0, 20000, (1, SEQ))
    seg3 = torch.randint(0, 20000, (1, SEQ))

    with torch.no_grad():
        logits1, mems1  = model_xl(seg1, return_mems = True)
        logits2, mems2  = model_xl(seg2, mems = mems1, return_mems = True)
        logits3, mems3  = model_xl(seg3, mems = mems2, return_mems = True)

    for logits in (logits1, logits2, logits3):
        assert logits.shape == (1, SEQ, 20000)
        assert_finite(logits)
    for mems, length in ((mems1, SEQ), (mems2, 2 * SEQ), (mems3, MEM)):    # mems3 is cut to MEM
        assert len(mems) == DEPTH
        assert all(m.shape == (1, length, DIM) and not m.requires_grad for m in mems)

    # with the whole history in memory, a segment's logits equal those of one long causal pass
    with torch.no_grad():
        full = model_xl(torch.cat((seg1, seg2, seg3), dim=1))
    torch.testing.assert_close(logits1, full[:, :SEQ], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits2, full[:, SEQ:2 * SEQ], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits3, full[:, 2 * SEQ:], atol=1e-4, rtol=1e-4)


def test_enhanced_recurrence_shift_mem_down():
    model_xl = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        max_mem_len = 4 * SEQ,
        shift_mem_down = 1,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            rotary_pos_emb = True
        )
    ).eval()

    seg1 = torch.randint(0, 20000, (1, SEQ))
    seg2 = torch.randint(0, 20000, (1, SEQ))
    seg3 = torch.randint(0, 20000, (1, SEQ))

    with torch.no_grad():
        logits1, mems1  = model_xl(seg1, return_mems = True)
        logits2, mems2  = model_xl(seg2, mems = mems1, return_mems = True) # mems1 of layer N are automatically routed to the layer N-1

    assert logits1.shape == logits2.shape == (1, SEQ, 20000)
    assert_finite(logits2)
    assert len(mems2) == DEPTH and all(m.shape == (1, 2 * SEQ, DIM) for m in mems2)

    # the same weights without shift_mem_down: the first segment agrees, the second does not
    plain = TransformerWrapper(num_tokens = 20000, max_seq_len = SEQ, max_mem_len = 4 * SEQ,
                               attn_layers = Decoder(dim = DIM, depth = DEPTH, heads = 8,
                                                     rotary_pos_emb = True)).eval()
    plain.load_state_dict(model_xl.state_dict())
    with torch.no_grad():
        p1, pm1 = plain(seg1, return_mems = True)
        p2 = plain(seg2, mems = pm1)
        # routing layer l+1's memory to layer l == passing the rolled list to the plain model
        rolled = plain(seg2, mems = mems1[1:] + mems1[:1])
    torch.testing.assert_close(p1, logits1)
    assert not torch.allclose(p2, logits2, atol=1e-4)
    torch.testing.assert_close(rolled, logits2, atol=1e-5, rtol=1e-5)


def test_gated_residual():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        max_mem_len = 4 * SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 16,
            gate_residual = True
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert sum(isinstance(m, GRUGate) for m in model.modules()) == 2 * DEPTH
    logits, mems = model(x, return_mems = True)
    assert len(mems) == DEPTH
    assert_causal(model, x)


def test_rotary_positional_embeddings():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            rotary_pos_emb = True  # turns on rotary positional embeddings
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert model.attn_layers.cfg.attention.position == "rotary"
    assert model.pos_emb is None
    assert_causal(model, x)
    # relative: no learned absolute positions, so longer sequences run
    assert model(torch.randint(0, 20000, (1, 2 * SEQ))).shape == (1, 2 * SEQ, 20000)


def test_alibi_positional_embedding():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            alibi_pos_emb = True,  # turns on ALiBi positional embedding
            alibi_num_heads = 4    # only use ALiBi for 4 out of the 8 heads, so other 4 heads can still attend far distances
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    a = model.attn_layers.cfg.attention
    assert (a.bias, a.alibi_num_heads) == ("alibi", 4)
    # ALiBi on 4 of the 8 heads: the bias is zero on the other 4
    pos = torch.arange(8)[None]
    bias = model.attn_layers.shared_bias(pos, pos)
    bias = bias.reshape(-1, 8, 8, 8)[0]
    assert (bias[4:] == 0).all() and (bias[:4] != 0).any()
    assert_causal(model, x)
    assert model(torch.randint(0, 20000, (1, 2 * SEQ))).shape == (1, 2 * SEQ, 20000)


def test_shift_tokens():
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8,
            shift_tokens = 1
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    assert all(b.shift is not None and b.shift.shifts == (0, 1) for b in model.attn_layers.blocks)
    assert_causal(model, x)         # in a decoder tokens are shifted from the past only


def test_shift_tokens_per_block():
    # depth 6 is kept: the tuple has one entry per block (12 blocks)
    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = 6,
            heads = 8,
            shift_tokens = (1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0) # 12 blocks, attention and feedforward alternating, with progressively less shifting
        )
    )

    x = torch.randint(0, 20000, (1, SEQ))
    out = model(x)
    assert out.shape == (1, SEQ, 20000)
    assert_finite(out)
    blocks = model.attn_layers.blocks
    assert len(blocks) == 12
    assert [b.shift is not None for b in blocks] == [True] * 6 + [False] * 6
    assert_causal(model, x)


# ------------------------------------------------------------------------------------------------
# Miscellaneous

def test_cross_attention():
    enc = Encoder(dim = DIM, depth = DEPTH)
    model = CrossAttender(dim = DIM, depth = DEPTH)

    nodes = torch.randn(1, 1, DIM)
    node_masks = torch.ones(1, 1).bool()

    neighbors = torch.randn(1, 5, DIM)
    neighbor_masks = torch.ones(1, 5).bool()

    encoded_neighbors = enc(neighbors, mask = neighbor_masks)
    out = model(nodes, context = encoded_neighbors, mask = node_masks, context_mask = neighbor_masks) # (1, 1, 512)
    assert out.shape == (1, 1, DIM)
    assert_finite(out)
    assert set(model.layout) == {"c", "f"}

    # a neighbour masked out (in the encoder and as context) does not change the result
    enc.eval(), model.eval()
    neighbor_masks[:, -1] = False
    changed = neighbors.clone()
    changed[:, -1] = torch.randn(DIM)
    with torch.no_grad():
        a = model(nodes, context = enc(neighbors, mask = neighbor_masks), mask = node_masks,
                  context_mask = neighbor_masks)
        b = model(nodes, context = enc(changed, mask = neighbor_masks), mask = node_masks,
                  context_mask = neighbor_masks)
        c = model(nodes, context = enc(changed), mask = node_masks)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_continuous_values():
    model = ContinuousTransformerWrapper(
        dim_in = 32,
        dim_out = 100,
        max_seq_len = SEQ,
        attn_layers = Decoder(
            dim = DIM,
            depth = DEPTH,
            heads = 8
        )
    )

    x = torch.randn((1, SEQ, 32))
    mask = torch.ones(1, SEQ).bool()

    out = model(x, mask = mask) # (1, 1024, 100)
    assert out.shape == (1, SEQ, 100)
    assert_finite(out)
    assert_causal(model, x, mask = mask)
