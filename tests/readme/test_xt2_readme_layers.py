"""x-transformers 2.31.10's README, section Features from weight-tied layers to the enhanced recurrence
(layer orders, the XL wrapper), as tests (conventions: xt2_checks). Macaron, the T5 bias, residual and cross
residual attention, Transformer-XL recurrence and the gated residual are the 2021 README's blocks:
test_spec_examples_features.py / test_spec_examples_layers.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyformer import Decoder, Encoder, TransformerWrapper, XLAutoregressiveWrapper
from tests.readme.xt2_checks import DIM, NUM, SEQ, assert_causal, assert_trains, copy_weights, enc, ids, lm


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


# ------------------------------------------------------------------------------------------------
# Transformer-XL recurrence, enhanced recurrence, gated residual

def xl_model() -> TransformerWrapper:
    """The README's model_xl (its block is the 2021 README's: test_spec_examples_layers.py)."""
    torch.manual_seed(0)
    return lm(max_mem_len = 4 * SEQ, rel_pos_bias = True).eval()


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
    model_xl = lm(
        max_mem_len = 4 * SEQ,
        shift_mem_down = 1,
        rotary_pos_emb = True,
        rotate_num_heads = 4   # only rotate 4 out of the 8 attention heads
    ).eval()

    seg1 = torch.randint(0, NUM, (1, SEQ))
    seg2 = torch.randint(0, NUM, (1, SEQ))

    with torch.no_grad():
        logits1, mems1  = model_xl(seg1, return_mems = True)
        logits2, mems2  = model_xl(seg2, mems = mems1, return_mems = True) # mems1 of layer N are automatically routed to the layer N-1
        # the same weights without the shift, given the memories rolled by one layer, agree
        plain = copy_weights(model_xl, lm(max_mem_len=4 * SEQ, rotary_pos_emb=True, rotate_num_heads=4))
        torch.testing.assert_close(plain(seg2, mems = mems1[1:] + mems1[:1]), logits2, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(plain(seg2, mems = mems1), logits2, atol=1e-4)

        # the first 4 heads, unrotated (theirs rotates the last ones), see no positions: over one
        # repeated token they weigh the past uniformly
        _, maps = model_xl(torch.full((1, SEQ), 7), return_attn = True)
    visible = torch.ones(SEQ, SEQ).tril()
    uniform = visible / visible.sum(-1, keepdim=True)
    torch.testing.assert_close(maps[0][0, :4], uniform.expand(4, -1, -1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(maps[0][0, 4:], uniform.expand(4, -1, -1), atol=1e-3)
