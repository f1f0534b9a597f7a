"""The supported Hugging Face families, and which one a model class belongs to."""

from __future__ import annotations

from .bert import BERT
from .bigbird import BIGBIRD
from .family import Family, Unsupported
from .fnet import FNET
from .gpt2 import GPT2
from .llama import LLAMA
from .longformer import LONGFORMER
from .mixtral import MIXTRAL
from .nystromformer import NYSTROMFORMER
from .reformer import REFORMER
from .roformer import ROFORMER
from .switch import SWITCH
from .t5 import T5
from .xlnet import XLNET

FAMILIES: dict[str, Family] = {f.model_type: f for f in (GPT2, BERT, LLAMA, LONGFORMER, NYSTROMFORMER, FNET,
                                                          BIGBIRD, REFORMER, T5, XLNET, MIXTRAL, ROFORMER, SWITCH)}
# every record, the variants (classes of another shape in the same model type) after their family
RECORDS: tuple[Family, ...] = tuple(v for f in FAMILIES.values() for v in (f, *f.variants))
SUPPORTED: tuple[str, ...] = tuple(cls for f in RECORDS for cls in f.classes)


def family_of(class_name: str | None, model_type: str | None) -> Family:
    """The family of a Hugging Face model class; `Unsupported` naming it and the supported ones."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is not None and class_name is None:
        return family
    if family is not None:      # a class of another shape in the same model type (T5EncoderModel)
        family = next((v for v in family.variants if class_name in v.classes), family)
    if family is None or class_name not in family.classes:
        hint = ""
        if family is not None and family.base_model is not None:
            hint = f" (a model with a task head converts through its base model, model.{family.base_model})"
        raise Unsupported(f"unsupported architecture {class_name!r} (model type {model_type!r}); supported: "
                          f"{', '.join(SUPPORTED)}{hint}")
    return family
