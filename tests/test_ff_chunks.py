"""Chunked feedforward (ff_chunks = c, polyformer/feedforward.py): the positions go through the
feedforward in c pieces along the sequence, with the outputs and gradients of the whole, one piece's hidden
tensor at a time without autograd, and one piece at a time in a reversible stack's recomputation."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder
from polyformer.config import FeedForwardConfig
from polyformer.feedforward import FeedForward
from tests.test_reversible import DIM, stack


def pair(chunks: int, **options) -> tuple[FeedForward, FeedForward]:
    whole = FeedForward(DIM, FeedForwardConfig(**options)).double()
    pieces = FeedForward(DIM, FeedForwardConfig(chunks=chunks, **options)).double()
    pieces.load_state_dict(whole.state_dict())
    return whole, pieces


@pytest.mark.parametrize("chunks", [3, 4, 5, 7, 12, 20])        # n = 12: divides, does not, c = n, c > n
@pytest.mark.parametrize("options", [{}, dict(glu=True, activation="swish")])
def test_outputs_and_gradients_equal_the_whole(chunks, options):
    whole, pieces = pair(chunks, **options)
    x = torch.randn(2, 12, DIM, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 12, DIM, dtype=torch.float64)
    out = whole(x)
    got = pieces(x)
    assert_close(got, out, atol=1e-12, rtol=1e-10)
    want = torch.autograd.grad((out * w).sum(), [x, *whole.parameters()])
    found = torch.autograd.grad((got * w).sum(), [x, *pieces.parameters()])
    for a, b in zip(found, want):
        assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_the_keyword_reaches_every_feedforward_and_keeps_the_stack_s_outputs_and_gradients():
    torch.manual_seed(0)
    whole = Decoder(dim=DIM, depth=2, heads=2, ff_glu=True)
    pieces = Decoder(dim=DIM, depth=2, heads=2, ff_glu=True, ff_chunks=5)
    pieces.load_state_dict(whole.state_dict())
    assert [b.branch.chunks for b in pieces.blocks if b.kind == "f"] == [5, 5]
    x = torch.randn(2, 13, DIM, requires_grad=True)
    out, got = whole(x), pieces(x)
    assert_close(got, out)
    want = torch.autograd.grad(out.square().sum(), [x, *whole.parameters()])
    found = torch.autograd.grad(got.square().sum(), [x, *pieces.parameters()])
    for a, b in zip(found, want):
        assert_close(a, b, atol=1e-5, rtol=1e-4)


def hidden_rows(ff: FeedForward, x: torch.Tensor) -> list[int]:
    """The number of positions in each hidden tensor (b, rows, inner) the feedforward makes without grad."""
    rows = []
    handle = ff.proj_in.register_forward_hook(lambda module, args, out: rows.append(out.shape[-2]))
    with torch.no_grad():
        ff(x)
    handle.remove()
    return rows


def test_inference_holds_one_piece_of_the_hidden_tensor_at_a_time():
    whole, pieces = pair(4)
    x = torch.randn(2, 13, DIM, dtype=torch.float64)
    assert hidden_rows(whole, x) == [13]
    assert hidden_rows(pieces, x) == [4, 3, 3, 3]


def largest_saved_hidden(s: torch.nn.Module, x: torch.Tensor, inner: int) -> int:
    """The most positions (batch x rows) of feedforward hidden tensors (..., inner) that one recomputed graph
    of a reversible stack's backward saves (each graph is differentiated by a torch.autograd.grad call, then
    freed); parameters left out."""
    out = s(x)
    params = {p.data_ptr() for p in s.parameters()}
    saved, largest = [0], [0]
    grad = torch.autograd.grad

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[-1] == inner and t.data_ptr() not in params:
            saved[0] += t.numel() // inner
        return t

    def differentiate(*args, **keywords):
        largest[0], saved[0] = max(largest[0], saved[0]), 0
        return grad(*args, **keywords)

    with pytest.MonkeyPatch.context() as patch, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        patch.setattr(torch.autograd, "grad", differentiate)
        out.sum().backward()
    return largest[0]


def test_a_reversible_recomputation_differentiates_one_piece_at_a_time():
    x = torch.randn(2, 12, DIM, requires_grad=True)
    whole = largest_saved_hidden(stack(depth=2).train(), x, 4 * DIM)
    pieces = largest_saved_hidden(stack(depth=2, ff_chunks=4).train(), x, 4 * DIM)
    assert whole >= 2 * 12 and pieces * 4 == whole


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "4"])
def test_bad_values_are_refused_by_name(value):
    with pytest.raises(ValueError, match="ff_chunks must be an integer >= 1"):
        Decoder(dim=DIM, depth=1, ff_chunks=value)
