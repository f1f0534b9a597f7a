"""Reversible layers (polyformer/reversible.py): the two-stream formula y1 = x1 + Attn(x2), y2 = x2 + FF(y1),
output (y1 + y2) / 2, with gradients from recomputation equal to ordinary autograd's, saved activations that
do not grow with depth, inputs reconstructed from outputs, auxiliary losses reported once, decoding, and the
refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper
from polyformer.interfaces import AttnOut, Context
from polyformer.losses import AuxLosses
from polyformer.reversible import Run
from tests.helpers import ids, tiny_lm
from tests.options import perturb

DIM, N = 16, 9


def stack(cls=Decoder, depth: int = 3, seed: int = 0, **keywords) -> nn.Module:
    torch.manual_seed(seed)
    return perturb(cls(dim=DIM, depth=depth, heads=2, attn_dim_head=8, reversible=True, **keywords), seed + 1)


def context(s: nn.Module, n: int = N) -> Context:
    return Context(pos=torch.arange(n)[None], causal=s.causal)


def branch_of(block: nn.Module, x: torch.Tensor, ctx: Context) -> torch.Tensor:
    h = block.norm_in(x)
    if block.shift is not None:
        h = block.shift(h, ctx.shift_mask)
    y = block.branch(h) if block.kind == "f" else block.branch(h, ctx, None).out
    return block.norm_out(y) if block.norm_out is not None else y


def explicit(s: nn.Module, x: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The formula with ordinary autograd, from the stack's own modules."""
    x1 = x2 = x
    blocks = list(s.blocks)
    for attention, feedforward in zip(blocks[0::2], blocks[1::2]):
        x1 = x1 + branch_of(attention, x2, ctx)
        x2 = x2 + branch_of(feedforward, x1, ctx)
    return s.final_norm((x1 + x2) / 2)


def grads(s: nn.Module, x: torch.Tensor, out: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    s.zero_grad(set_to_none=True)
    x.grad = None
    (out * w).sum().backward()
    found = {name: p.grad.clone() for name, p in s.named_parameters() if p.grad is not None}
    found["x"] = x.grad.clone()
    return found


OPTIONS = {
    "dense": (Decoder, {}),
    "sandwich_shift_rotary": (Encoder, dict(sandwich_norm=True, shift_tokens=1, rotary_pos_emb=True)),
    "t5_bias_shared": (Decoder, dict(rel_pos_bias=True)),
    "performer": (Decoder, dict(attn_performer=True, attn_performer_features=8)),
    "window_pattern": (Decoder, dict(attn_window=3)),
    "fnet_mixer": (Encoder, dict(attn_fnet=True)),
    "ff_chunks": (Decoder, dict(ff_chunks=4, ff_glu=True)),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_gradients_equal_ordinary_autograd_of_the_formula(name):
    cls, keywords = OPTIONS[name]
    s = stack(cls, **keywords).double()
    x = torch.randn(2, N, DIM, dtype=torch.float64, requires_grad=True)
    out = s(x)
    w = torch.randn_like(out)
    got = grads(s, x, out, w)
    ref_out = explicit(s, x, context(s))
    want = grads(s, x, ref_out, w)
    assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
    assert got.keys() == want.keys() == {n for n, _ in s.named_parameters()} | {"x"}
    for key in want:
        assert_close(got[key], want[key], atol=1e-10, rtol=1e-8, msg=key)
    assert all(want[key].abs().sum() > 0 for key in want if not key.startswith("final_norm")), "an unused parameter"


@pytest.mark.parametrize("keywords", [dict(attn_dropout=0.3, ff_dropout=0.3), dict(ff_chunks=4, ff_dropout=0.3)],
                         ids=["whole", "ff_chunks"])      # ff_chunks: recomputed piece by piece, each piece's masks
def test_dropout_is_replayed_in_the_recomputation(keywords):
    s = stack(**keywords).double().train()
    x = torch.randn(2, N, DIM, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, N, DIM, dtype=torch.float64)
    torch.manual_seed(7)
    got = grads(s, x, s(x), w)
    torch.manual_seed(7)
    want = grads(s, x, explicit(s, x, context(s)), w)
    torch.manual_seed(8)
    other = grads(s, x, explicit(s, x, context(s)), w)
    for key in want:
        assert_close(got[key], want[key], atol=1e-10, rtol=1e-8, msg=key)
    assert not torch.allclose(other["x"], want["x"]), "dropout had no effect: the test would not see a bad replay"


def saved_bytes(s: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for the backward during a forward, parameters left out."""
    params = {p.data_ptr() for p in s.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        s(x).sum()
    return total


def test_saved_activations_do_not_grow_with_depth():
    x = torch.randn(2, 32, DIM, requires_grad=True)
    rev = [saved_bytes(stack(depth=d).train(), x) for d in (2, 6)]
    ordinary = [saved_bytes(Decoder(dim=DIM, depth=d, heads=2, attn_dim_head=8).train(), x) for d in (2, 6)]
    assert rev[0] == rev[1]
    assert ordinary[1] > 2.5 * ordinary[0]
    assert rev[1] < ordinary[0]


def test_each_pairs_parameter_gradients_accumulate_before_the_earlier_pairs_backward():
    """Not all at the end: a second copy of every gradient would then be held, growing with depth."""
    s = stack(depth=3, rel_pos_bias=True).train()
    events = []
    for i, block in enumerate(s.blocks):
        for p in block.parameters():
            p.register_post_accumulate_grad_hook(lambda p, pair=i // 2: events.append(("grad", pair)))
    backward = Run.backward

    def logged(self, k, *args):
        events.append(("pair", k))
        return backward(self, k, *args)

    Run.backward = logged
    try:
        s(torch.randn(1, N, DIM, requires_grad=True)).sum().backward()
    finally:
        Run.backward = backward
    assert [e for e in events if e[0] == "pair"] == [("pair", 2), ("pair", 1), ("pair", 0)]
    for k in (2, 1):
        assert max(i for i, e in enumerate(events) if e == ("grad", k)) < events.index(("pair", k - 1))
    assert s.shared_bias.embedding.weight.grad is not None and s.shared_bias.embedding.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_input_is_reconstructed_from_the_output(dtype, tol):
    s = stack(depth=4, attn_dropout=0.2, ff_dropout=0.2).to(dtype).train()
    x = torch.randn(2, N, DIM, dtype=dtype)
    blocks = list(s.blocks)
    run = Run(list(zip(blocks[0::2], blocks[1::2])), context(s), [[]] * 4, x)
    y1 = y2 = x
    with torch.no_grad():
        for k in range(4):
            y1, y2, _ = run.forward(k, y1, y2)
    x1, x2 = y1, y2
    for k in reversed(range(4)):
        x1, x2, _, _ = run.backward(k, x1, x2)
    assert (y1 - x).abs().max() > 0.5 and (y2 - x).abs().max() > 0.5
    assert_close(x1, x, atol=tol, rtol=tol)
    assert_close(x2, x, atol=tol, rtol=tol)


class Probe(nn.Module):
    """A test-only wrapper of a direct kernel that reports mean(out^2) as the auxiliary loss 'probe'."""

    loss_names = ("probe",)

    def __init__(self, kernel: nn.Module):
        super().__init__()
        self.inner, self.caps = kernel, kernel.caps

    def forward(self, q, kv, **keywords) -> AttnOut:
        out = self.inner(q, kv, **keywords)
        losses = AuxLosses()
        losses.report("probe", out.out.square().mean(), 0.5)
        return AttnOut(out.out, weights=out.weights, losses=losses)


def test_auxiliary_losses_reach_the_record_once_and_their_gradients_flow():
    s = stack(attn_performer=True, attn_performer_features=8).double()
    for block in s.blocks[0::2]:
        block.branch.kernel = Probe(block.branch.kernel)
    x = torch.randn(2, N, DIM, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, N, DIM, dtype=torch.float64)
    out, record = s(x, return_intermediates=True)
    loss = (out * w).sum() + record.losses.total()
    s.zero_grad(set_to_none=True)
    loss.backward()
    got = {n: p.grad.clone() for n, p in s.named_parameters()} | {"x": x.grad.clone()}
    ctx = context(s)
    ref = explicit(s, x, ctx)
    assert_close(record.losses.terms["probe"], ctx.losses.terms["probe"].to(record.losses.terms["probe"].dtype))
    assert record.losses.weights == {"probe": 0.5}
    s.zero_grad(set_to_none=True)
    x.grad = None
    ((ref * w).sum() + ctx.losses.total()).backward()
    for name, p in s.named_parameters():
        assert_close(got[name], p.grad, atol=1e-8, rtol=1e-6, msg=name)
    assert_close(got["x"], x.grad, atol=1e-8, rtol=1e-6)


def test_a_loss_on_an_early_pairs_auxiliary_loss_alone_differentiates_through_autograd_grad():
    """Only the first pair's function runs in this backward: it reconstructs its outputs from the last
    pair's; torch.autograd.grad gets the parameters' gradients as the functions' returns."""
    s = stack(attn_performer=True, attn_performer_features=8).double()
    s.blocks[0].branch.kernel = Probe(s.blocks[0].branch.kernel)
    x = torch.randn(2, N, DIM, dtype=torch.float64, requires_grad=True)
    params = list(s.parameters())
    _, record = s(x, return_intermediates=True)
    got = torch.autograd.grad(record.losses.total(), [x, *params], allow_unused=True)
    ctx = context(s)
    explicit(s, x, ctx)
    want = torch.autograd.grad(ctx.losses.total(), [x, *params], allow_unused=True)
    assert got[0].abs().sum() > 0
    for t, a, b in zip([x, *params], got, want):
        assert_close(a if a is not None else torch.zeros_like(t), b if b is not None else torch.zeros_like(t),
                     atol=1e-10, rtol=1e-8)
    assert all(p.grad is None for p in params)


def test_a_redraw_in_training_counts_once_and_the_recomputation_sees_the_forwards_features():
    s = stack(attn_performer=True, attn_performer_features=8, attn_performer_redraw=1).double().train()
    twin = copy.deepcopy(s)
    x = torch.randn(2, N, DIM, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, N, DIM, dtype=torch.float64)
    got = grads(s, x, s(x), w)
    want = grads(twin, x, explicit(twin, x, context(twin)), w)
    for key in want:
        assert_close(got[key], want[key], atol=1e-10, rtol=1e-8, msg=key)
    for block in s.blocks[0::2]:
        assert int(block.branch.kernel.feature.calls) == 1 and int(block.branch.kernel.feature.draws) == 1


def test_return_attn_gives_the_weights_and_the_same_gradients():
    s = stack().double()
    x = torch.randn(2, N, DIM, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, N, DIM, dtype=torch.float64)
    out, record = s(x, return_attn=True)
    assert len(record.attn) == 3 and record.attn[0].shape == (2, 2, N, N)
    assert_close(record.attn[0].sum(-1), torch.ones(2, 2, N, dtype=torch.float64))
    assert_close(grads(s, x, out, w)["x"], grads(s, x, s(x), w)["x"], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("keywords", [dict(shift_tokens=1, rotary_pos_emb=True),
                                      dict(attn_performer=True, attn_performer_features=8, ff_chunks=3)])
def test_cached_decoding_equals_the_uncached_forward(keywords):
    torch.manual_seed(0)
    model = perturb(tiny_lm(reversible=True, depth=3, **keywords), scale=0.05)
    x = ids(2, 12)
    full = model(x)
    state = model.new_state(2, 12)
    steps = [model(x[:, :5], state=state)] + [model(x[:, t:t + 1], state=state) for t in range(5, 12)]
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    ar = AutoregressiveWrapper(model)
    assert torch.equal(ar.generate(x[:, :4], 6, temperature=0.0),
                       ar.generate(x[:, :4], 6, temperature=0.0, cache_kv=False))


def test_custom_layers_of_pairs_are_the_same_stack():
    a = Decoder(dim=DIM, depth=2, heads=2, reversible=True)
    b = Decoder(dim=DIM, depth=1, heads=2, reversible=True, custom_layers=("a", "f", "a", "f"))
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, N, DIM)
    assert_close(a(x), b(x))


@pytest.mark.parametrize("keywords, named", [
    (dict(cross_attend=True), "cross_attend=True"),
    (dict(macaron=True), "macaron=True"),
    (dict(sandwich_coef=1), "sandwich_coef=1"),
    (dict(custom_layers=("a", "a", "f")), "custom_layers"),
    (dict(gau=True), "gau=True"),
    (dict(use_rezero=True), "use_rezero"),
    (dict(gate_residual=True), "gate_residual"),
    (dict(pre_norm=False), "pre_norm=False"),
    (dict(gradient_checkpointing=True), "gradient_checkpointing=True"),
    (dict(residual_attn=True), "residual_attn=True"),
])
def test_combinations_that_cannot_hold_are_refused_by_name(keywords, named):
    with pytest.raises(ValueError, match="reversible") as err:
        Decoder(dim=DIM, depth=2, heads=2, reversible=True, **keywords)
    assert named in str(err.value)


def test_bad_values_and_memories_are_refused_by_name():
    with pytest.raises(ValueError, match="reversible must be True or False"):
        Decoder(dim=DIM, depth=2, reversible="yes")
    with pytest.raises(ValueError, match="max_mem_len=8 cannot combine with reversible=True"):
        TransformerWrapper(num_tokens=10, max_seq_len=16, max_mem_len=8,
                           attn_layers=Decoder(dim=DIM, depth=2, reversible=True))
    with pytest.raises(ValueError, match="mems"):
        Decoder(dim=DIM, depth=1, reversible=True)(torch.randn(1, 4, DIM), mems=[torch.randn(1, 2, DIM)])
