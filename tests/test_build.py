"""Whole-model configs: JSON round trip rebuilds a model that loads the weights and gives the same outputs."""

import json

import pytest
import torch

from polyformer import (ContinuousTransformerWrapper, Decoder, Encoder, TransformerWrapper, ViTransformerWrapper,
                        build_model, model_config)


def roundtrip(model):
    rebuilt = build_model(json.loads(json.dumps(model_config(model))))
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    return rebuilt.eval(), model.eval()


@pytest.mark.parametrize("make, x", [
    (lambda: TransformerWrapper(num_tokens=64, max_seq_len=16, num_memory_tokens=2, tie_embedding=True,
                                attn_layers=Decoder(dim=32, depth=2, heads=4, rotary_pos_emb=True, shift_tokens=(1, 0, 1, 0))),
     torch.randint(0, 64, (2, 9))),
    (lambda: TransformerWrapper(num_tokens=64, max_seq_len=16, max_mem_len=8, shift_mem_down=1,
                                attn_layers=Decoder(dim=32, depth=2, heads=4, rel_pos_bias=True)),
     torch.randint(0, 64, (2, 9))),
    (lambda: ContinuousTransformerWrapper(dim_in=5, dim_out=3, max_seq_len=16, scaled_sinu_pos_emb=True,
                                          attn_layers=Encoder(dim=32, depth=1, heads=4, attn_num_mem_kv=2)),
     torch.randn(2, 9, 5)),
    (lambda: ViTransformerWrapper(image_size=16, patch_size=8, num_classes=4, attn_layers=Encoder(dim=32, depth=1)),
     torch.randn(2, 3, 16, 16)),
    (lambda: Decoder(dim=32, depth=2, heads=4, alibi_pos_emb=True), torch.randn(2, 9, 32)),
], ids=["lm", "xl", "continuous", "vit", "stack"])
def test_rebuilt_model_gives_identical_outputs(make, x):
    torch.manual_seed(0)
    rebuilt, model = roundtrip(make())
    assert type(rebuilt) is type(model)
    assert torch.equal(rebuilt(x), model(x))


def test_xtransformer_round_trip():
    from polyformer import XTransformer
    torch.manual_seed(0)
    model = XTransformer(dim=32, enc_num_tokens=20, enc_depth=1, enc_max_seq_len=8, dec_num_tokens=21,
                         dec_depth=1, dec_max_seq_len=9, dec_rotary_pos_emb=True)
    rebuilt, model = roundtrip(model)
    src, tgt = torch.randint(0, 20, (2, 8)), torch.randint(0, 21, (2, 9))
    assert torch.equal(rebuilt(src, tgt), model(src, tgt))


def test_unknown_format_and_class_are_refused():
    cfg = model_config(TransformerWrapper(num_tokens=8, max_seq_len=4, attn_layers=Decoder(dim=16, depth=1)))
    with pytest.raises(ValueError, match="format"):
        build_model({**cfg, "format": 99})
    with pytest.raises(ValueError, match="wrapper class 'Nope'"):
        build_model({**cfg, "class": "Nope"})
