"""`polyformer eval --data.paths`: any text, scored whole with the run's tokenizer; `eval` and
`generate` without the training corpus on disk."""

from __future__ import annotations

import re
import shutil

import torch
import torch.nn.functional as F

from polyformer.train.checkpoint import latest_checkpoint, load_checkpoint
from polyformer.train.run import model_from_run
from polyformer.train.tokenizer import load_tokenizer

from .conftest import SMALL, text

SEQ = 32            # SMALL's model.max_seq_len


def scores(out: str) -> dict[str, float]:
    words = out.split()
    return dict(zip(words[0::2], map(float, words[1::2])))


def direct_loss(run, files, batches_of: int | None = None) -> tuple[float, int]:
    """The explicit computation: the model from the run's newest checkpoint, the run's tokenizer
    on each file followed by a blank line, next-token cross-entropy over windows of SEQ + 1 tokens
    starting every SEQ tokens (each token but the first predicted once), averaged per token."""
    model = model_from_run(run)
    load_checkpoint(latest_checkpoint(run), model, rng=False)
    model.eval()
    tokenizer = load_tokenizer(run)
    ids = torch.tensor([i for f in files for i in tokenizer.encode(f.read_bytes() + b"\n\n")])
    total, count = 0.0, 0
    starts = list(range(0, ids.numel() - 1, SEQ))[:batches_of]
    with torch.no_grad():
        for start in starts:
            window = ids[start: start + SEQ + 1]
            total += F.cross_entropy(model(window[None, :-1])[0], window[1:], reduction="sum").item()
            count += window.numel() - 1
    return total / count, count


def test_eval_on_files_is_the_mean_next_token_loss_over_every_window(tmp_path, corpus, cli):
    run = tmp_path / "run"
    code, _, err = cli("train", *SMALL, "--steps", "6", "--data.paths", corpus, "--data.tokenizer", "bpe",
                       "--data.vocab_size", "300", "--out", run)
    assert code == 0, err
    other = tmp_path / "other"
    other.mkdir()
    (other / "y.txt").write_text(text(11, 200), encoding="utf-8")
    (other / "x.txt").write_text(text(10, 300), encoding="utf-8")
    single = tmp_path / "z.txt"
    single.write_text(text(12, 150), encoding="utf-8")
    # several paths after one flag, as train takes them; a folder's files in sorted order
    code, out, err = cli("eval", "--run", run, "--data.paths", single, other, "--train.batch_size", "3")
    assert code == 0, err
    expected, count = direct_loss(run, [single, other / "x.txt", other / "y.txt"])
    got = scores(out)
    assert abs(got["loss"] - expected) < 1e-4, (got, expected)
    assert f"scored {run / 'checkpoints' / 'step-000006'} (step 6)" in err
    assert f"{count:,} tokens" in err
    validation = scores(cli("eval", "--run", run)[1])
    assert validation["loss"] != got["loss"]                       # other text, another score
    # --batches: the first batches of windows only
    code, out, err = cli("eval", "--run", run, "--data.paths", single, "--batches", "2", "--train.batch_size", "2")
    expected, count = direct_loss(run, [single], batches_of=4)
    assert code == 0 and abs(scores(out)["loss"] - expected) < 1e-4 and count == 4 * SEQ
    assert f"{count:,} tokens" in err


def test_generate_and_eval_do_not_need_the_training_corpus(tmp_path, corpus, cli):
    run = tmp_path / "run"
    assert cli("train", *SMALL, "--steps", "4", "--data.paths", corpus, "--out", run)[0] == 0
    greedy = ("generate", "--run", run, "--prompt", "the cät ", "--max-new-tokens", "12", "--temperature", "0")
    code, before, err = cli(*greedy)
    assert code == 0, err
    moved = shutil.move(corpus, tmp_path / "elsewhere")
    code, after, err = cli(*greedy)
    assert code == 0 and after == before and after.startswith("the cät "), err
    code, out, err = cli("eval", "--run", run, "--data.paths", f"{moved}/a.txt")
    assert code == 0 and abs(scores(out)["loss"] - direct_loss(run, [tmp_path / "elsewhere" / "a.txt"])[0]) < 1e-4
    # the validation split is read from the corpus: a one-line refusal that says what to do
    code, out, err = cli("eval", "--run", run)
    assert code == 2 and not out
    assert err.startswith("polyformer eval: ") and err.count("\n") == 1 and str(corpus) in err, err
    assert "--data.paths FILE_OR_DIR" in err


def test_eval_and_generate_take_the_settings_that_apply_and_say_why_not_others(tmp_path, corpus, cli):
    run = tmp_path / "run"
    assert cli("train", *SMALL, "--steps", "2", "--data.paths", corpus, "--out", run)[0] == 0
    cases = [
        (("eval", "--data.tokenizer", "bpe"), "--data.tokenizer does not apply"),
        (("eval", "--model.depth", "3"), "--model.depth does not apply"),
        (("eval", "--data.pths", corpus), "did you mean 'data.paths'"),
        (("eval", "--data.max_bytes", "2000"), "--data.max_bytes applies to --data.paths"),
        (("eval", "--batches", "2", "--train.eval_batches", "3"), "the same setting"),
        (("eval", "--data.paths", tmp_path / "nope.txt"), "nope.txt"),
        (("generate", "--data.paths", corpus), "--data.paths does not apply"),
    ]
    for (command, *args), message in cases:
        code, out, err = cli(command, "--run", run, *args)
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)
    code, out, err = cli("eval", "--run", run, "--data.paths", corpus, "--data.max_bytes", "2000")
    assert code == 0 and re.search(r"on 1,99\d tokens", err), err       # 2000 bytes, one byte per token
