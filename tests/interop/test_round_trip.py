"""to_hf(from_hf(m)) is m again: the same state-dict keys and bit-identical tensors, for each
family; save_hf writes a directory transformers loads, and load_hf reads it back."""

from __future__ import annotations

import json

import pytest
import torch

from polyformer.interop import from_hf, load_hf, save_hf, to_hf

from .hf_models import bert, gpt2, ids, llama, transformers

MODELS = [pytest.param(gpt2, "heads3_tied", id="gpt2-tied"), pytest.param(gpt2, "heads5_untied_exact_gelu", id="gpt2-untied"),
          pytest.param(bert, "heads5_types3", id="bert"), pytest.param(llama, "plain_untied", id="llama-untied"),
          pytest.param(llama, "gqa_tied_theta", id="llama-gqa-tied"),
          pytest.param(llama, "heads3_head_dim4_biases", id="llama-biases")]


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("make, shape", MODELS)
def test_to_hf_of_from_hf_is_the_original(make, shape):
    hf = make(shape)
    back = to_hf(from_hf(hf))
    assert type(back) is type(hf)
    assert_same_state(back, hf)
    for key in ("vocab_size", "tie_word_embeddings", "num_hidden_layers", "n_layer", "num_key_value_heads", "head_dim",
                "type_vocab_size", "rope_parameters", "layer_norm_epsilon", "rms_norm_eps", "activation_function"):
        if hasattr(hf.config, key):
            assert getattr(back.config, key) == getattr(hf.config, key), key


def test_round_trip_keeps_half_precision():
    hf = llama("gqa_tied_theta").to(torch.bfloat16)
    model = from_hf(hf)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert_same_state(to_hf(model), hf)


@pytest.mark.parametrize("make, shape", MODELS[:1] + MODELS[2:4])
def test_save_hf_loads_in_transformers_and_back(make, shape, tmp_path):
    hf = make(shape)
    model = from_hf(hf)
    out = save_hf(model, tmp_path / "hf", tokenizer_json='{"not": "checked"}')
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]      # no temporary left behind
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__]
    kwargs = {"add_pooling_layer": False} if make is bert else {}      # BertModel's pooler is not written
    loaded = getattr(transformers, type(hf).__name__).from_pretrained(out, **kwargs).eval()
    assert_same_state(loaded, hf)
    again = load_hf(out)
    assert_same_state(again, model)
    x = ids(hf.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), atol=0, rtol=0)


def test_load_hf_reads_a_save_pretrained_directory(tmp_path):
    hf = gpt2("heads3_tied")
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    x = ids(hf.config.vocab_size)
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max() <= 1e-5


def test_load_hf_reads_sharded_checkpoints(tmp_path):
    hf = llama("plain_untied")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert_same_state(to_hf(load_hf(tmp_path)), hf)


def test_to_hf_passes_extra_config_fields():
    back = to_hf(from_hf(llama("plain_untied")), eos_token_id=3, bos_token_id=1)
    assert back.config.eos_token_id == 3 and back.config.bos_token_id == 1
