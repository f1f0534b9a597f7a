"""reversible_merge="concat": the two reversible streams side by side, [y1, y2] of 2 dim features, for the
final norm and the head (Hugging Face's Reformer; `mean` is the default)."""

import pytest
import torch

from polyformer import Decoder, TransformerWrapper, XTransformer


def concat_stack(**extra) -> Decoder:
    torch.manual_seed(0)
    return Decoder(dim=8, depth=1, heads=2, attn_dim_head=4, reversible=True, reversible_merge="concat", **extra)


def test_concat_puts_the_attention_stream_first_and_normalises_2_dim():
    stack = concat_stack()
    with torch.no_grad():
        stack.blocks[1].branch.proj_out.weight.zero_()          # FF(y1) = 0: y2 = x2 = x
        stack.blocks[1].branch.proj_out.bias.zero_()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        out, record = stack(x, return_intermediates=True)
    merged = record.hiddens[-1]                                 # before the final norm: [y1, y2]
    assert merged.shape[-1] == 16 == stack.out_dim
    assert torch.equal(merged[..., 8:], x) and (merged[..., :8] - x).abs().min() > 0
    assert torch.allclose(out, torch.nn.functional.layer_norm(merged, (16,), stack.final_norm.weight,
                                                              stack.final_norm.bias, 1e-5), atol=1e-6)


def test_concat_gradients_equal_the_plain_loop():
    """Training runs the reversible pairs (inputs rebuilt in the backward); return_attn runs them as an
    ordinary loop with autograd: the same gradients through the concatenation."""
    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=11, max_seq_len=12, attn_layers=Decoder(
        dim=8, depth=3, heads=2, attn_dim_head=4, reversible=True, reversible_merge="concat"))
    x = torch.randint(0, 11, (2, 9))
    grads = []
    for return_attn in (False, True):
        model.zero_grad()
        out = model(x, return_attn=return_attn)
        (out[0] if return_attn else out).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))
    assert model.to_logits.in_features == 16


@pytest.mark.parametrize("build, named", [
    (lambda: TransformerWrapper(num_tokens=9, max_seq_len=8, tie_embedding=True, attn_layers=concat_stack()),
     "tie_embedding"),
    (lambda: Decoder(dim=8, depth=1, reversible_merge="concat"), "reversible_merge"),
    (lambda: Decoder(dim=8, depth=1, reversible=True, reversible_merge="sum"), "reversible_merge"),
    (lambda: XTransformer(dim=8, enc_num_tokens=9, enc_max_seq_len=8, dec_num_tokens=9, dec_max_seq_len=8,
                          enc_depth=1, dec_depth=1, enc_reversible=True, enc_reversible_merge="concat"),
     "enc_reversible_merge"),
], ids=["tied_head", "without_reversible", "unknown_merge", "xtransformer_encoder"])
def test_concat_refusals_name_the_keyword(build, named):
    with pytest.raises(ValueError, match=named):
        build()
