"""Byte-level text for the language-modelling tasks: the built-in corpus (the Python standard
library's sources, no download) split by file into train and validation, windows drawn from it
deterministically, and its longest files for the long-text task."""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from polyformer.train.corpus import Corpus, load_corpus

VOCAB = 256                     # bytes


@lru_cache(maxsize=1)
def corpus_split() -> tuple[Corpus, Corpus]:
    """(train, validation) of the built-in corpus, split by file as `polyformer train` does."""
    return load_corpus().split()


@lru_cache(maxsize=1)
def split_tokens() -> tuple[Tensor, Tensor]:
    """(train, validation) of the built-in corpus as byte tokens, made once per process."""
    train, val = corpus_split()
    return train.tokens(), val.tokens()


def slices(data: Tensor, starts: Tensor, length: int) -> Tensor:
    """(len(starts), length): data[s:s + length] for every start, in one indexing op."""
    return data[starts[:, None] + torch.arange(length)]


def windows(data: Tensor, batch: int, length: int, seed: int) -> Tensor:
    """(batch, length) windows of `data` at random offsets drawn from `seed` alone."""
    g = torch.Generator().manual_seed(seed)
    return slices(data, torch.randint(0, len(data) - length, (batch,), generator=g), length)


def spaced_windows(data: Tensor, count: int, length: int) -> Tensor:
    """(count, length) windows starting at evenly spaced offsets of `data` (evaluation)."""
    if len(data) < length + count:
        raise ValueError(f"the text ({len(data)} tokens) is too short for {count} windows of {length}")
    return slices(data, torch.arange(count) * ((len(data) - length) // count), length)


def longest_files(corpus: Corpus, count: int) -> list[tuple[str, Tensor]]:
    """The `count` longest files of the corpus, longest first, as byte tokens."""
    contents = sorted(corpus.contents(), key=lambda item: (-len(item[1]), item[0]))[:count]
    return [(name, torch.frombuffer(bytearray(content), dtype=torch.uint8).long()) for name, content in contents]
