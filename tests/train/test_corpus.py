"""The corpus: the standard library read in a fixed order with a recorded hash, user files and
folders, a train/validation split by file that stays put when files are added, clear errors."""

import hashlib
from pathlib import Path

import pytest
import torch

from polyformer.train.corpus import SEPARATOR, Corpus, load_corpus, stdlib_files, validation_score
from polyformer.train.tokenizer import ByteTokenizer


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def names(corpus: Corpus) -> list[str]:
    return [name for name, _ in corpus.files]


def test_stdlib_corpus_is_deterministic_and_hashed():
    a, b = load_corpus(None, max_bytes=200_000), load_corpus(None, max_bytes=200_000)
    assert a.files == b.files and a.data == b.data and a.sha256 == b.sha256
    assert a.sha256 == hashlib.sha256(a.data).hexdigest()
    assert len(a.data) == 200_000
    assert names(a) == sorted(names(a))
    assert all(not n.startswith("/") and "site-packages" not in n for n in names(a))
    assert b"".join(a.pieces()) == a.data
    assert "standard library" in a.source


def test_stdlib_corpus_reads_every_nonempty_source_in_order():
    corpus = load_corpus()
    expected = [p for p in stdlib_files() if p.stat().st_size]
    assert len(corpus.files) == len(expected)
    assert all(p.as_posix().endswith("/" + name) for p, (name, _) in zip(expected, corpus.files))
    assert [size for _, size in corpus.files] == [p.stat().st_size for p in expected]


def test_max_bytes_cuts_the_last_file_to_fit():
    full = load_corpus(None, max_bytes=50_000)
    assert len(full.data) == 50_000
    name, size = full.files[-1]
    assert full.data.endswith(SEPARATOR)
    assert dict(load_corpus(None, max_bytes=10**7).files)[name] > size   # the last one was cut


def test_user_folders_walk_sorted_and_skip_binary_and_hidden(tmp_path):
    root = tmp_path / "data"
    write(root / "b.txt", "bee\n")
    write(root / "a" / "z.py", "print(1)\n")
    write(root / "a" / "y.md", "# y\n")
    write(root / "image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    write(root / "late_nul.txt", b"x" * 10_000 + b"\x00")          # NUL past the first 8 KB
    write(root / ".hidden.txt", "secret\n")
    write(root / ".git" / "config", "[core]\n")
    write(root / "empty.txt", b"")
    extra = write(tmp_path / "notes.txt", "caf\xe9 \u00e9\n")
    corpus = load_corpus([str(root), str(extra)])
    assert names(corpus) == ["data/a/y.md", "data/a/z.py", "data/b.txt", "notes.txt"]
    assert corpus.data == b"# y\n" + SEPARATOR + b"print(1)\n" + SEPARATOR + b"bee\n" + SEPARATOR \
        + "caf\xe9 \u00e9\n".encode() + SEPARATOR
    assert load_corpus([root, extra]).sha256 == corpus.sha256                 # Path objects too
    assert load_corpus([root, root / "b.txt"]).files == load_corpus([root]).files  # no file twice


def test_missing_path_is_named(tmp_path):
    write(tmp_path / "ok.txt", "fine\n")
    missing = tmp_path / "nope" / "gone.txt"
    with pytest.raises(FileNotFoundError, match="gone.txt"):
        load_corpus([str(tmp_path / "ok.txt"), str(missing)])


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="corpus is empty"):
        load_corpus([str(tmp_path / "empty")])
    write(tmp_path / "bin" / "blob.dat", b"\x00\x01\x02")
    write(tmp_path / "bin" / "zero.txt", b"")
    with pytest.raises(ValueError, match="corpus is empty"):
        load_corpus([str(tmp_path / "bin")])
    with pytest.raises(ValueError, match="corpus is empty: no paths given.*None"):
        load_corpus([])


def test_bad_arguments_are_named(tmp_path):
    blob = write(tmp_path / "blob.bin", b"ab\x00cd")
    with pytest.raises(ValueError, match="blob.bin.*binary"):
        load_corpus([str(blob)])
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            load_corpus(None, max_bytes=bad)
    with pytest.raises(TypeError, match="list"):
        load_corpus(str(tmp_path))


def make_folder(root: Path, n: int) -> None:
    for i in range(n):
        write(root / f"dir{i % 3}" / f"file{i:03d}.txt", f"file number {i}\n" * 20)


def test_split_is_by_file_and_covers_the_corpus(tmp_path):
    make_folder(tmp_path / "c", 60)
    corpus = load_corpus([str(tmp_path / "c")])
    train, val = corpus.split()
    assert set(names(train)) | set(names(val)) == set(names(corpus))
    assert not set(names(train)) & set(names(val))
    held = [n for n in names(corpus) if validation_score(n) < 0.05]
    assert held and names(val) == held
    assert train.sha256 == hashlib.sha256(train.data).hexdigest() != val.sha256
    assert len(train.data) + len(val.data) == len(corpus.data)
    assert corpus.split() == (train, val)                        # fixed


def test_split_is_stable_when_files_are_added(tmp_path):
    make_folder(tmp_path / "c", 200)
    train, val = load_corpus([str(tmp_path / "c")]).split()
    assert 0 < len(val.files) < 30
    for i in range(200, 260):
        write(tmp_path / "c" / "new" / f"added{i}.txt", f"more text {i}\n")
    train2, val2 = load_corpus([str(tmp_path / "c")]).split()
    assert set(names(train)) <= set(names(train2))
    assert set(names(val)) <= set(names(val2))


def test_split_keeps_a_file_on_each_side(tmp_path):
    write(tmp_path / "two" / "a.txt", "aaa\n")
    write(tmp_path / "two" / "b.txt", "bbb\n")
    train, val = load_corpus([str(tmp_path / "two")]).split()
    assert len(train.files) == 1 and len(val.files) == 1
    for fraction in (0.01, 0.99):
        train, val = load_corpus([str(tmp_path / "two")]).split(fraction)
        assert len(train.files) == 1 and len(val.files) == 1


def test_a_single_file_is_split_at_95_percent(tmp_path):
    text = bytes(range(32, 127)) * 10 + b"\n"                   # 951 bytes
    corpus = load_corpus([str(write(tmp_path / "one.txt", text))])
    train, val = corpus.split()
    cut = round(len(text) * 0.95)
    assert train.data == text[:cut] + SEPARATOR and val.data == text[cut:] + SEPARATOR
    assert names(train) == names(val) == ["one.txt"]
    with pytest.raises(ValueError, match="val_fraction"):
        corpus.split(1.0)
    with pytest.raises(ValueError, match="cannot split"):
        load_corpus([str(write(tmp_path / "tiny.txt", "x"))]).split()


def test_tokens_are_the_bytes(tmp_path):
    corpus = load_corpus(None, max_bytes=10_000)
    tokens = corpus.tokens()
    assert tokens.dtype == torch.long and tokens.shape == (10_000,)
    assert bytes(tokens.tolist()) == corpus.data
    assert torch.equal(corpus.tokens(ByteTokenizer(specials=("<mask>",))), tokens)
