"""FNet (attn_fnet): the mixing sublayer is Re(DFT over the sequence of DFT over the features) of the
block's input, has no parameters, hides padding by zeroing it (the transform length still counts it),
and is refused where it cannot apply (a Decoder, return_attn, attention keywords it would ignore)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder, LayersConfig, TransformerWrapper
from polyformer.config import from_dict, to_dict
from polyformer.interfaces import Context
from polyformer.mixers.fnet import FNet, fourier_mix
from tests.options import perturb

DIM = 12


def dft(n: int) -> torch.Tensor:
    """The n x n DFT matrix exp(-2πi jk / n), in complex128."""
    j = torch.arange(n, dtype=torch.float64)
    return torch.exp(-2j * math.pi * torch.outer(j, j) / n)


def reference(x: torch.Tensor) -> torch.Tensor:
    """Re(F_n X F_d) per batch row: the published formula, written as two matrix products."""
    n, d = x.shape[-2:]
    return (dft(n) @ x.to(torch.complex128) @ dft(d)).real


def encoder(**keywords) -> Encoder:
    torch.manual_seed(0)
    return perturb(Encoder(dim=DIM, depth=2, attn_fnet=True, **keywords)).eval()


def test_mixing_is_the_real_part_of_the_2d_dft():
    x = torch.randn(2, 7, DIM, dtype=torch.float64)
    out = FNet(DIM, encoder().cfg)(x, Context(pos=torch.arange(7)[None])).out
    assert_close(out, reference(x), rtol=1e-12, atol=1e-10)
    assert_close(out, torch.fft.fft2(x).real, rtol=1e-12, atol=1e-12)
    # both axes are transformed: the sequence-only transform differs
    assert not torch.allclose(out, torch.fft.fft(x, dim=1).real)


@pytest.mark.parametrize("pre_norm", [True, False])
def test_block_mixes_its_input(pre_norm):
    stack = encoder(pre_norm=pre_norm)
    x = torch.randn(2, 9, DIM)
    _, record = stack(x, return_intermediates=True)
    block = stack.blocks[0]
    if pre_norm:                     # x + Re(FFT2(norm(x)))
        expected = x + torch.fft.fft2(block.norm_in(x)).real
    else:                            # norm(x + Re(FFT2(x))), FNet's and BERT's post-norm layer
        expected = block.post_norm(x + torch.fft.fft2(x).real)
    assert_close(record.hiddens[1], expected, rtol=1e-5, atol=1e-5)


def test_the_mixer_has_no_parameters():
    stack = encoder()
    mixers = [b.branch for b in stack.blocks if b.kind == "a"]
    assert len(mixers) == 2 and all(isinstance(m, FNet) for m in mixers)
    assert all(not list(m.parameters()) and not list(m.buffers()) for m in mixers)
    assert not [k for k in stack.state_dict() if ".branch." in k and k.startswith(("blocks.0.", "blocks.2."))]
    # what remains is the norms and feedforwards alone
    plain = Encoder(dim=DIM, depth=2, attn_fnet=True, custom_layers=("f", "f"))
    assert sum(p.numel() for p in stack.parameters()) == sum(p.numel() for p in plain.parameters()) + 2 * 2 * DIM


def test_padding_is_zeroed_but_counts_in_the_length():
    x = torch.randn(2, 8, DIM)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 5:] = False
    mask[1, 2] = False
    mixer = FNet(DIM, encoder().cfg)
    out = mixer(x, Context(pos=torch.arange(8)[None], mask=mask)).out
    assert_close(out, torch.fft.fft2(torch.where(mask[..., None], x, 0.0)).real)
    y = torch.where(mask[..., None], x, torch.randn(2, 8, DIM))      # other content at padded positions
    assert_close(mixer(y, Context(pos=torch.arange(8)[None], mask=mask)).out[mask], out[mask])
    # the transform has length 8, not the 5 kept tokens of row 0
    assert not torch.allclose(out[0, :5], torch.fft.fft2(x[0, :5]).real)


def test_bfloat16_computes_in_float32_and_casts_back():
    x = torch.randn(2, 6, DIM).bfloat16()
    out = fourier_mix(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.fft.fft2(x.float()).real.bfloat16())
    model = TransformerWrapper(num_tokens=16, max_seq_len=8, attn_layers=encoder()).to(torch.bfloat16)
    assert model(torch.arange(6)[None]).dtype == torch.bfloat16


def test_a_decoder_is_refused_by_name():
    with pytest.raises(ValueError, match="attn_fnet.*cannot be causal"):
        Decoder(dim=DIM, depth=1, attn_fnet=True)


def test_return_attn_is_refused_by_name():
    model = TransformerWrapper(num_tokens=16, max_seq_len=8, attn_layers=encoder())
    with pytest.raises(ValueError, match="return_attn.*attn_fnet"):
        model(torch.arange(6)[None], return_attn=True)


def test_xl_memories_are_refused():
    with pytest.raises(ValueError, match="max_mem_len=4.*attn_fnet"):
        TransformerWrapper(num_tokens=16, max_seq_len=8, attn_layers=encoder(), max_mem_len=4)


@pytest.mark.parametrize("keywords, match", [
    (dict(attn_qkv_bias=True), "attn_qkv_bias would do nothing"),
    (dict(gate_values=True, attn_dropout=0.1), "attn_dropout / .*gate_values"),
    (dict(attn_kv_heads=2), "attn_kv_heads"),
    (dict(rotary_pos_emb=True), "attn_fnet has no queries, keys or values: .*rotary_pos_emb"),
    (dict(rel_pos_bias=True), "attn_fnet cannot take the stack.s score bias"),
    (dict(attn_window=4), "attn_fnet cannot combine with a sparse attention pattern"),
])
def test_attention_keywords_it_would_ignore_are_refused(keywords, match):
    with pytest.raises(ValueError, match=match):
        Encoder(dim=DIM, depth=1, heads=2, attn_fnet=True, **keywords)


def test_cross_attention_blocks_keep_their_attention_keywords():
    stack = Encoder(dim=DIM, depth=1, heads=2, attn_fnet=True, cross_attend=True, attn_qkv_bias=True)
    assert isinstance(stack.blocks[0].branch, FNet)
    assert any(n.endswith("bias") for n, _ in stack.blocks[1].branch.project.named_parameters())
    with pytest.raises(ValueError, match="rotary_pos_emb.*would do nothing.*cross-attention reads no positions"):
        Encoder(dim=DIM, depth=1, heads=2, attn_fnet=True, cross_attend=True, rotary_pos_emb=True)


def test_config_round_trips_through_json():
    cfg = encoder().cfg
    assert cfg.mixer.name == "fnet" and cfg.mixer.options is None
    assert from_dict(LayersConfig, json.loads(json.dumps(to_dict(cfg)))) == cfg
