"""Interoperability with other libraries' checkpoints: Hugging Face GPT-2, BERT and Llama (hf.py)."""

from .family import Unsupported
from .hf import SUPPORTED, from_hf, load_hf, save_hf, to_hf

__all__ = ["SUPPORTED", "Unsupported", "from_hf", "load_hf", "save_hf", "to_hf"]
