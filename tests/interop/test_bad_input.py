"""Checkpoints that do not fit fail with one error naming everything that did not match, and no
model is returned: unsupported architectures and options, missing or extra tensors, wrong shapes,
a tied head that is not tied; models that no Hugging Face family expresses are refused by to_hf."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyformer import Decoder, Encoder, TransformerWrapper
from polyformer.interop import SUPPORTED, Unsupported, from_hf, load_hf, save_hf, to_hf

from .hf_models import bert, gpt2, llama, transformers


def saved(model, path):
    model.save_pretrained(path)
    return path


def edit_weights(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def edit_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def test_unsupported_architecture_names_it_and_the_supported_ones():
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16))
    with pytest.raises(Unsupported) as err:
        from_hf(neox)
    msg = str(err.value)
    assert "'GPTNeoXForCausalLM'" in msg and "'gpt_neox'" in msg
    assert all(name in msg for name in SUPPORTED)
    head = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=16))
    with pytest.raises(Unsupported, match="'BertForMaskedLM'.*model.bert"):
        from_hf(head)
    assert from_hf(head.bert, ignore=["pooler"]) is not None
    classifier = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=32, n_embd=8, n_layer=1, n_head=2, n_positions=16))
    with pytest.raises(Unsupported, match="'GPT2ForSequenceClassification'.*model.transformer"):
        from_hf(classifier)
    assert from_hf(classifier.transformer) is not None
    llama = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16))
    with pytest.raises(Unsupported) as err:             # its base model (LlamaModel) has no LM head
        from_hf(llama)
    assert "base model" not in str(err.value)
    with pytest.raises(TypeError, match="transformers model"):
        from_hf(torch.nn.Linear(2, 2))


def test_missing_and_extra_tensors_are_all_listed(tmp_path):
    path = saved(gpt2("heads3_tied"), tmp_path)

    def change(tensors):
        del tensors["transformer.h.1.mlp.c_fc.bias"]
        del tensors["transformer.ln_f.weight"]
        tensors["transformer.h.0.attn.extra_gate"] = torch.zeros(3)
    edit_weights(path, change)
    with pytest.raises(ValueError) as err:
        load_hf(path)
    msg = str(err.value)
    assert "2 tensor(s) missing" in msg and "h.1.mlp.c_fc.bias" in msg and "ln_f.weight" in msg
    assert "1 tensor(s) with no place" in msg and "h.0.attn.extra_gate" in msg
    with pytest.raises(ValueError, match="missing"):          # ignoring the extra one leaves the missing ones
        load_hf(path, ignore=["h.0.attn.extra_gate"])


def test_ignore_leaves_out_named_tensors_only(tmp_path):
    path = saved(gpt2("heads3_tied"), tmp_path)
    edit_weights(path, lambda t: t.update({"value_head.weight": torch.zeros(2, 12), "value_head.bias": torch.zeros(2)}))
    with pytest.raises(ValueError, match="2 tensor.*no place") as err:
        load_hf(path)
    assert "value_head.weight" in str(err.value) and "value_head.bias" in str(err.value)
    with pytest.raises(ValueError, match="value_head.bias"):
        load_hf(path, ignore=["value_head.weight"])
    assert isinstance(load_hf(path, ignore=["value_head"]), TransformerWrapper)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    path = saved(llama("gqa_tied_theta"), tmp_path)
    edit_config(path, num_key_value_heads=3)           # the file holds 2 kv heads of 4 features
    with pytest.raises(ValueError) as err:
        load_hf(path)
    msg = str(err.value)
    assert "of another shape" in msg
    assert "layers.0.self_attn.k_proj.weight (checkpoint (8, 24), expected (12, 24))" in msg
    assert "layers.1.self_attn.v_proj.weight" in msg


def test_tied_head_must_equal_the_embedding(tmp_path):
    path = saved(gpt2("heads3_tied"), tmp_path)
    edit_weights(path, lambda t: t.update({"lm_head.weight": torch.randn(64, 12)}))
    with pytest.raises(ValueError, match="lm_head.weight differs from wte.weight.*tie_word_embeddings"):
        load_hf(path)


@pytest.mark.parametrize("make, fields, match", [
    (gpt2, dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (gpt2, dict(activation_function="relu"), "activation_function='relu'.*supported"),
    (llama, dict(rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0}),
     "rope type 'proportional'"),
    (llama, dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "attention_factor": 0.5}),
     r"rope parameters \['attention_factor'\]"),
    (bert, dict(position_embedding_type="relative_key"), "position_embedding_type='relative_key'"),
    (bert, dict(is_decoder=True), "is_decoder"),
], ids=["gpt2-layer-scaling", "gpt2-relu", "llama-rope-proportional", "llama-rope-attention-factor", "bert-relative",
        "bert-decoder"])
def test_unsupported_options_are_named(make, fields, match, tmp_path):
    path = saved(make(), tmp_path)
    edit_config(path, **fields)
    with pytest.raises(Unsupported, match=match):
        load_hf(path)


def test_directory_problems(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)
    path = saved(gpt2(), tmp_path / "m")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        load_hf(path)


@pytest.mark.parametrize("stack, layers, wrap, match", [
    (Decoder, dict(rotary_pos_emb=True, ff_glu=True), {}, "llama.*ff.activation is 'gelu', llama needs 'swish'"),
    (Decoder, dict(attn_qkv_bias=True, attn_out_bias=True, ff_gelu_tanh=True), dict(tie_embedding=True, num_memory_tokens=2),
     "gpt2.*num_memory_tokens is 2, gpt2 needs 0"),
    (Encoder, dict(pre_norm=False, attn_qkv_bias=True, attn_out_bias=True), dict(tie_embedding=True),
     "bert.*post_emb_norm is False, bert needs True"),
])
def test_to_hf_refuses_models_no_family_expresses(stack, layers, wrap, match):
    model = TransformerWrapper(num_tokens=32, max_seq_len=16, attn_layers=stack(dim=16, depth=1, heads=2, **layers), **wrap)
    with pytest.raises(Unsupported, match=match):
        to_hf(model)
    with pytest.raises(TypeError, match="TransformerWrapper"):
        to_hf(model.attn_layers)


def test_save_hf_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        save_hf(from_hf(gpt2()), tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
