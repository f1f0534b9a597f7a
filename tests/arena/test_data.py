"""The arena's ListOps and MQAR generators: answers agree with a direct evaluator, draws depend on
the seed alone, and every MQAR query can be answered from its context."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from benchmarks.arena.data import listops, mqar


def _nesting(tokens: list[str]) -> int:
    depth = deepest = 0
    for token in tokens:
        if token.startswith("["):
            depth += 1
            deepest = max(deepest, depth)
        elif token == "]":
            depth -= 1
    return deepest


def _argument_counts(tokens: list[str]) -> list[int]:
    open_counts: list[int] = []
    counts = []
    for token in tokens:
        if token.startswith("["):
            open_counts.append(0)
            continue
        if token == "]":
            counts.append(open_counts.pop())
        if open_counts:
            open_counts[-1] += 1
    return counts


@pytest.fixture(scope="module")
def short_examples() -> list[tuple[list[str], int]]:
    return listops.generate(300, seed=1, min_len=8, max_len=120, max_depth=5, max_args=4)


# ---------------------------------------------------------------- ListOps


@pytest.mark.parametrize("text, answer", [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[MIN 5 3 8 ]", 3),
    ("[MED 5 1 9 ]", 5),
    ("[MED 1 2 ]", 1),                     # even count: the mean of the middle two, truncated
    ("[MED 3 8 1 6 ]", 4),                 # middle of 1 3 6 8 is 4.5
    ("[SM 7 8 9 ]", 4),                    # 24 mod 10
    ("[SM [MAX 1 [MIN 8 3 ] ] [MED 2 4 6 ] 9 ]", 6),   # 3 + 4 + 9, three levels deep
    ("7", 7),
])
def test_evaluate_hand_written(text: str, answer: int) -> None:
    assert listops.evaluate(text.split()) == answer


@pytest.mark.parametrize("text", [
    "", "[MAX 1 2", "[MAX 1 2 ] ]", "1 2", "[MAX ]", "] 1", "( 1 )", "[MAX 1 <pad> ]", "[FIRST 1 2 ]",
    "[MAX 1 2 ] 3",
])
def test_evaluate_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError):
        listops.evaluate(text.split())


def test_generated_answers_match_the_evaluator(short_examples: list[tuple[list[str], int]]) -> None:
    assert all(listops.evaluate(tokens) == answer for tokens, answer in short_examples)


def test_default_window_answers_and_lengths() -> None:
    examples = listops.generate(10, seed=0)
    assert all(500 <= len(tokens) <= 2000 for tokens, _ in examples)
    assert all(listops.evaluate(tokens) == answer for tokens, answer in examples)


def test_same_seed_same_examples_other_seed_differs() -> None:
    first = listops.generate(20, seed=3, min_len=8, max_len=100)
    assert first == listops.generate(20, seed=3, min_len=8, max_len=100)
    assert first != listops.generate(20, seed=4, min_len=8, max_len=100)
    assert first[:5] == listops.generate(5, seed=3, min_len=8, max_len=100)


def test_global_rng_state_is_neither_used_nor_changed() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = listops.generate(5, seed=2, min_len=8, max_len=100)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(123)
    assert listops.generate(5, seed=2, min_len=8, max_len=100) == first


def test_lengths_within_window() -> None:
    examples = listops.generate(50, seed=0, min_len=60, max_len=70)
    assert all(60 <= len(tokens) <= 70 for tokens, _ in examples)
    assert len({len(tokens) for tokens, _ in examples}) > 3


def test_smallest_window_gives_single_operator_trees() -> None:
    examples = listops.generate(30, seed=0, min_len=4, max_len=4)
    assert all(len(tokens) == 4 and tokens[0] in listops.OPENERS for tokens, _ in examples)


def test_nesting_and_arguments_respect_limits(short_examples: list[tuple[list[str], int]]) -> None:
    # LRA puts the root at depth 1 and leaves only at depth max_depth: at most 4 nested operators.
    nesting = [_nesting(tokens) for tokens, _ in short_examples]
    assert max(nesting) == 4
    counts = [c for tokens, _ in short_examples for c in _argument_counts(tokens)]
    assert min(counts) == 2 and max(counts) == 4


def test_operators_and_labels_are_varied(short_examples: list[tuple[list[str], int]]) -> None:
    openers = Counter(t for tokens, _ in short_examples for t in tokens if t.startswith("["))
    assert set(openers) == set(listops.OPENERS)
    assert len(Counter(answer for _, answer in short_examples)) >= 8


def test_vocab_covers_every_token(short_examples: list[tuple[list[str], int]]) -> None:
    assert listops.VOCAB[0] == "<pad>" and len(set(listops.VOCAB)) == len(listops.VOCAB)
    seen = {t for tokens, _ in short_examples for t in tokens}
    assert seen <= set(listops.VOCAB[1:])
    ids = listops.encode(short_examples[0][0])
    assert [listops.VOCAB[i] for i in ids] == short_examples[0][0]
    with pytest.raises(ValueError):
        listops.encode(["[MAX", "("])


def test_batch_pads_with_zero_and_masks_real_tokens() -> None:
    examples = [("[MAX 2 9 ]".split(), 9), ("[SM 1 [MIN 4 7 ] 2 ]".split(), 7), (["5"], 5)]
    ids, mask, labels = listops.batch(examples)
    assert ids.shape == mask.shape == (3, 8) and ids.dtype == labels.dtype == torch.int64
    assert mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [4, 8, 1]
    assert torch.equal(mask, ids != 0)
    for row, (tokens, _) in enumerate(examples):
        assert ids[row, :len(tokens)].tolist() == listops.encode(tokens)
    assert labels.tolist() == [9, 7, 5]
    wide, wide_mask, _ = listops.batch(examples, length=12)
    assert torch.equal(wide[:, :8], ids) and not wide[:, 8:].any() and not wide_mask[:, 8:].any()
    with pytest.raises(ValueError):
        listops.batch(examples, length=7)


@pytest.mark.parametrize("keywords", [
    dict(min_len=10, max_len=9), dict(min_len=2, max_len=3), dict(min_len=0, max_len=5),
    dict(max_args=1), dict(max_depth=0), dict(min_len=20, max_len=40, max_depth=2),
])
def test_generate_rejects_bad_arguments(keywords: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        listops.generate(3, seed=0, **keywords)


# ---------------------------------------------------------------- MQAR


def _check_mqar(inputs: torch.Tensor, targets: torch.Tensor, num_pairs: int, vocab_size: int) -> None:
    half, context = vocab_size // 2, 2 * num_pairs
    keys, values = inputs[:, 0:context:2], inputs[:, 1:context:2]
    assert ((keys >= 1) & (keys < half)).all()
    assert ((values >= half) & (values < vocab_size)).all()
    assert (keys.sort(1).values.diff(dim=1) > 0).all()            # distinct keys per example
    labelled = targets != mqar.IGNORE
    assert (labelled.sum(1) == num_pairs).all()
    assert not labelled[:, :context].any()
    for row in range(inputs.shape[0]):
        where = labelled[row].nonzero().squeeze(1)
        asked = inputs[row, where]
        # each query key is in the context exactly once, and its label is the value paired there
        match = keys[row].unsqueeze(0) == asked.unsqueeze(1)
        assert (match.sum(1) == 1).all()
        assert torch.equal(values[row][match.int().argmax(1)], targets[row, where])
        assert torch.equal(asked.sort().values, keys[row].sort().values)   # every key asked once
        inside = where[where + 1 < inputs.shape[1]]
        assert torch.equal(inputs[row, inside + 1], targets[row, inside])
        filler = torch.ones(inputs.shape[1], dtype=torch.bool)
        filler[:context] = False
        filler[where] = False
        filler[inside + 1] = False
        assert not inputs[row, filler].any()


def test_mqar_queries_answerable_from_context() -> None:
    inputs, targets = mqar.generate(64, seed=0, seq_len=64, num_pairs=8, vocab_size=40)
    assert inputs.shape == targets.shape == (64, 64)
    assert inputs.dtype == targets.dtype == torch.int64
    _check_mqar(inputs, targets, num_pairs=8, vocab_size=40)


def test_mqar_tightest_fit() -> None:
    inputs, targets = mqar.generate(16, seed=5, seq_len=15, num_pairs=4, vocab_size=10)
    _check_mqar(inputs, targets, num_pairs=4, vocab_size=10)
    assert targets[:, 14].ne(mqar.IGNORE).all()                  # the last slot's value lies past the input


def test_mqar_seed_alone_decides() -> None:
    first = mqar.generate(8, seed=11)
    torch.manual_seed(99)
    again = mqar.generate(8, seed=11)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = mqar.generate(8, seed=12)
    assert not torch.equal(first[0], other[0])


def test_mqar_power_law_favours_short_gaps() -> None:
    def near_share(power_a: float) -> float:
        _, targets = mqar.generate(200, seed=0, seq_len=128, num_pairs=4, power_a=power_a)
        positions = (targets != mqar.IGNORE).nonzero()[:, 1]
        return ((positions - 8) // 2 < 10).float().mean().item()      # first 10 of 60 slots
    assert near_share(0.01) > 0.3 > near_share(1.0)


@pytest.mark.parametrize("keywords", [
    dict(num_pairs=0), dict(seq_len=30, num_pairs=8), dict(vocab_size=17, num_pairs=8),
    dict(power_a=0.0), dict(power_a=float("nan")), dict(num=-1),
])
def test_mqar_rejects_bad_arguments(keywords: dict[str, float]) -> None:
    arguments: dict[str, float] = dict(num=2, seed=0)
    arguments.update(keywords)
    with pytest.raises(ValueError):
        mqar.generate(**arguments)  # type: ignore[arg-type]
