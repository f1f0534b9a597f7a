"""Tokenizers for training: raw bytes (no training, no dependency) or byte-level BPE trained on the
corpus with the `tokenizers` package; and a Hugging Face tokenizer.json kept as it is, for converted
runs. All save to one `tokenizer.json` that records their kind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

from torch import Tensor

from .batches import integer_at_least
from .files import write_atomic

FILENAME = "tokenizer.json"
FORMAT = "polyformer-tokenizer"


class Tokenizer(Protocol):
    kind: str                    # "byte", "bpe" or "hf", as recorded in tokenizer.json
    specials: tuple[str, ...]

    @property
    def vocab_size(self) -> int: ...
    @property
    def ordinary_vocab_size(self) -> int: ...     # ids below it are ordinary; specials follow
    def encode(self, text: bytes | str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[bytes | str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int] | Tensor) -> str: ...
    def token_id(self, special: str) -> int: ...
    def save(self, directory: str | Path) -> Path: ...


def _check_specials(specials: Iterable[str]) -> tuple[str, ...]:
    if isinstance(specials, str):
        raise TypeError(f"specials must be a sequence of strings, got the string {specials!r}: use ({specials!r},)")
    specials = tuple(specials)
    for s in specials:
        if not isinstance(s, str) or not s:
            raise ValueError(f"special tokens must be non-empty strings, got {s!r}")
    if len(set(specials)) != len(specials):
        raise ValueError(f"special tokens must be distinct, got {specials}")
    return specials


def _ids(ids: Iterable[int] | Tensor) -> list[int]:
    if isinstance(ids, Tensor):
        if ids.ndim != 1 or ids.dtype.is_floating_point:
            raise ValueError(f"ids must be a 1-d integer tensor, got shape {tuple(ids.shape)} {ids.dtype}")
        return ids.tolist()
    return [int(i) for i in ids]


def _unknown(special: str, specials: tuple[str, ...]) -> KeyError:
    return KeyError(f"unknown special token {special!r}; this tokenizer has {list(specials)}")


def _write(directory: str | Path, record: dict[str, Any]) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    path = path / FILENAME
    write_atomic(path, json.dumps({"format": FORMAT, **record}, ensure_ascii=False).encode("utf-8"))
    return path


class ByteTokenizer:
    """Bytes are ids 0..255; special tokens follow from 256 in the order given. Any byte string
    round-trips exactly through `encode` / `decode_bytes`; `decode` gives text (invalid UTF-8
    becomes U+FFFD, special ids their names)."""

    kind = "byte"

    def __init__(self, specials: Iterable[str] = ()):
        self.specials = _check_specials(specials)

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.specials)

    @property
    def ordinary_vocab_size(self) -> int:
        """Ids below this are ordinary tokens; the specials come after."""
        return 256

    def token_id(self, special: str) -> int:
        if special not in self.specials:
            raise _unknown(special, self.specials)
        return 256 + self.specials.index(special)

    def encode(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else bytes(text))

    def encode_batch(self, texts: Sequence[bytes | str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode_bytes(self, ids: Iterable[int] | Tensor) -> bytes:
        """The bytes back; special ids become their names in UTF-8."""
        out = bytearray()
        for i in _ids(ids):
            if 0 <= i < 256:
                out.append(i)
            elif 256 <= i < self.vocab_size:
                out += self.specials[i - 256].encode("utf-8")
            else:
                raise ValueError(f"token id {i} is outside [0, vocab_size={self.vocab_size})")
        return bytes(out)

    def decode(self, ids: Iterable[int] | Tensor) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> Path:
        return _write(directory, {"kind": self.kind, "specials": list(self.specials)})

    def __repr__(self) -> str:
        return f"ByteTokenizer(specials={self.specials})"


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError("the BPE tokenizer needs the `tokenizers` package: pip install polyformer[bpe] "
                          "(or pip install tokenizers)") from e
    return tokenizers


class _TokenizersBacked:
    """What a tokenizer kept as a `tokenizers.Tokenizer` does the same way whatever its kind:
    sizes, encoding (with or without the tokenizer's own post-processing), decoding, saving."""

    kind: str
    specials: tuple[str, ...] = ()
    post_process = False                # add the tokenizer's own special tokens when encoding

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _text(text: bytes | str) -> str:
        return text.decode("utf-8", errors="replace") if isinstance(text, (bytes, bytearray)) else text

    def encode(self, text: bytes | str) -> list[int]:
        return self.tokenizer.encode(self._text(text), add_special_tokens=self.post_process).ids

    def encode_batch(self, texts: Sequence[bytes | str]) -> list[list[int]]:
        """Like `encode` on each text, run in parallel."""
        encoded = self.tokenizer.encode_batch([self._text(t) for t in texts], add_special_tokens=self.post_process)
        return [e.ids for e in encoded]

    def decode(self, ids: Iterable[int] | Tensor) -> str:
        """The text of ids, special tokens kept; ids outside the vocabulary are refused."""
        ids = _ids(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside [0, vocab_size={self.vocab_size})")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str:
        """The `tokenizers` tokenizer.json text (what a Hugging Face model directory holds)."""
        return self.tokenizer.to_str()

    def save(self, directory: str | Path) -> Path:
        return _write(directory, {"kind": self.kind, "specials": list(self.specials),
                                  "tokenizers": json.loads(self.to_json())})

    def __repr__(self) -> str:
        extra = f", specials={self.specials}" if self.specials else ""
        return f"{type(self).__name__}(vocab_size={self.vocab_size}{extra})"


class BPETokenizer(_TokenizersBacked):
    """Byte-level BPE (arXiv:1508.07909, GPT-2's byte-level alphabet) from the `tokenizers`
    package. Special tokens follow the learned vocabulary (the last k ids). Any text round-trips exactly (no unknown token); bytes
    are read as UTF-8, invalid sequences becoming U+FFFD. Text that spells a special token
    ("<mask>") is encoded as ordinary text, never as the special id."""

    kind = "bpe"

    def __init__(self, tokenizer: Any, specials: Iterable[str] = ()):
        super().__init__(tokenizer)
        self.specials = _check_specials(specials)
        self.tokenizer.encode_special_tokens = True    # literal "<mask>" in the data stays text

    @classmethod
    def train(cls, data: bytes | str, vocab_size: int, specials: Iterable[str] = ()) -> BPETokenizer:
        """Learn merges on `data` until the vocabulary (256 byte symbols, the merges, then the
        specials) reaches vocab_size. Deterministic: the same data gives the same tokenizer."""
        tk = _tokenizers()
        specials = _check_specials(specials)
        integer_at_least("vocab_size (256 bytes + the specials at least)", vocab_size, 256 + len(specials))
        text = data.decode("utf-8", errors="replace") if isinstance(data, (bytes, bytearray)) else data
        if not text:
            raise ValueError("cannot train a BPE tokenizer on empty data")
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
        tokenizer.add_special_tokens(list(specials))      # after the learned vocabulary, as for bytes
        return cls(tokenizer, specials)

    @property
    def ordinary_vocab_size(self) -> int:
        """Ids below this are ordinary tokens; the specials come after."""
        return self.vocab_size - len(self.specials)

    def token_id(self, special: str) -> int:
        if special not in self.specials:
            raise _unknown(special, self.specials)
        return self.tokenizer.token_to_id(special)


class HFTokenizer(_TokenizersBacked):
    """A Hugging Face `tokenizer.json` kept as it is (BPE, WordPiece or Unigram: the `tokenizers`
    package reads any of them), for runs converted from a Hugging Face model directory
    (`polyformer convert --from-hf`). `encode` gives the ids the Hugging Face tokenizer gives by
    default, its own post-processing included (Llama's BOS, BERT's [CLS] ... [SEP]); special tokens
    written in the text become their ids, as there."""

    kind = "hf"
    post_process = True

    @classmethod
    def from_file(cls, path: str | Path) -> "HFTokenizer":
        tk = _tokenizers()
        try:
            return cls(tk.Tokenizer.from_file(str(path)))
        except Exception as error:       # the Rust side raises its own Exception type
            raise ValueError(f"{str(path)!r} is not a tokenizer.json the `tokenizers` package reads ({error})") from error

    @property
    def ordinary_vocab_size(self) -> int:
        return self.vocab_size

    def token_id(self, special: str) -> int:
        i = self.tokenizer.token_to_id(special)
        if i is None:
            raise KeyError(f"unknown special token {special!r} in this Hugging Face tokenizer")
        return i


def load_tokenizer(directory: str | Path) -> ByteTokenizer | BPETokenizer | HFTokenizer:
    """The tokenizer saved in directory/tokenizer.json, of the kind it records."""
    path = Path(directory) / FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"no {FILENAME} in {str(directory)!r}")
    record = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a polyformer tokenizer file")
    kind = record.get("kind")
    if kind == ByteTokenizer.kind:
        return ByteTokenizer(record["specials"])
    if kind == BPETokenizer.kind:
        tk = _tokenizers()
        return BPETokenizer(tk.Tokenizer.from_str(json.dumps(record["tokenizers"])), record["specials"])
    if kind == HFTokenizer.kind:
        return HFTokenizer(_tokenizers().Tokenizer.from_str(json.dumps(record["tokenizers"])))
    raise ValueError(f"{str(path)!r} records an unknown tokenizer kind {kind!r}; expected 'byte', 'bpe' or 'hf'")


def build_tokenizer(kind: str, data: bytes | str | None = None, vocab_size: int | None = None,
                    specials: Iterable[str] = ()) -> ByteTokenizer | BPETokenizer:
    """"byte" (data and vocab_size unused) or "bpe" (trained on data up to vocab_size)."""
    if kind == ByteTokenizer.kind:
        return ByteTokenizer(specials)
    if kind == BPETokenizer.kind:
        if data is None or vocab_size is None:
            raise ValueError("a 'bpe' tokenizer needs data to train on and a vocab_size")
        return BPETokenizer.train(data, vocab_size, specials)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'byte' or 'bpe'")
