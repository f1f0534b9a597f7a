"""Hugging Face checkpoints in and out: GPT-2, BERT (as `BertModel`) and Llama.

    model = from_hf(hf_model)                 # a transformers model object -> TransformerWrapper
    model = load_hf("path/to/dir")            # config.json + model.safetensors, without transformers
    hf_model = to_hf(model)                   # TransformerWrapper -> a transformers model object
    save_hf(model, "path/to/dir")             # config.json + model.safetensors, written atomically

Every option is an ordinary polyformer keyword (attn_qkv_bias, post_emb_norm, embed_num_tokens, ...),
so a converted model is a plain `TransformerWrapper`: `build_model(model_config(model))` rebuilds it.
Conversion is strict: a missing tensor, a tensor with no place in the model, a shape that does not
fit or an option polyformer cannot reproduce raises `ValueError` naming them all, and nothing
half-converted is returned. Dropout probabilities are not carried over (polyformer's dropouts sit
elsewhere than the residual dropouts of these models): converted models have none, and `to_hf`
writes 0 for every dropout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor, nn

from ..config import to_dict
from ..train.files import fsync_dir
from ..wrappers import TransformerWrapper
from .bert import BERT
from .family import Family, Link, Unsupported
from .gpt2 import GPT2
from .llama import LLAMA

FAMILIES: dict[str, Family] = {f.model_type: f for f in (GPT2, BERT, LLAMA)}
SUPPORTED: tuple[str, ...] = tuple(cls for f in FAMILIES.values() for cls in f.classes)
CONFIG, WEIGHTS, INDEX, TOKENIZER = "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
# fields that change how a model runs or trains, not what it computes in eval mode
NOT_COMPARED = {"gradient_checkpointing", "attention.fused", "attention.dropout", "ff.dropout"}


def family_of(class_name: str | None, model_type: str | None) -> Family:
    """The family of a Hugging Face model class; `Unsupported` naming it and the supported ones."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is not None and class_name is None:
        return family
    if family is None or class_name not in family.classes:
        hint = ""
        if family is not None:
            hint = (f" (a model with a task head converts through its base model, e.g. "
                    f"{'model.bert' if family is BERT else 'its base model attribute'})")
        raise Unsupported(f"unsupported architecture {class_name!r} (model type {model_type!r}); supported: "
                          f"{', '.join(SUPPORTED)}{hint}")
    return family


# ---- Hugging Face -> polyformer ------------------------------------------------------------------

def from_hf(hf_model: nn.Module, *, ignore: Iterable[str] = ()) -> TransformerWrapper:
    """A polyformer `TransformerWrapper` with the weights of a transformers model, in eval mode.

    GPT2LMHeadModel / GPT2Model and LlamaForCausalLM give a decoder whose `model(ids)` returns the
    Hugging Face logits; BertModel gives an encoder whose `model(ids, mask=mask,
    return_embeddings=True)` returns the last hidden states (token types through
    `embed_ids={"token_type": ids}`, 0 when not given).

    Args:
        hf_model: a transformers model of a supported class (`SUPPORTED`).
        ignore: names (or name prefixes, e.g. "pooler") of its tensors to leave out on purpose;
            any other tensor without a place in the polyformer model is an error.
    """
    if not isinstance(hf_model, nn.Module) or not hasattr(hf_model, "config"):
        raise TypeError(f"from_hf takes a transformers model (an nn.Module with a .config), got {type(hf_model).__name__}")
    name = type(hf_model).__name__
    config = hf_model.config.to_dict()
    family = family_of(name, config.get("model_type"))
    return convert(family, name, config, hf_model.state_dict(), ignore)


def load_hf(directory: str | os.PathLike, *, ignore: Iterable[str] = ()) -> TransformerWrapper:
    """`from_hf` for a Hugging Face model directory (config.json and model.safetensors, or sharded
    model-*.safetensors with model.safetensors.index.json); needs `safetensors`, not `transformers`."""
    path = Path(directory)
    if not (path / CONFIG).is_file():
        raise FileNotFoundError(f"{str(path / CONFIG)!r} does not exist: {str(path)!r} is not a Hugging Face model directory")
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{str(path / CONFIG)!r} is not readable JSON ({error})") from error
    architectures = config.get("architectures") or [None]
    family = family_of(architectures[0], config.get("model_type"))
    name = architectures[0] or family.main_class
    return convert(family, name, config, read_safetensors(path), ignore)


def read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if (path / WEIGHTS).is_file():
        return load_file(str(path / WEIGHTS))
    if (path / INDEX).is_file():
        files = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        tensors: dict[str, Tensor] = {}
        for file in files:
            tensors.update(load_file(str(path / file)))
        return tensors
    if any(path.glob("*.bin")):
        raise ValueError(f"{str(path)!r} holds pickled PyTorch weights only: polyformer reads safetensors "
                         "(re-save the model with save_pretrained(..., safe_serialization=True))")
    raise FileNotFoundError(f"no {WEIGHTS} (or {INDEX}) in {str(path)!r}")


def _matches(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p.rstrip(".") + ".") for p in prefixes)


def convert(family: Family, class_name: str, config: dict[str, Any], tensors: dict[str, Tensor],
            ignore: Iterable[str] = ()) -> TransformerWrapper:
    """Build the polyformer model of `config`, fill it from `tensors` (a Hugging Face state dict of
    `class_name`) and return it only if every tensor found its place."""
    if isinstance(ignore, str):
        ignore = [ignore]
    ignore = list(ignore)
    c = {**family.defaults, **config}
    stack_cls, layers, wrap = family.build(c)
    model = TransformerWrapper(attn_layers=stack_cls(**layers), **wrap)
    prefix = family.classes.get(class_name, "")
    theirs = {(name[len(prefix):] if prefix and name.startswith(prefix) else name): t for name, t in tensors.items()}
    ours = model.state_dict()
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    wrong: list[str] = []
    for link in family.links(c):
        names = list(link.theirs)
        absent = [n for n in names if n not in theirs]
        if absent:
            missing += absent
            continue
        used.update(names)
        expected = link.their_shapes(tuple(ours[link.ours].shape))
        bad = [f"{n} (checkpoint {tuple(theirs[n].shape)}, expected {shape})"
               for n, shape in zip(names, expected) if tuple(theirs[n].shape) != shape]
        if bad:
            wrong += bad
            continue
        out[link.ours] = link.to_ours([theirs[n] for n in names])
    problems = []
    head = family.tied_head
    if head is not None and c.get("tie_word_embeddings") and head in theirs:
        used.add(head)
        if family.embedding in theirs and not torch.equal(theirs[head], theirs[family.embedding]):
            problems.append(f"{head} differs from {family.embedding}, but the config ties them (tie_word_embeddings=True)")
    rest = [n for n in theirs if n not in used]
    derived = {n for n in rest if any(re.fullmatch(p, n) for p in family.derived)}
    skipped = {n for n in rest if _matches(n, ignore) or _matches(prefix + n, ignore)}
    unexpected = [n for n in rest if n not in derived and n not in skipped]
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        notes = sorted({note for p, note in family.notes.items() for n in unexpected if _matches(n, [p])})
        problems.append(f"{len(unexpected)} tensor(s) with no place in the polyformer model: {', '.join(unexpected)}"
                        + (f" ({'; '.join(notes)})" if notes else ""))
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) of another shape: {'; '.join(wrong)}")
    unfilled = [n for n in ours if n not in out and not missing and not wrong]
    if unfilled:        # a family table that forgot a tensor: never return it half-filled
        problems.append(f"no checkpoint tensor for {', '.join(unfilled)}")
    if problems:
        raise ValueError(f"cannot convert {class_name} ({family.model_type}) to polyformer: " + " | ".join(problems))
    dtypes = {t.dtype for t in out.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        model.to(dtypes.pop())
    model.load_state_dict(out, strict=True)
    return model.eval()


# ---- polyformer -> Hugging Face ------------------------------------------------------------------

def _flat(d: dict[str, Any], head: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in d.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{head}{key}."))
        else:
            flat[f"{head}{key}"] = value
    return flat


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
        "embed_num_tokens": {k: e.num_embeddings for k, e in (model.embeds or {}).items()},
        "num_memory_tokens": model.num_memory_tokens,
    }


def differences(model: TransformerWrapper, family: Family, hf_config: dict[str, Any]) -> list[str]:
    """How `model` differs from the polyformer model of `hf_config` (empty: it is exactly that)."""
    stack_cls, layers, wrap = family.build({**family.defaults, **hf_config})
    with torch.device("meta"):
        ref = TransformerWrapper(attn_layers=stack_cls(**layers), **wrap)
    found = []
    mine, want = _flat(to_dict(model.attn_layers.cfg)), _flat(to_dict(ref.attn_layers.cfg))
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
    family, hf_config = describe(model)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"architectures": [family.main_class], "model_type": family.model_type, **hf_config, "dtype": dtype,
            **config}


def save_hf(model: TransformerWrapper, directory: str | os.PathLike, *, tokenizer_json: str | None = None,
            **config: Any) -> Path:
    """Write a Hugging Face model directory (config.json, model.safetensors, and tokenizer.json when
    `tokenizer_json` is given) that `transformers` loads with `from_pretrained`; `config` as in `to_hf`.

    The directory is written under a temporary name and renamed into place, so it is complete or
    absent; an existing non-empty directory is refused (FileExistsError)."""
    from safetensors.torch import save_file

    family, hf_config = describe(model)
    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{str(target)!r} exists and is not empty: choose a new directory")
    tensors = hf_state_dict(model, family, hf_config, with_tied=False)
    text = json.dumps(hf_config_dict(model, **config), indent=2, sort_keys=True) + "\n"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        files = {CONFIG: text.encode()}
        if tokenizer_json is not None:
            files[TOKENIZER] = tokenizer_json.encode()
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        for name in os.listdir(tmp):
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        os.replace(tmp, target)             # onto a missing or empty directory
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
