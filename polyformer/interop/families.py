"""The supported Hugging Face families, and which one a model class belongs to."""

from __future__ import annotations

from .bert import BERT
from .bigbird import BIGBIRD
from .family import Family, Unsupported
from .fnet import FNET
from .gpt2 import GPT2
from .llama import LLAMA
from .longformer import LONGFORMER
from .nystromformer import NYSTROMFORMER
from .reformer import REFORMER

FAMILIES: dict[str, Family] = {f.model_type: f for f in (GPT2, BERT, LLAMA, LONGFORMER, NYSTROMFORMER, FNET,
                                                          BIGBIRD, REFORMER)}
SUPPORTED: tuple[str, ...] = tuple(cls for f in FAMILIES.values() for cls in f.classes)


def family_of(class_name: str | None, model_type: str | None) -> Family:
    """The family of a Hugging Face model class; `Unsupported` naming it and the supported ones."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is not None and class_name is None:
        return family
    if family is None or class_name not in family.classes:
        hint = ""
        if family is not None and family.base_model is not None:
            hint = f" (a model with a task head converts through its base model, model.{family.base_model})"
        raise Unsupported(f"unsupported architecture {class_name!r} (model type {model_type!r}); supported: "
                          f"{', '.join(SUPPORTED)}{hint}")
    return family
