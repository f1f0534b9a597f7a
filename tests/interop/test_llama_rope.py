"""Llama checkpoints with rope types "dynamic", "yarn" and "longrope" (polyformer/interop/llama.py ->
position/rotary_scaling.py): from_hf logits equal Hugging Face's within 1e-5 at lengths below and above the
original context, to_hf writes them back, and greedy generation through the decode state gives Hugging Face's
`generate` tokens: both keep each cached key rotated as it was when computed (Hugging Face's convention)."""

from __future__ import annotations

import pytest
import torch

from polyformer import AutoregressiveWrapper
from polyformer.interop import from_hf, to_hf
from polyformer.interop.family import Unsupported

from .hf_models import NO_SPECIALS, ids, spread, transformers

TOL = 1e-5
SHAPE = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=16)
ROPES = {   # head_dim 16: 8 rotated pairs
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_betas_mscale": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 3.0,
                          "original_max_position_embeddings": 8, "beta_fast": 8.0, "beta_slow": 2.0, "mscale": 0.7,
                          "mscale_all_dim": 0.3, "truncate": False},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + i for i in range(8)]},
}
ORIGINAL = {"dynamic": 16, "yarn": 16, "yarn_betas_mscale": 8, "longrope": 8}


def llama_rope(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SHAPE, **NO_SPECIALS, rope_parameters=ROPES[name])
    return spread(transformers.LlamaForCausalLM(config), seed)


@pytest.mark.parametrize("name", ROPES)
def test_logits_equal_hf_below_and_above_the_original_context(name):
    hf = llama_rope(name)
    model = from_hf(hf)
    # ascending: Hugging Face's dynamic rope keeps the frequencies of the longest length seen (a stateful cache)
    lengths = (ORIGINAL[name] // 2, ORIGINAL[name], ORIGINAL[name] + 1, 2 * ORIGINAL[name] + 3)
    for n in lengths:
        x = ids(40, b=2, n=n, seed=n)
        with torch.no_grad():
            ours, theirs = model(x), hf(x).logits
        assert theirs.abs().max() > 0.5
        assert (ours - theirs).abs().max() <= TOL, n


@pytest.mark.parametrize("name", ROPES)
def test_to_hf_writes_the_rope_type_back(name):
    model = from_hf(llama_rope(name))
    back = to_hf(model)
    assert back.config.rope_parameters["rope_type"] == ROPES[name]["rope_type"]
    x = ids(40, b=2, n=2 * ORIGINAL[name] + 1)
    with torch.no_grad():
        assert (back(x).logits - model(x)).abs().max() <= TOL


@pytest.mark.parametrize("name", ["dynamic", "longrope", "yarn"])
def test_greedy_generation_past_the_original_context_equals_hf_generate(name):
    """The prompt fits the original context, the continuation leaves it: the frequencies of dynamic NTK and
    LongRoPE change on the way, and cached keys keep their rotation on both sides."""
    hf = llama_rope(name)
    model = AutoregressiveWrapper(from_hf(hf))
    prompts = ids(40, b=2, n=ORIGINAL[name] - 3)
    new = ORIGINAL[name] + 4
    state = model.new_state(2, prompts.shape[1] + new)     # room for all: generate slides a state past max_seq_len
    ours = model.generate(prompts, new, temperature=0.0, state=state)
    theirs = hf.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0)[:, prompts.shape[1]:]
    assert torch.equal(ours, theirs), f"\nours   {ours.tolist()}\ntheirs {theirs.tolist()}"
    assert len(set(ours.flatten().tolist())) > 3


def test_unsupported_rope_parameters_and_layouts_are_refused_by_name():
    with pytest.raises(Unsupported, match="beta_medium"):
        from_hf(llama_rope("yarn").__class__(transformers.LlamaConfig(
            **SHAPE, **NO_SPECIALS, rope_parameters={**ROPES["yarn"], "beta_medium": 3.0})))
    model = from_hf(llama_rope("dynamic"))
    model.max_seq_len = 32      # Hugging Face's dynamic NTK reads its original context from max_position_embeddings
    with pytest.raises(Unsupported, match="original_max_len"):
        to_hf(model)
