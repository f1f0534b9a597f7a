"""Nyströmformer: hidden states equal Hugging Face's `NystromformerModel` on random models of several
shapes (landmarks of one and several positions, with and without the convolution, token types), at the
one length Hugging Face approximates at, and at any length (and with padding) where it computes exact
softmax; its batch-wide pseudo-inverse start is needed to match; and back again."""

from __future__ import annotations

import pytest
import torch

from polyformer.attention.kernels.nystrom import Nystrom
from polyformer.interop import from_hf, to_hf
from polyformer.interop.family import Unsupported

from .hf_models import spread, transformers

SHAPES = {
    "heads4_landmarks4_conv3": dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=24, max_position_embeddings=40, segment_means_seq_len=16,
                                    num_landmarks=4, conv_kernel_size=3),
    "heads3_landmarks6_no_conv_types3": dict(vocab_size=40, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
                                             intermediate_size=20, max_position_embeddings=30, segment_means_seq_len=12,
                                             num_landmarks=6, conv_kernel_size=None, type_vocab_size=3,
                                             hidden_act="gelu"),
    "one_head_landmarks2_conv5": dict(vocab_size=30, hidden_size=8, num_hidden_layers=3, num_attention_heads=1,
                                      intermediate_size=16, max_position_embeddings=20, segment_means_seq_len=10,
                                      num_landmarks=2, conv_kernel_size=5, layer_norm_eps=1e-12),
    "exact_heads2": dict(vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=16, max_position_embeddings=24, segment_means_seq_len=8, num_landmarks=8,
                         conv_kernel_size=None),
}
TOL = 1e-5


def nystromformer(shape: str, seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    fields = {**SHAPES[shape], **extra}
    no_conv = fields.get("conv_kernel_size", 1) is None
    config = transformers.NystromformerConfig(**{k: v for k, v in fields.items() if v is not None})
    if no_conv:         # transformers 5.23 types conv_kernel_size as int, yet None is its "no convolution"
        object.__setattr__(config, "conv_kernel_size", None)
    return spread(transformers.NystromformerModel(config), seed)


def inputs(hf: torch.nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(2, hf.config.vocab_size, (3, n), generator=g)
    return x, torch.randint(0, hf.config.type_vocab_size, (3, n), generator=g)


@pytest.mark.parametrize("shape", SHAPES)
def test_hidden_states_equal_hugging_face(shape):
    hf = nystromformer(shape)
    model = from_hf(hf)
    x, types = inputs(hf, hf.config.segment_means_seq_len)
    with torch.no_grad():
        theirs = hf(x, token_type_ids=types).last_hidden_state
        assert theirs.abs().max() > 0.5
        assert (model(x, embed_ids={"token_type": types}, return_embeddings=True) - theirs).abs().max() <= TOL


@pytest.mark.parametrize("n", [5, 13, 24])
def test_exact_softmax_at_any_length_and_with_padding(n):
    """num_landmarks == segment_means_seq_len: Hugging Face computes softmax attention at every length,
    and takes a padding mask (without the convolution, which would read padded values)."""
    hf = nystromformer("exact_heads2")
    model = from_hf(hf)
    x, _ = inputs(hf, n)
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, n - 2:] = False
    mask[2, n // 2:] = False
    with torch.no_grad():
        theirs = hf(x, attention_mask=mask.long()).last_hidden_state
        ours = model(x, mask=mask, return_embeddings=True)
    assert (ours[mask] - theirs[mask]).abs().max() <= TOL


def test_the_batch_wide_pseudo_inverse_start_is_what_matches():
    hf = nystromformer("heads4_landmarks4_conv3")
    model = from_hf(hf)
    x, _ = inputs(hf, 16)
    with torch.no_grad():
        theirs = hf(x).last_hidden_state
        for module in model.modules():
            if isinstance(module, Nystrom):
                assert module.pinv_init == "batch"
                module.pinv_init = "row"
        assert (model(x, return_embeddings=True) - theirs).abs().max() > 100 * TOL
        assert torch.equal(model(x[:1], return_embeddings=True), model(x, return_embeddings=True)[:1])


def test_to_hf_gives_the_same_model_back():
    hf = nystromformer("heads4_landmarks4_conv3")
    back = to_hf(from_hf(hf))
    assert type(back) is type(hf)
    assert (back.config.num_landmarks, back.config.conv_kernel_size, back.config.inv_coeff_init_option) == (4, 3, False)
    assert back.config.segment_means_seq_len % 4 == 0
    theirs, ours = hf.state_dict(), back.state_dict()
    assert list(theirs) == list(ours)
    for name in theirs:
        if name == "embeddings.position_embeddings.weight":     # rows 0 and 1 are never read
            assert torch.equal(theirs[name][2:], ours[name][2:])
        else:
            assert torch.equal(theirs[name], ours[name]), name
    x, _ = inputs(hf, back.config.segment_means_seq_len)       # the length it approximates at now
    with torch.no_grad():
        assert (back(x).last_hidden_state - from_hf(hf)(x, return_embeddings=True)).abs().max() <= TOL


def test_an_even_convolution_is_refused_by_name():
    with pytest.raises(Unsupported, match="conv_kernel_size"):
        from_hf(nystromformer("heads4_landmarks4_conv3", conv_kernel_size=4))


def test_the_per_sample_start_is_not_written():
    """Hugging Face runs only the batch-wide start: a model with polyformer's default is refused by name."""
    from polyformer.build import build_model, model_config

    config = model_config(from_hf(nystromformer("heads4_landmarks4_conv3")))
    config["layers"]["config"]["attention"]["kernel"]["options"]["pinv_init"] = "row"
    with pytest.raises(Unsupported, match="pinv_init is 'row'"):
        to_hf(build_model(config))
