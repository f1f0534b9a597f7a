"""polyformer -> Hugging Face: `to_hf` (a transformers model object) and `save_hf` (a model directory),
after `describe` has checked that one family expresses the model exactly."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..config import flatten, to_dict
from ..train.files import save_tensors, write_dir_atomic
from ..wrappers import TransformerWrapper
from .families import FAMILIES
from .family import Family, Unsupported

CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
# fields that change how a model runs or trains, not what it computes in eval mode
NOT_COMPARED = {"gradient_checkpointing", "attention.fused", "attention.dropout", "ff.dropout", "ff.chunks"}


def facts(model: TransformerWrapper) -> dict[str, Any]:
    """What a model computes, beyond its stack's config: the wrapper's parts as they were built."""
    logits = model.to_logits
    return {
        "causal": model.attn_layers.causal,
        "num_tokens": model.num_tokens,
        "max_seq_len": model.max_seq_len,
        "absolute positions": type(model.pos_emb).__name__ if model.pos_emb is not None else None,
        "tie_embedding": logits is None,
        "logits_bias": logits is not None and logits.bias is not None,
        "logits_dim": logits.out_features if logits is not None else model.num_tokens,
        "emb_dim": model.token_emb.embedding_dim,
        "post_emb_norm": model.post_emb_norm is not None,
        "post_emb_proj": model.post_emb_proj is not None,
        "embed_num_tokens": {k: e.num_embeddings for k, e in (model.embeds or {}).items()},
        "num_memory_tokens": model.num_memory_tokens,
    }


def differences(model: TransformerWrapper, family: Family, hf_config: dict[str, Any]) -> list[str]:
    """How `model` differs from the polyformer model of `hf_config` (empty: it is exactly that)."""
    stack_cls, layers, wrap = family.build({**family.defaults, **hf_config})
    with torch.device("meta"):
        ref = TransformerWrapper(attn_layers=stack_cls(**layers), **wrap)
    found = []
    mine, want = flatten(to_dict(model.attn_layers.cfg)), flatten(to_dict(ref.attn_layers.cfg))
    for key in sorted(set(mine) | set(want)):
        if key not in NOT_COMPARED and mine.get(key) != want.get(key):
            found.append(f"{key} is {mine.get(key)!r}, {family.model_type} needs {want.get(key)!r}")
    mine, want = facts(model), facts(ref)
    found += [f"{key} is {mine[key]!r}, {family.model_type} needs {want[key]!r}" for key in mine if mine[key] != want[key]]
    return found


def describe(model: TransformerWrapper) -> tuple[Family, dict[str, Any]]:
    """The family and Hugging Face config that express `model` exactly; `Unsupported` listing the
    differences to the closest family otherwise."""
    if not isinstance(model, TransformerWrapper):
        raise TypeError(f"to_hf takes a polyformer TransformerWrapper, got {type(model).__name__}")
    tried = []
    for family in FAMILIES.values():
        try:
            hf_config = family.config_of(model)
            found = differences(model, family, hf_config)
        except Unsupported as error:
            found = [str(error)]
        if not found:
            return family, hf_config
        tried.append((len(found), family.model_type, found))
    n, name, found = min(tried)
    raise Unsupported(f"this model cannot be written as a Hugging Face checkpoint: the closest family, {name} "
                      f"({FAMILIES[name].main_class}), differs in {n} way(s): {'; '.join(found)}. Supported: "
                      f"{', '.join(f.main_class for f in FAMILIES.values())}")


def hf_state_dict(model: TransformerWrapper, family: Family, hf_config: dict[str, Any],
                  with_tied: bool = True) -> dict[str, Tensor]:
    """The state dict of the family's main class (`Family.main_class`) holding `model`'s weights."""
    c = {**family.defaults, **hf_config}
    prefix = family.classes[family.main_class]
    ours = model.state_dict()
    out: dict[str, Tensor] = {}
    for link in family.links(c):
        for name, t in zip(link.theirs, link.to_theirs(ours[link.ours].detach())):
            out[name if link.absolute else prefix + name] = t
    if with_tied and family.tied_head is not None and c.get("tie_word_embeddings") and prefix:
        out[family.tied_head] = out[prefix + family.embedding]
    return out


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("to_hf needs the `transformers` package: pip install transformers") from error
    return transformers


def to_hf(model: TransformerWrapper, **config: Any) -> nn.Module:
    """A transformers model (GPT2LMHeadModel, BertModel or LlamaForCausalLM) with `model`'s weights,
    in eval mode. `config` adds Hugging Face config fields the polyformer model does not hold
    (bos_token_id, eos_token_id, pad_token_id, dropouts ...). Raises ValueError listing how the model
    differs from the closest family when it cannot be written exactly."""
    family, hf_config = describe(model)
    transformers = _transformers()
    hf_cfg = transformers.AutoConfig.for_model(family.model_type, **{**hf_config, **config})
    dtype = next(model.parameters()).dtype
    hf = getattr(transformers, family.main_class)(hf_cfg, **family.main_kwargs).to(dtype)
    hf.load_state_dict(hf_state_dict(model, family, hf_config), strict=True)
    return hf.eval()


def hf_config_dict(model: TransformerWrapper, **config: Any) -> dict[str, Any]:
    """The config.json `save_hf` writes for `model`."""
    return _config_dict(model, *describe(model), **config)


def _config_dict(model: TransformerWrapper, family: Family, hf_config: dict[str, Any], **config: Any) -> dict[str, Any]:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"architectures": [family.main_class], "model_type": family.model_type, **hf_config, "dtype": dtype,
            **config}


def save_hf(model: TransformerWrapper, directory: str | os.PathLike, *, tokenizer_json: str | None = None,
            **config: Any) -> Path:
    """Write a Hugging Face model directory (config.json, model.safetensors, and tokenizer.json when
    `tokenizer_json` is given) that `transformers` loads with `from_pretrained`; `config` as in `to_hf`.

    The directory is written under a temporary name and renamed into place, so it is complete or
    absent; an existing non-empty directory is refused (FileExistsError)."""
    family, hf_config = describe(model)
    tensors = hf_state_dict(model, family, hf_config, with_tied=False)
    text = json.dumps(_config_dict(model, family, hf_config, **config), indent=2, sort_keys=True) + "\n"

    def fill(tmp: Path) -> None:
        save_tensors(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / CONFIG).write_text(text, encoding="utf-8")
        if tokenizer_json is not None:
            (tmp / TOKENIZER).write_text(tokenizer_json, encoding="utf-8")

    return write_dir_atomic(directory, fill)
