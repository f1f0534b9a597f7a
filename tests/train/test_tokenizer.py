"""Tokenizers: bytes round-trip exactly (ids too), BPE trains deterministically, round-trips text,
compresses, and saves / loads to identical ids; the saved file says which kind to load."""

import json
import random
import sys
import time

import pytest
import torch

from polyformer.train.corpus import load_corpus
from polyformer.train.tokenizer import BPETokenizer, ByteTokenizer, build_tokenizer, load_tokenizer

EXOTIC = "naïve café — 漢字 🐍 <mask> tabs\tand\r\nnewlines \x00\x7f\n"


@pytest.fixture(scope="module")
def corpus_text() -> bytes:
    return load_corpus(None, max_bytes=300_000).data


@pytest.fixture(scope="module")
def bpe(corpus_text) -> BPETokenizer:
    return BPETokenizer.train(corpus_text, vocab_size=768, specials=("<mask>", "<pad>"))


def test_bytes_round_trip_exactly_including_invalid_utf8():
    rng = random.Random(0)
    tok = ByteTokenizer()
    for data in (bytes(range(256)), bytes(rng.randrange(256) for _ in range(4096)), b"\xff\xfe\xc3(", b""):
        ids = tok.encode(data)
        assert ids == list(data)
        assert tok.decode_bytes(ids) == data
        assert tok.decode_bytes(torch.tensor(ids, dtype=torch.long)) == data
        assert tok.decode(ids) == data.decode("utf-8", errors="replace")
    assert tok.encode(EXOTIC) == list(EXOTIC.encode("utf-8"))
    assert tok.decode(tok.encode(EXOTIC)) == EXOTIC
    assert tok.vocab_size == 256


def test_byte_specials_follow_the_bytes():
    tok = ByteTokenizer(specials=("<mask>", "<pad>"))
    assert (tok.token_id("<mask>"), tok.token_id("<pad>"), tok.vocab_size) == (256, 257, 258)
    assert tok.ordinary_vocab_size == 256
    assert tok.encode("<mask>") == list(b"<mask>")            # text never becomes a special id
    assert tok.decode([104, 105, 256]) == "hi<mask>"
    with pytest.raises(KeyError, match="<cls>"):
        tok.token_id("<cls>")
    with pytest.raises(ValueError, match="258"):
        tok.decode([258])
    with pytest.raises(ValueError, match="distinct"):
        ByteTokenizer(specials=("<pad>", "<pad>"))
    with pytest.raises(TypeError, match="specials"):
        ByteTokenizer(specials="<pad>")


def test_byte_tokenizer_saves_its_kind(tmp_path):
    path = ByteTokenizer(specials=("<mask>",)).save(tmp_path / "tok")
    assert path.name == "tokenizer.json" and json.loads(path.read_text())["kind"] == "byte"
    loaded = load_tokenizer(tmp_path / "tok")
    assert isinstance(loaded, ByteTokenizer) and loaded.specials == ("<mask>",)


def test_bpe_trains_quickly_and_deterministically(corpus_text, bpe):
    start = time.perf_counter()
    again = BPETokenizer.train(corpus_text, vocab_size=768, specials=("<mask>", "<pad>"))
    assert time.perf_counter() - start < 10.0                  # typically ~0.1 s for 300 KB
    assert again.tokenizer.to_str() == bpe.tokenizer.to_str()
    sample = corpus_text[:20_000]
    assert again.encode(sample) == bpe.encode(sample)
    assert bpe.vocab_size == 768 and bpe.ordinary_vocab_size == 766
    assert (bpe.token_id("<mask>"), bpe.token_id("<pad>")) == (766, 767)   # specials follow, as for bytes


def test_bpe_round_trips_text_and_compresses(corpus_text, bpe):
    held_out = load_corpus(None, max_bytes=600_000).data[300_000:].decode("utf-8")  # not trained on
    ids = bpe.encode(held_out)
    assert bpe.decode(ids) == held_out
    assert len(ids) < 0.6 * len(held_out.encode("utf-8"))
    assert bpe.decode(bpe.encode(EXOTIC)) == EXOTIC           # unseen characters still round-trip
    assert bpe.decode(bpe.encode(EXOTIC.encode("utf-8"))) == EXOTIC
    assert bpe.token_id("<mask>") not in bpe.encode(EXOTIC)    # literal "<mask>" stays text
    assert bpe.decode([bpe.token_id("<pad>")]) == "<pad>"
    assert all(0 <= i < bpe.ordinary_vocab_size for i in ids)


def test_bpe_save_load_gives_identical_ids(tmp_path, corpus_text, bpe):
    bpe.save(tmp_path)
    record = json.loads((tmp_path / "tokenizer.json").read_text())
    assert record["kind"] == "bpe" and record["specials"] == ["<mask>", "<pad>"]
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, BPETokenizer)
    text = corpus_text[:30_000].decode("utf-8") + EXOTIC
    assert loaded.encode(text) == bpe.encode(text)
    assert loaded.vocab_size == bpe.vocab_size
    assert loaded.token_id("<mask>") == bpe.token_id("<mask>")


def test_corpus_tokens_through_bpe(bpe):
    corpus = load_corpus(None, max_bytes=50_000)
    tokens = corpus.tokens(bpe)
    assert tokens.dtype == torch.long and tokens.ndim == 1
    assert bpe.decode(tokens) == corpus.data.decode("utf-8")
    assert tokens.tolist() == [i for piece in corpus.pieces() for i in bpe.encode(piece)]


def test_bpe_bad_arguments(corpus_text):
    with pytest.raises(ValueError, match="vocab_size"):
        BPETokenizer.train(corpus_text[:1000], vocab_size=257, specials=("<mask>", "<pad>"))
    with pytest.raises(ValueError, match="empty"):
        BPETokenizer.train(b"", vocab_size=300)
    with pytest.raises(ValueError, match="kind"):
        build_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer("bpe", data=corpus_text[:1000])
    assert isinstance(build_tokenizer("byte", specials=("<pad>",)), ByteTokenizer)


def test_missing_tokenizers_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)        # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install polyformer\[bpe\]"):
        BPETokenizer.train(b"some text", vocab_size=300)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "nothing")
    (tmp_path / "tokenizer.json").write_text(json.dumps({"format": "polyformer-tokenizer", "kind": "sentencepiece"}))
    with pytest.raises(ValueError, match="sentencepiece"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {}}))
    with pytest.raises(ValueError, match="not a polyformer tokenizer"):
        load_tokenizer(tmp_path)


def test_hf_tokenizer_keeps_the_hugging_face_file_and_its_post_processing(tmp_path):
    """A Hugging Face tokenizer.json (here a WordLevel one with BERT's [CLS] ... [SEP] template)
    encodes as the Hugging Face tokenizer does, and survives save / load_tokenizer."""
    tk = pytest.importorskip("tokenizers")
    from polyformer.train.tokenizer import HFTokenizer

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4}
    raw = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    raw.post_processor = tk.processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    raw.save(str(tmp_path / "hf.json"))
    tok = HFTokenizer.from_file(tmp_path / "hf.json")
    assert tok.kind == "hf" and tok.vocab_size == 5 == tok.ordinary_vocab_size
    assert tok.encode("hello world") == [1, 3, 4, 2] == raw.encode("hello world").ids
    assert tok.encode_batch(["world", b"hello"]) == [[1, 4, 2], [1, 3, 2]]
    assert tok.decode([3, 4]) == "hello world" and tok.token_id("[SEP]") == 2
    with pytest.raises(KeyError, match="<mask>"):
        tok.token_id("<mask>")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([5])
    tok.save(tmp_path / "run")
    loaded = load_tokenizer(tmp_path / "run")
    assert isinstance(loaded, HFTokenizer) and loaded.encode("hello world") == [1, 3, 4, 2]
    assert json.loads(loaded.to_json()) == json.loads(raw.to_str())
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        HFTokenizer.from_file(tmp_path / "bad.json")
