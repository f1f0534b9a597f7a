"""Prefix-LM (the Wikipedia seed's prefix mask): bidirectional over the prefix, causal after."""

import pytest
import torch
from torch.testing import assert_close

from polyformer import Encoder
from tests.helpers import ids, tiny_encoder, tiny_lm
from tests.options import perturb


def changed(x, t):
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % 64
    return y


@pytest.mark.parametrize("options", [{}, dict(rotary_pos_emb=True, num_memory_tokens=2),
                                     dict(attn_num_mem_kv=2, shift_tokens=1), dict(rel_pos_bias=True),
                                     dict(attn_flash=False)], ids=["plain", "rotary_memtok", "memkv_shift", "t5", "reference"])
def test_prefix_is_bidirectional_and_the_rest_causal(options):
    model = perturb(tiny_lm(**options))
    x = ids(2, 10)
    out = model(x, prefix_len=4)
    assert (model(changed(x, 3), prefix_len=4)[:, :3] - out[:, :3]).abs().max() > 1e-4   # prefix sees its future
    assert_close(model(changed(x, 6), prefix_len=4)[:, :6], out[:, :6], rtol=0, atol=0)   # after it: causal
    # empty prefix = causal (a keep-mask where plain causal has none: in float32 training the two may run
    # on different fused kernels, SDPA and our CPU kernel, which round differently)
    assert_close(model(x, prefix_len=0), model(x), rtol=1e-5, atol=1e-6)


def test_whole_sequence_as_prefix_equals_an_encoder_with_the_same_weights():
    decoder_lm = perturb(tiny_lm())
    encoder_lm = tiny_encoder()
    encoder_lm.load_state_dict(decoder_lm.state_dict())
    x = ids(2, 10)
    assert_close(decoder_lm(x, prefix_len=10), encoder_lm(x), atol=1e-5, rtol=1e-5)


def test_per_row_prefixes_and_cached_continuation():
    model = perturb(tiny_lm(rotary_pos_emb=True))
    x = ids(2, 10)
    lengths = torch.tensor([4, 1])
    full = model(x, prefix_len=lengths)
    for row in range(2):        # a batch of 2 and a row alone differ only by float summation order (~1e-6)
        assert_close(full[row:row + 1], model(x[row:row + 1], prefix_len=int(lengths[row])), atol=1e-5, rtol=0)
    state = model.new_state(2, 10)
    cached = torch.cat((model(x[:, :6], prefix_len=lengths, state=state), model(x[:, 6:], state=state)), dim=1)
    assert_close(cached, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, error, match", [
    (11, ValueError, r"\[0, seq_len=10\]"),
    (-1, ValueError, "prefix_len"),
    (torch.tensor([1, 2, 3]), ValueError, r"\(batch,\)"),
    (torch.tensor([1.5, 2.0]), TypeError, "integer"),
])
def test_bad_prefix_len_is_refused(bad, error, match):
    with pytest.raises(error, match=match):
        tiny_lm()(ids(2, 10), prefix_len=bad)


def test_prefix_len_needs_a_causal_stack():
    with pytest.raises(ValueError, match="not causal"):
        tiny_lm(Encoder)(ids(2, 10), prefix_len=3)
