"""polyformer -> Hugging Face: `to_hf` (a transformers model object) and `save_hf` (a model directory),
after `describe` has checked that one family expresses the model exactly."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..config import flatten, to_dict
from ..encoder_decoder import XTransformer
from ..train.files import save_tensors, write_dir_atomic
from ..wrappers import TransformerWrapper
from .families import RECORDS
from .family import Family, Unsupported, make_model, wrappers_of

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
        "abs_pos_per_layer / randomized_pos": (model.attn_layers.layer_pos is not None, model.randomized_pos),
        "tie_embedding": logits is None,
        "logits_bias": logits is not None and logits.bias is not None,
        "logits_dim": logits.out_features if logits is not None else model.num_tokens,
        "emb_dim": model.token_emb.embedding_dim,
        "post_emb_norm": model.post_emb_norm is not None,
        "post_emb_proj": model.post_emb_proj is not None,
        "embed_num_tokens": {k: e.num_embeddings for k, e in (model.embeds or {}).items()},
        "num_memory_tokens": model.num_memory_tokens,
    }


def differences(model: TransformerWrapper | XTransformer, family: Family, hf_config: dict[str, Any]) -> list[str]:
    """How `model` differs from the polyformer model of `hf_config` (empty: it is exactly that)."""
    with torch.device("meta"):
        ref = make_model(family, {**family.defaults, **hf_config})
    found = []
    parts, ref_parts = wrappers_of(model), wrappers_of(ref)
    for part, wrapper in parts.items():
        at = f"{part}: " if part else ""
        mine, want = flatten(to_dict(wrapper.attn_layers.cfg)), flatten(to_dict(ref_parts[part].attn_layers.cfg))
        for key in sorted(set(mine) | set(want)):
            if key not in NOT_COMPARED and mine.get(key) != want.get(key):
                found.append(f"{at}{key} is {mine.get(key)!r}, {family.model_type} needs {want.get(key)!r}")
        mine, want = facts(wrapper), facts(ref_parts[part])
        found += [f"{at}{key} is {mine[key]!r}, {family.model_type} needs {want[key]!r}"
                  for key in mine if mine[key] != want[key]]
    if isinstance(model, XTransformer):
        mine, want = (m.encoder.token_emb is m.decoder.net.token_emb for m in (model, ref))
        if mine != want:
            found.append(f"tie_token_emb is {mine!r}, {family.model_type} needs {want!r}")
    return found


def describe(model: TransformerWrapper | XTransformer) -> tuple[Family, dict[str, Any]]:
    """The family and Hugging Face config that express `model` exactly; `Unsupported` listing the
    differences to the closest family otherwise."""
    if not isinstance(model, (TransformerWrapper, XTransformer)):
        raise TypeError(f"to_hf takes a polyformer TransformerWrapper or XTransformer, got {type(model).__name__}")
    pair = isinstance(model, XTransformer)
    candidates = [f for f in RECORDS if f.encoder_decoder == pair]
    if not candidates:
        raise Unsupported(f"no supported Hugging Face family is an {type(model).__name__}")
    tried = []
    for family in candidates:
        refused = False
        try:
            hf_config = family.config_of(model)
            found = differences(model, family, hf_config)
        except Unsupported as error:    # the family cannot even describe the model: the farthest
            refused, found = True, [str(error)]
        if not found:
            return family, hf_config
        tried.append((refused, len(found), f"{family.model_type} ({family.main_class})", found))
    _, n, name, found = min(tried)
    raise Unsupported(f"this model cannot be written as a Hugging Face checkpoint: the closest family, {name}, "
                      f"differs in {n} way(s): {'; '.join(found)}. Supported: "
                      f"{', '.join(f.main_class for f in candidates)}")


def hf_state_dict(model: TransformerWrapper | XTransformer, family: Family, hf_config: dict[str, Any],
                  with_tied: bool = True) -> dict[str, Tensor]:
    """The state dict of the family's main class (`Family.main_class`) holding `model`'s weights;
    `with_tied`: with the tensors that repeat another (tied head, aliases)."""
    c = {**family.defaults, **hf_config}
    prefix = family.classes[family.main_class]
    ours = model.state_dict()
    out: dict[str, Tensor] = {}
    for link in family.links(c):
        for name, t in zip(link.theirs, link.to_theirs(ours[link.ours].detach())):
            out[name if link.absolute else prefix + name] = t
    if with_tied and family.tied_head is not None and c.get("tie_word_embeddings") and prefix:
        out[family.tied_head] = out[prefix + family.embedding]
    if with_tied and family.aliases is not None:
        for name, source in family.aliases(c).items():
            out[prefix + name] = out[prefix + source]
    if family.zeros is not None:
        like = next(iter(ours.values()))
        for name, shape in family.zeros(c).items():
            out[prefix + name] = like.new_zeros(shape)
    return out


def untie(hf: nn.Module, state: dict[str, Tensor]) -> None:
    """Give a parameter that `hf` shares between names (a tied LM head) a copy of its own where `state`
    holds different values for them, as `from_pretrained` does for such a checkpoint."""
    shared: dict[int, list[str]] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    for names in shared.values():
        for name in names[1:]:
            if name in state and names[0] in state and not torch.equal(state[name], state[names[0]]):
                owner, _, attr = name.rpartition(".")
                module = hf.get_submodule(owner)
                setattr(module, attr, nn.Parameter(getattr(module, attr).detach().clone()))


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("to_hf needs the `transformers` package: pip install transformers") from error
    return transformers


def to_hf(model: TransformerWrapper | XTransformer, **config: Any) -> nn.Module:
    """A transformers model (GPT2LMHeadModel, BertModel, LlamaForCausalLM, T5ForConditionalGeneration, ...)
    with `model`'s weights, in eval mode. `config` adds Hugging Face config fields the polyformer model
    does not hold (bos_token_id, eos_token_id, pad_token_id, decoder_start_token_id, dropouts ...).
    Raises ValueError listing how the model differs from the closest family when it cannot be
    written exactly."""
    family, hf_config = describe(model)
    transformers = _transformers()
    hf_cfg = transformers.AutoConfig.for_model(family.model_type, **{**hf_config, **config})
    dtype = next(model.parameters()).dtype
    hf = getattr(transformers, family.main_class)(hf_cfg, **family.main_kwargs).to(dtype)
    state = hf_state_dict(model, family, hf_config)
    untie(hf, state)
    for name, t in hf.state_dict().items():     # tables rebuilt from the config (RoFormer's float64 sinusoids)
        if name not in state and any(re.fullmatch(p, name) for p in family.derived):
            state[name] = t
    hf.load_state_dict(state, strict=True)
    return hf.eval()


def hf_config_dict(model: TransformerWrapper | XTransformer, **config: Any) -> dict[str, Any]:
    """The config.json `save_hf` writes for `model`."""
    return _config_dict(model, *describe(model), **config)


def _config_dict(model: TransformerWrapper | XTransformer, family: Family, hf_config: dict[str, Any],
                 **config: Any) -> dict[str, Any]:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"architectures": [family.main_class], "model_type": family.model_type, **hf_config, "dtype": dtype,
            **config}


def save_hf(model: TransformerWrapper | XTransformer, directory: str | os.PathLike, *,
            tokenizer_json: str | None = None, **config: Any) -> Path:
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
