"""x-transformers' norm / residual extras, each by its defining property: use_simple_rmsnorm (RMSNorm without a gain),
scale_residual (a learned per-feature scale of the stream), resi_dual (ResiDual, arXiv:2304.14802), attn_head_scale
(NormFormer, arXiv:2110.09456), attn_sparse_topk_straight_through, and the attention z-loss under the wrapper
spellings (return_attn_z_loss, attn_z_loss_weight, add_attn_z_loss). Cache parity and causality: tests/options.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper
from polyformer.attention.normalize import TopK, masked_softmax
from polyformer.attention.topk_straight import StraightThrough
from polyformer.residual import Add
from polyformer.residual_scale import ScaledResidual
from polyformer.norm import SimpleRMSNorm
from tests.options import perturb

DIM = 16
SMALL = dict(dim=DIM, depth=2, heads=2, attn_dim_head=8)


def stream(b: int = 2, n: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, n, DIM, generator=torch.Generator().manual_seed(seed))


def built(seed: int = 0, **kw) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(**{**SMALL, **kw}).eval()


# --- use_simple_rmsnorm --------------------------------------------------------------------------------------

def test_simple_rmsnorm_is_l2norm_times_sqrt_dim_and_theirs():
    from x_transformers.x_transformers import SimpleRMSNorm as Theirs

    x = torch.randn(3, 5, DIM, dtype=torch.float64) * 3
    ours = SimpleRMSNorm(DIM, eps=0.0)
    assert list(ours.parameters()) == []
    assert_close(ours(x), x / x.norm(dim=-1, keepdim=True) * DIM ** 0.5)
    assert_close(SimpleRMSNorm(DIM)(x.float()), Theirs(DIM)(x.float()), atol=1e-5, rtol=1e-4)


def test_simple_rmsnorm_stack_is_rmsnorm_with_unit_gains():
    """Same weights elsewhere: equal to use_rmsnorm while its gains are 1, different once they move."""
    simple, rms = built(use_simple_rmsnorm=True), built(use_rmsnorm=True)
    assert not any("norm" in name for name, _ in simple.named_parameters())
    x = stream()
    assert_close(simple(x), rms(x))
    with torch.no_grad():
        rms.blocks[0].norm_in.weight.mul_(1.5)
    assert not torch.allclose(simple(x), rms(x))


# --- scale_residual --------------------------------------------------------------------------------------------

def test_scaled_residual_matches_x_transformers_residual():
    from x_transformers.x_transformers import Residual

    theirs = Residual(DIM, scale_residual=True, scale_residual_constant=0.7)
    ours = ScaledResidual(Add(DIM), DIM, learned=True, constant=0.7)
    with torch.no_grad():
        theirs.residual_scale.copy_(torch.randn(DIM))
        ours.scale.copy_(theirs.residual_scale)
    x, y = stream(seed=1), stream(seed=2)
    assert_close(ours(x, y), theirs(y, x))          # theirs takes (branch output, stream)


@pytest.mark.parametrize("kw, branch, constant", [(dict(scale_residual=True), 1.0, 1.0),
                                                  (dict(scale_residual=0.5, scale_residual_constant=2.0), 0.5, 2.0)])
def test_scale_residual_formula(kw, branch, constant):
    """One feedforward block: final_norm(s * c * x + branch * f(norm(x))), s learned per feature."""
    model = built(custom_layers=("f",), **kw)
    s = torch.rand(DIM) + 0.5
    with torch.no_grad():
        model.blocks[0].combine.scale.copy_(s)
    x = stream()
    block = model.blocks[0]
    expected = model.final_norm(s * constant * x + branch * block.branch(block.norm_in(x)))
    assert_close(model(x), expected)


# --- resi_dual --------------------------------------------------------------------------------------------------

def test_resi_dual_is_the_papers_formula():
    """x_{k+1} = LN(x_k + f_k(x_k)), d = x_0 + sum_k f_k(x_k), output x_N + LN(d)."""
    model = perturb(built(resi_dual=True, depth=1))
    x = stream()
    a, f = model.blocks
    y1 = a.branch(x, ctx_of(model, x)).out
    x1 = a.post_norm(x + y1)
    y2 = f.branch(x1)
    x2 = f.post_norm(x1 + y2)
    assert_close(model(x), x2 + model.resi_dual.norm(x + y1 + y2), atol=1e-5, rtol=1e-5)


def ctx_of(model: Decoder, x: torch.Tensor):
    from polyformer.interfaces import Context

    return Context(pos=torch.arange(x.shape[1])[None], causal=True)


def test_resi_dual_scale_leaves_the_output_and_checkpointing_the_gradients():
    """LN(s d) = LN(d) up to eps: resi_dual_scale keeps the output; gradient checkpointing keeps the gradients."""
    x = stream()
    one, tenth = built(resi_dual=True, norm_eps=1e-12), built(resi_dual=True, resi_dual_scale=0.1, norm_eps=1e-12)
    assert_close(one(x), tenth(x))
    plain, ckpt = built(resi_dual=True).train(), built(resi_dual=True, gradient_checkpointing=True).train()
    for m in (plain, ckpt):
        m(x).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert_close(p.grad, q.grad, msg=name)
    assert plain.resi_dual.d is None                 # let go after the forward


def test_resi_dual_refusals():
    with pytest.raises(ValueError, match="pre_norm.*resi_dual|resi_dual.*pre_norm"):
        Decoder(**SMALL, resi_dual=True, pre_norm=True)
    with pytest.raises(ValueError, match="resi_dual_scale"):
        Decoder(**SMALL, resi_dual=True, resi_dual_scale=0)
    with pytest.raises(ValueError, match="resi_dual_scale.*resi_dual=True"):
        Decoder(**SMALL, resi_dual_scale=0.1)
    with pytest.raises(ValueError, match="resi_dual and num_residual_streams"):
        Decoder(**SMALL, resi_dual=True, num_residual_streams=2)


# --- attn_head_scale --------------------------------------------------------------------------------------------

def test_head_scale_is_the_out_projection_scaled_per_head():
    """out_h * gamma_h before the projection equals the projection's columns of head h times gamma_h."""
    scaled, plain = built(attn_head_scale=True), built()
    gamma = torch.tensor([0.3, 1.7])
    x = stream()
    assert_close(scaled(x), plain(x))               # gamma = 1 at init
    state = {k.replace("output.output.", "output."): v for k, v in scaled.state_dict().items() if "gamma" not in k}
    plain.load_state_dict(state)
    with torch.no_grad():
        for block in (scaled.blocks[0], scaled.blocks[2]):
            block.branch.output.gamma.copy_(gamma)
        for block in (plain.blocks[0], plain.blocks[2]):
            w = block.branch.output.proj.weight.view(DIM, 2, 8)
            w.mul_(gamma[None, :, None])
    assert_close(scaled(x), plain(x))


# --- attn_sparse_topk_straight_through ---------------------------------------------------------------------------

def test_topk_straight_through_values_of_topk_gradient_of_softmax_and_theirs():
    from x_transformers.attend import sparse_topk_attn

    s = torch.randn(2, 2, 5, 7, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 2, 5, 7, dtype=torch.float64)
    w = StraightThrough(TopK(3))(s, None)
    assert_close(w, TopK(3)(s, None))
    (grad,) = torch.autograd.grad((w * g).sum(), s)
    (soft,) = torch.autograd.grad((masked_softmax(s, None) * g).sum(), s)
    assert_close(grad, soft)
    theirs = sparse_topk_attn(s, 3, straight_through=True)
    assert_close(w, theirs)
    assert_close(grad, torch.autograd.grad((theirs * g).sum(), s)[0])


def test_topk_straight_through_stack_keeps_the_forward_changes_the_gradient():
    x = stream()
    st, hard = built(attn_sparse_topk=2, attn_sparse_topk_straight_through=True), built(attn_sparse_topk=2)
    assert_close(st(x), hard(x))
    st(x).square().sum().backward()
    hard(x).square().sum().backward()
    q_st, q_hard = st.blocks[0].branch.project, hard.blocks[0].branch.project
    assert not torch.allclose(next(q_st.parameters()).grad, next(q_hard.parameters()).grad)
    with pytest.raises(ValueError, match="attn_sparse_topk_straight_through=True needs attn_sparse_topk"):
        Decoder(**SMALL, attn_sparse_topk_straight_through=True)


@pytest.mark.parametrize("kw, message", [(dict(attn_head_scale=1), "attn_head_scale must be True or False"),
                                         (dict(scale_residual="yes"), "scale_residual"),
                                         (dict(scale_residual_constant=-1.0), "scale_residual_constant must be"),
                                         (dict(attn_head_scale=True, attn_fnet=True), "attn_head_scale")])
def test_bad_values_are_named(kw, message):
    with pytest.raises((TypeError, ValueError), match=message):
        Encoder(**SMALL, **kw)


# --- the z-loss under x-transformers' wrapper spellings ------------------------------------------------------------

def lm(seed: int = 0, **kw) -> TransformerWrapper:
    torch.manual_seed(seed)
    return TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=Decoder(**{**SMALL, **kw})).eval()


def test_return_attn_z_loss_equals_the_layer_keyword():
    """The per-forward request gives what attn_z_loss_weight on the blocks reports (same weights, same weight),
    with sinks and soft-capping in the scores; the output and the fused path stay as they were."""
    extra = dict(attn_softclamp_logits=True, attn_logit_softclamp_value=2.0, attn_head_learned_sink=True)
    plain, layered = lm(**extra), lm(attn_z_loss_weight=1e-2, **extra)
    x = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    out, record = plain(x, mask=mask, return_attn_z_loss=True, attn_z_loss_weight=1e-2)
    _, own = layered(x, mask=mask, return_intermediates=True)
    assert_close(record.attn_z_loss, own.losses.total())
    assert_close(out, plain(x, mask=mask))
    fast = lm()
    out, record = fast(x, return_attn_z_loss=True)
    assert record.losses.weights["attn_z_loss"] == 1e-4 and record.attn_z_loss > 0
    assert all(b.branch.kernel.can_fuse for b in fast.attn_layers.blocks if b.kind == "a")


def test_add_attn_z_loss_adds_the_weighted_loss():
    model = lm(1)
    model.attn_z_loss_weight = None
    x = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(1))
    with_z = AutoregressiveWrapper(TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=model.attn_layers,
                                                      attn_z_loss_weight=0.5), add_attn_z_loss=True)
    with_z.net.load_state_dict(model.state_dict())
    loss = with_z(x)
    ce = AutoregressiveWrapper(model)(x)
    _, record = with_z.net(x[:, :-1], return_attn_z_loss=True)
    assert_close(loss - ce, record.attn_z_loss)
    assert_close(record.attn_z_loss, 0.5 * record.losses.terms["attn_z_loss"])
    project = list(with_z.net.attn_layers.blocks[0].branch.project.parameters())
    grads = torch.autograd.grad(record.attn_z_loss, project, allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)      # it trains the queries and keys


def test_z_loss_refusals():
    with pytest.raises(ValueError, match="attn_z_loss_weight must be a number"):
        TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=Decoder(**SMALL), attn_z_loss_weight=-1)
    with pytest.raises(ValueError, match="add_attn_z_loss\\) needs every attention block's score matrix; "
                                         "attn_linear forms none"):
        AutoregressiveWrapper(lm(attn_linear="elu"), add_attn_z_loss=True)
    with pytest.raises(ValueError, match="add_attn_z_loss cannot combine with exit_layers"):
        AutoregressiveWrapper(lm(exit_layers=True), add_attn_z_loss=True)
    for policy in ("gradient_checkpointing", "reversible"):    # their backward recomputes blocks outside the request
        with pytest.raises(ValueError, match=f"cannot combine with {policy}=True"):
            AutoregressiveWrapper(lm(**{policy: True}), add_attn_z_loss=True)
        AutoregressiveWrapper(lm(attn_z_loss_weight=1e-2, **{policy: True}), add_attn_z_loss=True)   # blocks report
    with pytest.raises(ValueError, match="differs from the attention blocks' own"):
        lm(attn_z_loss_weight=1e-3)(torch.zeros(1, 4, dtype=torch.long), return_attn_z_loss=True,
                                    attn_z_loss_weight=1e-2)
