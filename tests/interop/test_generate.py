"""Greedy generation of converted decoders, through polyformer's KV cache, gives the tokens of the
Hugging Face model's own `generate(do_sample=False)`, for plain and left-padded prompts."""

from __future__ import annotations

import pytest
import torch

from polyformer import AutoregressiveWrapper
from polyformer.interop import from_hf

from .hf_models import gpt2, ids, left_padding, llama

NEW = 12


@pytest.mark.parametrize("make, shape", [(gpt2, "heads3_tied"), (gpt2, "heads5_untied_exact_gelu"),
                                         (llama, "gqa_tied_theta"), (llama, "mqa_heads5")],
                         ids=["gpt2-tied", "gpt2-untied", "llama-gqa", "llama-mqa"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_greedy_tokens_equal_hf_generate(make, shape, padded):
    hf = make(shape)
    model = AutoregressiveWrapper(from_hf(hf))
    prompts = ids(hf.config.vocab_size, b=3, n=6)
    mask = left_padding(3, 6) if padded else None
    ours = model.generate(prompts, NEW, temperature=0.0, mask=mask)
    theirs = hf.generate(prompts, attention_mask=mask.long() if padded else None, max_new_tokens=NEW,
                         min_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, prompts.shape[1]:]
    assert torch.equal(ours, theirs), f"\nours   {ours.tolist()}\ntheirs {theirs.tolist()}"
    assert len(set(ours.flatten().tolist())) > 3          # not one repeated token
