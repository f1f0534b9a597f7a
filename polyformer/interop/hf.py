"""Hugging Face checkpoints in and out: GPT-2, BERT (as `BertModel`), Llama, T5, ... (families.py).

    model = from_hf(hf_model)                 # a transformers model object -> TransformerWrapper
    model = load_hf("path/to/dir")            # config.json + model.safetensors, without transformers
    hf_model = to_hf(model)                   # TransformerWrapper -> a transformers model object
    save_hf(model, "path/to/dir")             # config.json + model.safetensors, written atomically

Every option is an ordinary polyformer keyword (attn_qkv_bias, post_emb_norm, embed_num_tokens, ...),
so a converted model is a plain `TransformerWrapper` (or `XTransformer`): `build_model(model_config(model))`
rebuilds it.
Conversion is strict: a missing tensor, a tensor with no place in the model, a shape that does not
fit or an option polyformer cannot reproduce raises `ValueError` naming them all, and nothing
half-converted is returned. Dropout probabilities are not carried over (polyformer's dropouts sit
elsewhere than the residual dropouts of these models): converted models have none, and `to_hf`
writes 0 for every dropout. This module reads; hf_write.py writes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor, nn

from ..encoder_decoder import XTransformer
from ..wrappers import TransformerWrapper
from .families import FAMILIES, SUPPORTED, family_of
from .family import Family, make_model
from .hf_write import CONFIG, TOKENIZER, WEIGHTS, hf_config_dict, save_hf, to_hf

INDEX = "model.safetensors.index.json"


# ---- Hugging Face -> polyformer ------------------------------------------------------------------

def from_hf(hf_model: nn.Module, *, ignore: Iterable[str] = ()) -> TransformerWrapper | XTransformer:
    """A polyformer `TransformerWrapper` (an `XTransformer` for an encoder-decoder class) with the
    weights of a transformers model, in eval mode.

    GPT2LMHeadModel / GPT2Model and LlamaForCausalLM give a decoder whose `model(ids)` returns the
    Hugging Face logits; BertModel gives an encoder whose `model(ids, mask=mask,
    return_embeddings=True)` returns the last hidden states (token types through
    `embed_ids={"token_type": ids}`, 0 when not given). T5ForConditionalGeneration gives an
    XTransformer (see t5.py for how to call it), T5EncoderModel an encoder.

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


def load_hf(directory: str | os.PathLike, *, ignore: Iterable[str] = ()
            ) -> TransformerWrapper | XTransformer:
    """`from_hf` for a Hugging Face model directory (config.json and model.safetensors, or sharded
    model-*.safetensors with model.safetensors.index.json); needs `safetensors`, not `transformers`."""
    path = Path(directory)
    if not (path / CONFIG).is_file():
        raise FileNotFoundError(f"{str(path / CONFIG)!r} does not exist: {str(path)!r} is not a Hugging Face model directory")
    try:
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
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
        files = sorted(set(json.loads((path / INDEX).read_text(encoding="utf-8"))["weight_map"].values()))
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
            ignore: Iterable[str] = ()) -> TransformerWrapper | XTransformer:
    """Build the polyformer model of `config`, fill it from `tensors` (a Hugging Face state dict of
    `class_name`) and return it only if every tensor found its place."""
    if isinstance(ignore, str):
        ignore = [ignore]
    ignore = list(ignore)
    prefix = family.classes.get(class_name, "")
    theirs = {(name[len(prefix):] if prefix and name.startswith(prefix) else name): t for name, t in tensors.items()}
    c = {**family.defaults, **config}
    if family.resolve is not None:
        c = family.resolve(c, theirs)
    model = make_model(family, c)
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
    aliases = dict(family.aliases(c)) if family.aliases is not None else {}
    if head is not None and c.get("tie_word_embeddings"):
        aliases[head] = family.embedding
    for name, source in aliases.items():
        if name not in theirs:
            continue
        used.add(name)
        if source in theirs and not torch.equal(theirs[name], theirs[source]):
            why = "the config ties them (tie_word_embeddings=True)" if name == head else f"{class_name} shares them"
            problems.append(f"{name} differs from {source}, but {why}")
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


__all__ = ["CONFIG", "FAMILIES", "SUPPORTED", "TOKENIZER", "convert", "family_of", "from_hf", "hf_config_dict",
           "load_hf", "save_hf", "to_hf"]
