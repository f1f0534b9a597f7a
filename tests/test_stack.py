"""The layer stack: layouts (sandwich, macaron, cross, custom), norm placement (pre, post,
sandwich), residual policies (add, ReZero, GRU gate), token shift, gradient checkpointing,
residual attention, intermediates, and the norm / feedforward formulas of their papers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import polyformer.stack
from polyformer import AttentionLayers, CrossAttender, Decoder, Encoder, FeedForwardConfig, Intermediates
from polyformer.feedforward import FeedForward
from polyformer.interfaces import Context, Source
from polyformer.norm import LayerNorm, RMSNorm, ScaleNorm
from polyformer.residual import GRUGate, ReZero
from polyformer.shift import TokenShift
from tests.helpers import ids, tiny_lm

DIM = 32


def ctx_for(x: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = True) -> Context:
    return Context(pos=torch.arange(x.shape[1])[None], mask=mask, causal=causal)


def run_block(block, x, mask=None, causal=True):
    return block(x, ctx_for(x, mask, causal), None)[0]


def branch_of(block, h, mask=None, causal=True):
    """What the block's branch computes from its (already normalised / shifted) input h."""
    if block.kind == "f":
        return block.branch(h)
    return block.branch(h, ctx_for(h, mask, causal), None).out


# ---------------------------------------------------------------- ReZero


def test_rezero_blocks_are_identity_at_init():
    stack = Decoder(dim=DIM, depth=2, heads=4, use_rezero=True).eval()
    assert stack.final_norm is None
    assert all(isinstance(b.combine, ReZero) and b.norm_in is None for b in stack.blocks)
    x = torch.randn(2, 10, DIM)
    assert_close(stack(x), x, rtol=0, atol=0)
    # once g moves, the branches do contribute: x + g * f(x)
    block = stack.blocks[0]
    with torch.no_grad():
        block.combine.g.fill_(0.7)
    assert_close(run_block(block, x), x + 0.7 * branch_of(block, x))
    assert not torch.allclose(stack(x), x)


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize("depth,k", [(3, 1), (4, 2), (3, 3)])
def test_sandwich_coef_layout(depth, k):
    stack = Decoder(dim=DIM, depth=depth, heads=4, sandwich_coef=k)
    expected = ("a",) * k + ("a", "f") * (depth - k) + ("f",) * k
    assert stack.layout == expected
    assert tuple(b.kind for b in stack.blocks) == expected
    assert tuple(type(b.branch).__name__ for b in stack.blocks) == tuple(
        "Attention" if t == "a" else "FeedForward" for t in expected)


def test_macaron_layout_and_half_step_feedforward():
    stack = Decoder(dim=DIM, depth=2, heads=4, macaron=True).eval()
    assert stack.layout == ("f", "a", "f") * 2
    assert [b.scale for b in stack.blocks] == [0.5, 1.0, 0.5] * 2
    x = torch.randn(2, 8, DIM)
    first = stack.blocks[0]
    assert_close(run_block(first, x), x + 0.5 * first.branch(first.norm_in(x)))
    last = stack.blocks[2]
    assert_close(run_block(last, x), x + 0.5 * last.branch(last.norm_in(x)))
    # without macaron the same feedforward is a full step
    plain = Decoder(dim=DIM, depth=2, heads=4).eval()
    assert [b.scale for b in plain.blocks] == [1.0] * 4


def test_cross_attend_layout_and_context_is_used():
    stack = Decoder(dim=DIM, depth=2, heads=4, cross_attend=True).eval()
    assert stack.layout == ("a", "c", "f") * 2
    assert tuple(b.kind for b in stack.blocks) == ("a", "c", "f") * 2
    x, context = torch.randn(2, 6, DIM), torch.randn(2, 5, DIM)
    out = stack(x, context=context)
    other = context.clone()
    other[:, 3:] += 1.0
    assert not torch.allclose(stack(x, context=other), out)
    # masked context entries are invisible
    cmask = torch.tensor([[True, True, True, False, False]] * 2)
    assert_close(stack(x, context=other, context_mask=cmask), stack(x, context=context, context_mask=cmask))


def test_custom_layers():
    stack = AttentionLayers(dim=DIM, depth=1, heads=4, custom_layers=("a", "f", "f", "a")).eval()
    assert tuple(b.kind for b in stack.blocks) == ("a", "f", "f", "a")
    # a stack of feedforward blocks only mixes nothing across positions
    ff_only = AttentionLayers(dim=DIM, depth=1, heads=4, custom_layers=("f", "f")).eval()
    x = torch.randn(1, 7, DIM)
    y = x.clone()
    y[:, 1:] = torch.randn(1, 6, DIM)
    assert_close(ff_only(y)[:, 0], ff_only(x)[:, 0])
    # ... while one attention block does
    assert not torch.allclose(stack(y)[:, 0], stack(x)[:, 0])


# ---------------------------------------------------------------- norm placement


def test_post_norm_blocks_and_no_final_norm():
    stack = Decoder(dim=DIM, depth=2, heads=4, pre_norm=False).eval()
    assert stack.final_norm is None
    x = torch.randn(2, 8, DIM)
    out, record = stack(x, return_intermediates=True)
    for i, block in enumerate(stack.blocks):
        assert block.norm_in is None and block.post_norm is not None
        h = record.hiddens[i]
        expected = F.layer_norm(h + branch_of(block, h), (DIM,), block.post_norm.weight, block.post_norm.bias)
        assert_close(record.hiddens[i + 1], expected)
    assert_close(out, record.hiddens[-1])
    # every block output is normalised (post-LN), unlike pre-norm where the stream grows
    assert_close(out.mean(-1), torch.zeros(2, 8), atol=1e-5, rtol=0)


def test_pre_norm_blocks_and_final_norm():
    stack = Decoder(dim=DIM, depth=2, heads=4).eval()
    x = torch.randn(2, 8, DIM)
    out, record = stack(x, return_intermediates=True)
    for i, block in enumerate(stack.blocks):
        h = record.hiddens[i]
        assert_close(record.hiddens[i + 1], h + branch_of(block, block.norm_in(h)))
    assert isinstance(stack.final_norm, LayerNorm)
    assert_close(out, stack.final_norm(record.hiddens[-1]))


def test_sandwich_norm():
    stack = Decoder(dim=DIM, depth=2, heads=4, sandwich_norm=True).eval()
    x = torch.randn(2, 8, DIM)
    out, record = stack(x, return_intermediates=True)
    for i, block in enumerate(stack.blocks):
        assert block.norm_in is not None and block.norm_out is not None and block.post_norm is None
        h = record.hiddens[i]
        y = branch_of(block, block.norm_in(h))
        assert_close(record.hiddens[i + 1], h + block.norm_out(y))
        # the branch's contribution to the stream is itself normalised
        delta = record.hiddens[i + 1] - h
        assert_close(delta.mean(-1), torch.zeros(2, 8), atol=1e-5, rtol=0)
    assert_close(out, stack.final_norm(record.hiddens[-1]))


# ---------------------------------------------------------------- GRU gate (GTrXL)


def gtrxl_gate(gate: GRUGate, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Parisotto et al. 2019, eq. for g(x, y): x the residual stream, y the branch output."""
    W_r, W_z, W_g = gate.w.weight.chunk(3, dim=0)
    U_r, U_z = gate.u.weight.chunk(2, dim=0)
    U_g = gate.u_g.weight
    r = torch.sigmoid(y @ W_r.T + x @ U_r.T)
    z = torch.sigmoid(y @ W_z.T + x @ U_z.T - gate.gate_bias)
    h_hat = torch.tanh(y @ W_g.T + (r * x) @ U_g.T)
    return (1 - z) * x + z * h_hat


def test_gru_gate_follows_gtrxl():
    gate = GRUGate(DIM)
    x, y = torch.randn(3, 5, DIM), torch.randn(3, 5, DIM)
    assert gate.gate_bias > 0
    assert_close(gate(x, y), gtrxl_gate(gate, x, y))


def test_gru_gate_is_near_identity_at_init():
    x, y = torch.randn(4, 8, DIM), 1e-3 * torch.randn(4, 8, DIM)
    gated = GRUGate(DIM)
    deviation = ((gated(x, y) - x).norm() / x.norm()).item()
    open_gate = GRUGate(DIM, gate_bias=0.0)
    open_gate.load_state_dict(gated.state_dict())
    open_deviation = ((open_gate(x, y) - x).norm() / x.norm()).item()
    assert deviation < 0.3
    assert deviation < 0.5 * open_deviation     # the positive gate bias is what keeps it close


def test_gate_residual_stack_uses_gru_gates():
    stack = Decoder(dim=DIM, depth=2, heads=4, gate_residual=True).eval()
    assert all(isinstance(b.combine, GRUGate) for b in stack.blocks)
    x = torch.randn(2, 6, DIM)
    block = stack.blocks[0]
    assert_close(run_block(block, x), gtrxl_gate(block.combine, x, branch_of(block, block.norm_in(x))))


# ---------------------------------------------------------------- token shift


def test_token_shift_moves_second_half_by_one():
    x = torch.randn(2, 5, 8)
    out = TokenShift((0, 1))(x)
    assert_close(out[..., :4], x[..., :4], rtol=0, atol=0)
    assert_close(out[:, 1:, 4:], x[:, :-1, 4:], rtol=0, atol=0)
    assert_close(out[:, 0, 4:], torch.zeros(2, 4), rtol=0, atol=0)


def test_token_shift_remainder_features_stay():
    x = torch.randn(1, 5, 11)                 # 11 = 3 chunks of 3 + 2 remainder
    out = TokenShift((0, 1, 2))(x)
    assert_close(out[..., :3], x[..., :3], rtol=0, atol=0)
    assert_close(out[:, 1:, 3:6], x[:, :-1, 3:6], rtol=0, atol=0)
    assert_close(out[:, 2:, 6:9], x[:, :-2, 6:9], rtol=0, atol=0)
    assert_close(out[:, :2, 6:9], torch.zeros(1, 2, 3), rtol=0, atol=0)
    assert_close(out[..., 9:], x[..., 9:], rtol=0, atol=0)


def test_token_shift_backwards():
    x = torch.randn(1, 5, 6)
    out = TokenShift((-1, 0, 1))(x)
    assert_close(out[:, :-1, :2], x[:, 1:, :2], rtol=0, atol=0)       # position i receives i + 1
    assert_close(out[:, -1, :2], torch.zeros(1, 2), rtol=0, atol=0)
    assert_close(out[..., 2:4], x[..., 2:4], rtol=0, atol=0)
    assert_close(out[:, 1:, 4:], x[:, :-1, 4:], rtol=0, atol=0)


def test_token_shift_masked_positions_contribute_zeros():
    x = torch.randn(1, 5, 8)
    mask = torch.tensor([[True, True, False, True, True]])
    out = TokenShift((0, 1))(x, mask)
    assert_close(out[:, 3, 4:], torch.zeros(1, 4), rtol=0, atol=0)   # received from masked position 2
    assert_close(out[:, 2, :4], x[:, 2, :4], rtol=0, atol=0)         # it keeps its own unshifted features
    assert_close(out[:, 4, 4:], x[:, 3, 4:], rtol=0, atol=0)


def test_shift_tokens_directions_and_per_block_tuple():
    causal = Decoder(dim=DIM, depth=2, heads=4, shift_tokens=1)
    assert [b.shift.shifts for b in causal.blocks] == [(0, 1)] * 4
    bidirectional = Encoder(dim=DIM, depth=2, heads=4, shift_tokens=1)
    assert [b.shift.shifts for b in bidirectional.blocks] == [(-1, 0, 1)] * 4
    per_block = Decoder(dim=DIM, depth=2, heads=4, shift_tokens=(1, 0, 2, 0))
    shifts = [b.shift.shifts if b.shift is not None else None for b in per_block.blocks]
    assert shifts == [(0, 1), None, (0, 1, 2), None]
    enc_per_block = Encoder(dim=DIM, depth=2, heads=4, shift_tokens=(0, 2, 0, 0))
    assert enc_per_block.blocks[1].shift.shifts == (-2, -1, 0, 1, 2)


def test_shift_tokens_block_shifts_its_normalised_input():
    stack = Decoder(dim=DIM, depth=1, heads=4, shift_tokens=1).eval()
    x = torch.randn(2, 6, DIM)
    for block in stack.blocks:
        h = block.norm_in(x)
        shifted = torch.cat((h[..., :16], F.pad(h[..., 16:], (0, 0, 1, -1))), dim=-1)
        assert_close(run_block(block, x), x + branch_of(block, shifted))


# ---------------------------------------------------------------- gradient checkpointing


@pytest.mark.parametrize("options", [{}, dict(residual_attn=True), dict(shift_tokens=1),
                                     dict(rel_pos_bias=True, attn_num_mem_kv=2)],
                         ids=["default", "residual_attn", "shift_tokens", "rel_pos_bias+mem_kv"])
def test_gradient_checkpointing_same_loss_and_grads(monkeypatch, options):
    torch.manual_seed(0)
    ckpt = tiny_lm(gradient_checkpointing=True, **options).train()
    plain = tiny_lm(**options).train()
    plain.load_state_dict(ckpt.state_dict())
    calls = []
    real = polyformer.stack.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(polyformer.stack, "checkpoint", counting)
    x = ids(2, 12)
    target = ids(2, 12, seed=1)
    losses = []
    for model in (ckpt, plain):
        loss = F.cross_entropy(model(x).transpose(1, 2), target)
        loss.backward()
        losses.append(loss)
    assert len(calls) == len(ckpt.attn_layers.blocks)      # the checkpointed path did run
    assert_close(losses[0], losses[1])
    grads_plain = dict(plain.named_parameters())
    for name, p in ckpt.named_parameters():
        assert_close(p.grad, grads_plain[name].grad, msg=name)


# ---------------------------------------------------------------- residual attention (RealFormer)


def capture_kernels(stack, calls):
    def hook(module, args, kwargs, output):
        q, kv = args
        calls.append(dict(q=q, k=kv.k, prev=kwargs.get("prev_scores"), scores=output.scores,
                          weights=output.weights, scale=module.scale))
    return [b.branch.kernel.register_forward_hook(hook, with_kwargs=True)
            for b in stack.blocks if b.kind == "a"]


def test_residual_attn_adds_previous_pre_softmax_scores():
    stack = Decoder(dim=DIM, depth=3, heads=4, residual_attn=True).eval()
    calls = []
    capture_kernels(stack, calls)
    x = torch.randn(2, 7, DIM)
    stack(x, return_attn=True)
    assert len(calls) == 3
    running = torch.zeros(())
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    for i, c in enumerate(calls):
        raw = torch.einsum("bhid,bhjd->bhij", c["q"], c["k"]) * c["scale"]
        running = raw + running                       # layer l sees the sum of its own and all earlier scores
        assert_close(c["scores"], running)
        if i == 0:
            assert c["prev"] is None
        else:
            assert_close(c["prev"], calls[i - 1]["scores"])
        expected = running.masked_fill(~causal, float("-inf")).softmax(-1)
        assert_close(c["weights"], expected)


def test_without_residual_attn_scores_are_independent():
    stack = Decoder(dim=DIM, depth=2, heads=4).eval()
    calls = []
    capture_kernels(stack, calls)
    x = torch.randn(2, 7, DIM)
    stack(x, return_attn=True)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    for c in calls:
        assert c["prev"] is None
        raw = torch.einsum("bhid,bhjd->bhij", c["q"], c["k"]) * c["scale"]
        assert_close(c["weights"], raw.masked_fill(~causal, float("-inf")).softmax(-1))


# ---------------------------------------------------------------- intermediates


def test_return_intermediates():
    model = tiny_lm(depth=2)
    x = ids(2, 10)
    emb, record = model(x, return_embeddings=True, return_intermediates=True)
    assert isinstance(record, Intermediates)
    stack = model.attn_layers
    assert len(record.hiddens) == len(stack.blocks) + 1
    embedded = model.token_emb(x) + model.pos_emb(torch.arange(10)[None])
    assert_close(record.hiddens[0], embedded)
    for i, block in enumerate(stack.blocks):       # each hidden is the previous one through its block
        assert_close(record.hiddens[i + 1], run_block(block, record.hiddens[i]))
    assert_close(stack.final_norm(record.hiddens[-1]), emb)
    assert_close(model.to_logits(emb), model(x))
    assert record.attn == []                       # maps only when asked for


def test_return_attn_maps_are_distributions_over_kept_keys():
    model = tiny_lm(Encoder, depth=2)
    x = ids(2, 10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 7:] = False
    mask[1, 2] = False
    _, record = model(x, mask=mask, return_intermediates=True, return_attn=True)
    assert len(record.attn) == 2
    for maps in record.attn:
        assert_close(maps.sum(-1), torch.ones(2, 4, 10))
        assert (maps.masked_select(~mask[:, None, None, :].expand_as(maps)) == 0).all()
    # causal maps: nothing above the diagonal
    dec = tiny_lm(Decoder, depth=2)
    _, maps = dec(x, return_attn=True)
    for m in maps:
        assert (m.triu(1) == 0).all()
        assert_close(m.sum(-1), torch.ones(2, 4, 10))


def test_return_attn_forward_equals_the_fused_forward():
    """return_attn forces the reference path; its output must equal the (fused) normal forward,
    so the maps returned are the weights the model actually applies."""
    model = tiny_lm(Encoder, depth=2)
    assert all(b.branch.kernel.can_fuse for b in model.attn_layers.blocks if b.kind == "a")
    x = ids(2, 10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    logits_ref, maps = model(x, mask=mask, return_attn=True)
    assert_close(logits_ref, model(x, mask=mask))
    # and the first block's output is its maps applied to its values
    calls = []
    capture_kernels(model.attn_layers, calls)
    model(x, mask=mask, return_attn=True)
    heads_v = model.attn_layers.blocks[0].branch.project
    h = model.attn_layers.blocks[0].norm_in(model.token_emb(x) + model.pos_emb(torch.arange(10)[None]))
    _, kv = heads_v(h, Source(h, None, mask), None)
    assert_close(maps[0], calls[0]["weights"])
    out = torch.einsum("bhij,bhjd->bhid", maps[0], kv.v)
    assert_close(model.attn_layers.blocks[0].branch.output(out, h),
                 branch_of(model.attn_layers.blocks[0], h, mask, causal=False))


# ---------------------------------------------------------------- norms


def test_scalenorm_formula():
    norm = ScaleNorm(DIM)
    assert_close(norm.g, torch.tensor(math.sqrt(DIM)))
    x = torch.randn(3, 5, DIM)
    assert_close(norm(x), math.sqrt(DIM) * x / x.norm(dim=-1, keepdim=True))
    with torch.no_grad():
        norm.g.fill_(2.0)
    assert_close(norm(x).norm(dim=-1), torch.full((3, 5), 2.0))
    stack = Decoder(dim=DIM, depth=1, heads=4, use_scalenorm=True)
    assert all(isinstance(b.norm_in, ScaleNorm) for b in stack.blocks)
    assert isinstance(stack.final_norm, ScaleNorm)


def test_rmsnorm_formula():
    norm = RMSNorm(DIM)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(DIM))
    x = torch.randn(3, 5, DIM)
    rms = x.pow(2).mean(-1, keepdim=True).add(norm.eps).sqrt()
    assert_close(norm(x), x / rms * norm.weight)
    # no centring: unlike LayerNorm, a constant offset is not removed
    assert not torch.allclose(norm(x + 3.0), norm(x))
    stack = Decoder(dim=DIM, depth=1, heads=4, use_rmsnorm=True)
    assert all(isinstance(b.norm_in, RMSNorm) for b in stack.blocks)
    assert isinstance(stack.final_norm, RMSNorm)


# ---------------------------------------------------------------- feedforward


def test_ff_glu_is_geglu():
    """Shazeer 2020: FFN_GEGLU(x) = (GELU(x W) * x V) W2."""
    ff = FeedForward(DIM, FeedForwardConfig(glu=True))
    x = torch.randn(2, 5, DIM)
    inner = 4 * DIM
    w, b = ff.proj_in.weight, ff.proj_in.bias
    value = x @ w[:inner].T + b[:inner]
    gate = x @ w[inner:].T + b[inner:]
    expected = (value * F.gelu(gate)) @ ff.proj_out.weight.T + ff.proj_out.bias
    assert_close(ff(x), expected)
    stack = Decoder(dim=DIM, depth=1, heads=4, ff_glu=True)
    assert stack.blocks[1].branch.glu


def test_ff_relu_squared_is_primer():
    """So et al. 2021 (Primer): relu(x W1)^2 W2."""
    ff = FeedForward(DIM, FeedForwardConfig(activation="relu_squared"))
    x = torch.randn(2, 5, DIM)
    hidden = torch.clamp(x @ ff.proj_in.weight.T + ff.proj_in.bias, min=0) ** 2
    assert_close(ff(x), hidden @ ff.proj_out.weight.T + ff.proj_out.bias)
    stack = Decoder(dim=DIM, depth=1, heads=4, ff_relu_squared=True)
    ffb = stack.blocks[1].branch
    assert_close(ffb(x), torch.clamp(ffb.proj_in(x), min=0).square() @ ffb.proj_out.weight.T + ffb.proj_out.bias)


def test_default_ff_is_gelu_mlp():
    ff = FeedForward(DIM, FeedForwardConfig())
    x = torch.randn(2, 5, DIM)
    assert_close(ff(x), F.gelu(ff.proj_in(x)) @ ff.proj_out.weight.T + ff.proj_out.bias)


# ---------------------------------------------------------------- CrossAttender layout


def test_cross_attender_layout():
    stack = CrossAttender(dim=DIM, depth=2, heads=4)
    assert tuple(b.kind for b in stack.blocks) == ("c", "f") * 2


def test_a_plain_forward_keeps_no_block_input_alive():
    """Without return_intermediates / return_attn, a block's input is freed once the next block has
    it (inference memory at long lengths: the stack once held every block's input to the end)."""
    import weakref

    model = Decoder(dim=32, depth=3, heads=4).eval()
    inputs, alive_at = [], []

    def pre_hook(module, args):
        alive_at.append(sum(r() is not None for r in inputs[1:]))   # inputs[0] is the caller's tensor
        inputs.append(weakref.ref(args[0]))

    hooks = [b.register_forward_pre_hook(pre_hook) for b in model.blocks]
    with torch.inference_mode():
        model(torch.randn(2, 10, 32))
        assert len(inputs) == 6 and alive_at == [0] * 6
        _, record = model(torch.randn(2, 10, 32), return_intermediates=True)
    assert len(record.hiddens) == 7 and len(record.mems) == 3
    for h in hooks:
        h.remove()
