"""Batches: batch k depends on (seed, k) only, so a resumed stream continues exactly, and the ranks
of a distributed run together hold the one-process batch."""

import pytest
import torch

from polyformer.train.batches import Batches

STREAM = torch.arange(10_000)          # row values tell where each window starts


def take(batches: Batches, n: int) -> list[torch.Tensor]:
    return [next(batches) for _ in range(n)]


def test_rows_are_windows_of_seq_len_plus_one():
    batch = Batches(STREAM, seq_len=16, batch_size=8, seed=0).batch(0)
    assert batch.shape == (8, 17) and batch.dtype == torch.long
    assert torch.equal(batch - batch[:, :1], torch.arange(17).expand(8, 17))


def test_batch_k_is_a_function_of_seed_and_k():
    a, b = Batches(STREAM, 16, 8, seed=3), Batches(STREAM, 16, 8, seed=3)
    first = take(a, 4)
    assert all(torch.equal(x, y) for x, y in zip(first, take(b, 4)))
    assert all(torch.equal(x, a.batch(k)) for k, x in enumerate(first))
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], Batches(STREAM, 16, 8, seed=4).batch(0))


def test_resuming_from_state_dict_continues_the_stream():
    whole = take(Batches(STREAM, 16, 8, seed=1), 10)
    first = Batches(STREAM, 16, 8, seed=1)
    take(first, 6)
    state = first.state_dict()
    assert state == {"step": 6, "seed": 1}
    resumed = Batches(STREAM, 16, 8, seed=99)                  # the saved seed wins
    resumed.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(take(resumed, 4), whole[6:]))


def test_ranks_together_hold_the_global_batch():
    one = Batches(STREAM, 16, 8, seed=5)
    ranks = [Batches(STREAM, 16, 8, seed=5, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        full, parts = next(one), [next(r) for r in ranks]
        assert all(p.shape == (4, 17) for p in parts)
        assert torch.equal(full[0::2], parts[0]) and torch.equal(full[1::2], parts[1])
        assert torch.equal(torch.stack(parts, dim=1).reshape(8, 17), full)   # rank r holds rows r::2


def test_every_window_can_be_drawn():
    short = torch.arange(20)
    starts = torch.cat([Batches(short, 16, 64, seed=0).batch(k)[:, 0] for k in range(4)])
    assert set(starts.tolist()) == set(range(4))               # the last window ends at the last token
    assert torch.equal(Batches(torch.arange(17), 16, 2).batch(0), torch.arange(17).expand(2, 17))


def test_small_integer_streams_become_long():
    data = torch.frombuffer(bytearray(b"hello world, hello batches"), dtype=torch.uint8)
    assert Batches(data, 4, 2).batch(0).dtype == torch.long


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 17"):
        Batches(torch.arange(16), seq_len=16, batch_size=2)
    with pytest.raises(ValueError, match="multiple of world_size"):
        Batches(STREAM, 16, batch_size=6, world_size=4, rank=0)
    with pytest.raises(ValueError, match="rank"):
        Batches(STREAM, 16, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seq_len"):
        Batches(STREAM, 0, 8)
    with pytest.raises(ValueError, match="batch_size"):
        Batches(STREAM, 16, 0)
    with pytest.raises(ValueError, match="1-d integer"):
        Batches(torch.rand(100), 16, 8)
    with pytest.raises(ValueError, match="missing"):
        Batches(STREAM, 16, 8).load_state_dict({"seed": 0})
