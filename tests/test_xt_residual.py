"""x-transformers' residual / norm / feedforward keywords, each by its defining property: hyper-connections
(arXiv:2409.19606), LayerScale (arXiv:2103.17239) and its adaptive form, DyT (arXiv:2503.10622), adaptive
LayerNorm / RMSNorm from a condition (DiT's adaLN), pre_norm_has_final_norm, ff_post_act_ln (NormFormer),
ff_solu (SoLU). Cache parity and causality of the unconditioned ones: tests/options.py (contracts, decode)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder, Encoder
from polyformer.conditioning import AdaptiveLayerNorm, AdaptiveRMSNorm, Conditioning, ConditionOptions
from polyformer.dyt import DynamicTanh
from polyformer.feedforward_norm import NormedFeedForward, SoLU, build
from polyformer.hyper import HyperConnection
from polyformer.hyper_manifold import ManifoldHyperConnection, sinkhorn_knopp
from polyformer.config import FeedForwardConfig
from tests.options import perturb

DIM = 16
SMALL = dict(dim=DIM, depth=2, heads=2, attn_dim_head=8)


def stream(b: int = 2, n: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, n, DIM, generator=torch.Generator().manual_seed(seed))


# --- hyper-connections -----------------------------------------------------------------------------

def test_hyper_connection_is_the_papers_formula():
    """H' = B(H)^T y + A_r(H)^T H and h0 = A_m(H)^T H with the tanh-dynamic weights, stream by stream."""
    torch.manual_seed(0)
    n = 3
    hc = perturb(HyperConnection(DIM, n, layer_index=4), scale=0.3).double()
    h = torch.randn(2, 5, n, DIM, dtype=torch.float64)
    y = torch.randn(2, 5, DIM, dtype=torch.float64)
    h_bar = F.layer_norm(h, (DIM,), hc.norm.weight, None, 1e-5)
    a_m = hc.static_m + hc.scale_a * torch.tanh(h_bar @ hc.dynamic_m)[..., 0]           # (b, i, n)
    a_r = hc.static_r + hc.scale_a * torch.tanh(h_bar @ hc.dynamic_r)                   # (b, i, n, n)
    beta = hc.static_b + hc.scale_b * torch.tanh(h_bar @ hc.dynamic_b)[..., 0]          # (b, i, n)
    h0 = sum(a_m[..., s, None] * h[:, :, s] for s in range(n))
    new = torch.stack([beta[..., t, None] * y + sum(a_r[..., s, t, None] * h[:, :, s] for s in range(n))
                       for t in range(n)], dim=2)
    assert_close(hc.read(h), h0)
    assert_close(hc(h, y), new)


def test_hyper_connection_starts_as_the_layer_of_its_index():
    """Static init: A_m = e_{k mod n}, so the first read picks stream k mod n."""
    hc = HyperConnection(DIM, 4, layer_index=6)
    h = torch.randn(1, 3, 4, DIM)
    assert_close(hc.read(h), h[:, :, 2])


def test_hyper_connections_start_as_the_residual_stream():
    """At initialisation every stream is the plain residual stream; the summed streams (n h) meet the scale-
    invariant final LayerNorm, so the stack's output is the plain pre-norm stack's with the same blocks."""
    torch.manual_seed(0)
    plain = perturb(Decoder(**SMALL, rotary_pos_emb=True))
    hyper = Decoder(**SMALL, rotary_pos_emb=True, num_residual_streams=4)
    moved = {k.replace(".norm_in.", ".norm_in.norm."): v for k, v in plain.state_dict().items()}
    missing, unexpected = hyper.load_state_dict(moved, strict=False)     # the pre-norm follows the stream read
    assert not unexpected and all(".combine." in k for k in missing)
    x = stream()
    assert_close(hyper(x), plain(x), atol=1e-4, rtol=1e-4)
    perturb(hyper, seed=3)      # the learned connections move the streams apart
    assert not torch.allclose(hyper(x), plain(x), atol=1e-3)


def test_hyper_connections_refuse_what_they_replace():
    with pytest.raises(ValueError, match="num_residual_streams must be an integer >= 1"):
        Decoder(**SMALL, num_residual_streams=0)
    with pytest.raises(ValueError, match="gate_residual=True is another residual"):
        Decoder(**SMALL, num_residual_streams=2, gate_residual=True)
    with pytest.raises(ValueError, match="pre_norm=False"):
        Encoder(**SMALL, num_residual_streams=2, pre_norm=False)
    with pytest.raises(ValueError, match="universal=True"):
        Decoder(**SMALL, num_residual_streams=2, universal=True)


# --- manifold-constrained hyper-connections --------------------------------------------------------

def test_manifold_hyper_connection_is_the_papers_formula():
    """mHC (arXiv:2512.24880): H_pre = sigmoid, H_post = 2 sigmoid, H_res = Sinkhorn-Knopp of the dynamic
    logits from the RMS-normalised flattened streams, written out here stream by stream."""
    torch.manual_seed(0)
    n, t = 3, 7
    mhc = perturb(ManifoldHyperConnection(DIM, n, iters=t), scale=0.3).double()
    h = torch.randn(2, 5, n, DIM, dtype=torch.float64)
    y = torch.randn(2, 5, DIM, dtype=torch.float64)
    flat = h.flatten(-2)
    x = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-5) * mhc.norm.weight
    z = x @ mhc.dynamic
    a = mhc.scale
    pre = torch.sigmoid(a[0] * z[..., :n] + mhc.bias_pre)
    post = 2 * torch.sigmoid(a[1] * z[..., n:2 * n] + mhc.bias_post)
    m = torch.exp(a[2] * z[..., 2 * n:].unflatten(-1, (n, n)) + mhc.bias_res)
    for _ in range(t):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    h0 = sum(pre[..., s, None] * h[:, :, s] for s in range(n))
    new = torch.stack([post[..., s, None] * y + sum(m[..., s, u, None] * h[:, :, u] for u in range(n))
                       for s in range(n)], dim=2)
    assert_close(mhc.read(h), h0)
    assert_close(mhc(h, y), new)


def test_manifold_mixing_is_doubly_stochastic_and_carries_the_streams_sum():
    """H_res >= 0 with columns summing to 1 exactly, so the carried streams sum to the input streams' sum
    whatever the learned logits (even logits in the hundreds: the projection runs in log space); rows sum to 1
    within Sinkhorn's error after 20 iterations for logits of a few units (far larger ones converge slowly, as
    the mHC-lite paper, arXiv:2601.05732, measures); the gates stay in (0, 1) and (0, 2). Plain
    hyper-connections' A_r carries no such bound."""
    torch.manual_seed(0)
    h = torch.randn(2, 5, 4, DIM, dtype=torch.float64) * 3
    for scale in (0.3, 2.0):
        mhc = perturb(ManifoldHyperConnection(DIM, 4, iters=20), scale=scale).double()
        pre, post, res = mhc.logits(h)
        mix = sinkhorn_knopp(res, 20)
        assert (mix >= 0).all() and mix.isfinite().all()
        assert_close(mix.sum(-2), torch.ones(2, 5, 4, dtype=torch.float64))
        assert_close(mhc(h, torch.zeros(2, 5, DIM, dtype=torch.float64)).sum(2), h.sum(2))
        if scale < 1:
            assert res.abs().max() < 10
            assert (torch.sigmoid(pre) < 1).all() and (2 * torch.sigmoid(post) < 2).all()
            assert_close(mix.sum(-1), torch.ones(2, 5, 4, dtype=torch.float64), atol=1e-3, rtol=0)


def test_manifold_hyper_connections_start_as_the_residual_stream():
    """At initialisation (W = 0, b = 0) each stream is x + F(norm(x)): the stack equals the plain pre-norm stack
    with the same blocks; learned connections move it away."""
    torch.manual_seed(0)
    plain = perturb(Decoder(**SMALL, rotary_pos_emb=True))
    mhc = Decoder(**SMALL, rotary_pos_emb=True, num_residual_streams=4, hyper_conn_sinkhorn_iters=5)
    moved = {k.replace(".norm_in.", ".norm_in.norm."): v for k, v in plain.state_dict().items()}
    missing, unexpected = mhc.load_state_dict(moved, strict=False)
    assert not unexpected and all(".combine." in k for k in missing)
    assert all(isinstance(b.combine, ManifoldHyperConnection) for b in mhc.blocks)
    x = stream()
    assert_close(mhc(x), plain(x), atol=1e-4, rtol=1e-4)
    perturb(mhc, seed=3)
    assert not torch.allclose(mhc(x), plain(x), atol=1e-3)


def test_manifold_hyper_connections_are_refused_by_name():
    with pytest.raises(ValueError, match="hyper_conn_sinkhorn_iters .* needs num_residual_streams > 1"):
        Decoder(**SMALL, hyper_conn_sinkhorn_iters=5)
    with pytest.raises(ValueError, match="hyper_conn_sinkhorn_iters must be an integer >= 1"):
        Decoder(**SMALL, num_residual_streams=2, hyper_conn_sinkhorn_iters=0)


# --- LayerScale ------------------------------------------------------------------------------------

def scale_branch_outputs(stack: torch.nn.Module, gammas: list[torch.Tensor]) -> None:
    """diag(gamma) folded into each block's output projection (its rows and bias)."""
    with torch.no_grad():
        for block, gamma in zip(stack.blocks, gammas):
            out = block.branch.output.proj if block.kind == "a" else block.branch.proj_out
            out.weight.mul_(gamma[:, None])
            if out.bias is not None:
                out.bias.mul_(gamma)


@pytest.mark.parametrize("causal", [True, False])
def test_layerscale_is_a_per_feature_scale_of_each_branch(causal):
    """x + diag(lambda) f(x) (CaiT eq. 2): the same as the plain stack with diag(lambda) folded into every
    branch's output projection."""
    torch.manual_seed(0)
    stack = Decoder if causal else Encoder
    scaled = perturb(stack(**SMALL, use_layerscale=True, layerscale_init_value=0.1), scale=0.2)
    plain = stack(**SMALL)
    plain.load_state_dict({k.replace(".combine.inner", ".combine"): v for k, v in scaled.state_dict().items()
                           if not k.endswith("combine.gamma")})
    scale_branch_outputs(plain, [b.combine.gamma.detach() for b in scaled.blocks])
    x = stream()
    assert_close(scaled(x), plain(x))


def test_layerscale_zero_init_makes_each_block_the_identity():
    """x-transformers' default layerscale_init_value=0: every block starts as the identity."""
    torch.manual_seed(0)
    stack = Decoder(**SMALL, use_layerscale=True, pre_norm_has_final_norm=False)
    x = stream()
    assert_close(stack(x), x)


def test_adaptive_layerscale_gates_each_branch_by_the_condition():
    """x + sigmoid(W c + b) * f(x): at init W = 0, b = -2, a constant gate sigmoid(-2); then per condition."""
    torch.manual_seed(0)
    gated = Decoder(**SMALL, use_adaptive_layerscale=True, dim_condition=5)
    plain = Decoder(**SMALL)
    plain.load_state_dict({k.replace(".combine.inner", ".combine"): v for k, v in gated.state_dict().items()
                           if ".to_gate." not in k})
    scale_branch_outputs(plain, [torch.full((DIM,), 1 / (1 + math.exp(2.0)))] * len(plain.blocks))
    x, c = stream(), torch.randn(2, 5)
    assert_close(gated(x, condition=c), plain(x))
    perturb(gated, seed=2)
    block = gated.blocks[0]
    y = torch.randn(2, 6, DIM)
    want = x + torch.sigmoid(block.combine.to_gate(c))[:, None] * y
    gated.conditioning.set(c)
    assert_close(block.combine(x, y), want)


def test_layerscale_keywords_are_checked():
    with pytest.raises(ValueError, match="layerscale_init_value need.*use_layerscale"):
        Decoder(**SMALL, layerscale_init_value=0.1)
    with pytest.raises(ValueError, match="'use_layerscale' and 'use_adaptive_layerscale' conflict"):
        Decoder(**SMALL, use_layerscale=True, use_adaptive_layerscale=True)
    with pytest.raises(ValueError, match="layerscale_init_value sets use_layerscale"):
        Decoder(**SMALL, use_adaptive_layerscale=True, layerscale_init_value=0.1)


# --- DyT -------------------------------------------------------------------------------------------

def test_dynamic_tanh_is_gamma_tanh_alpha_x_plus_beta():
    torch.manual_seed(0)
    stack = Decoder(**SMALL, use_dynamic_tanh=True, dynamic_tanh_init_alpha=0.5)
    norms = [m for m in stack.modules() if isinstance(m, DynamicTanh)]
    assert len(norms) == 5 and all(m.alpha.item() == 0.5 for m in norms)     # 4 blocks' and the final one
    m = perturb(norms[0]).double()
    x = 3 * torch.randn(4, DIM, dtype=torch.float64)
    assert_close(m(x), m.weight * torch.tanh(m.alpha * x) + m.bias)


def test_dynamic_tanh_matches_x_transformers_module():
    from x_transformers.x_transformers import DynamicTanh as Theirs

    torch.manual_seed(0)
    ours, theirs = perturb(DynamicTanh(DIM, alpha=0.7)), Theirs(DIM, init_alpha=0.7)
    with torch.no_grad():
        theirs.pre_tanh_scale.copy_(ours.alpha)
        theirs.gamma.copy_(ours.weight)
        theirs.beta.copy_(ours.bias)
    x = 2 * torch.randn(3, 5, DIM)
    assert_close(ours(x), theirs(x))


def test_dynamic_tanh_keywords_are_checked():
    with pytest.raises(ValueError, match="dynamic_tanh_init_alpha is set but use_dynamic_tanh"):
        Decoder(**SMALL, dynamic_tanh_init_alpha=0.5)
    with pytest.raises(ValueError, match="'use_rmsnorm' and 'use_dynamic_tanh' conflict"):
        Decoder(**SMALL, use_rmsnorm=True, use_dynamic_tanh=True)
    with pytest.raises(ValueError, match="dynamic_tanh_init_alpha must be a number > 0"):
        Decoder(**SMALL, use_dynamic_tanh=True, dynamic_tanh_init_alpha=0)


# --- adaptive norms --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_adaptive_norm_is_the_norm_times_one_plus_w_c(kind):
    """norm(x) * (1 + W c), W zero at start (so the norm begins as the plain one), against the float64 formula
    and x-transformers' module with the same W."""
    from x_transformers.x_transformers import AdaptiveLayerNorm as TheirsLN, AdaptiveRMSNorm as TheirsRMS

    torch.manual_seed(0)
    norm = (AdaptiveLayerNorm if kind == "layer" else AdaptiveRMSNorm)(DIM)
    source = Conditioning(5, ConditionOptions(dim=5))
    norm.bind(source)
    x, c = torch.randn(2, 6, DIM, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    source.set(c)
    norm.double()
    if kind == "layer":
        plain = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    else:
        plain = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert_close(norm(x), plain)
    perturb(norm, scale=0.3)
    assert_close(norm(x), plain * (1 + c[:, None] @ norm.to_gamma.weight.T))
    theirs = (TheirsLN if kind == "layer" else TheirsRMS)(DIM, dim_condition=5).double()
    with torch.no_grad():
        theirs.to_gamma.weight.copy_(norm.to_gamma.weight)
    assert_close(norm(x), theirs(x, condition=c), atol=1e-4, rtol=1e-4)     # theirs: rms without epsilon


def test_condition_mlp_widens_the_condition():
    torch.manual_seed(0)
    stack = Decoder(**SMALL, use_adaptive_rmsnorm=True, dim_condition=5, adaptive_condition_mlp=True,
                    adaptive_condition_mlp_expansion=2)
    c = torch.randn(2, 5)
    stack(stream(), condition=c)
    assert stack.conditioning.value is None             # let go after the forward
    stack.conditioning.set(c)
    lin = stack.conditioning.mlp[0]
    assert_close(stack.conditioning.value, F.silu(c @ lin.weight.T)[:, None])
    assert stack.blocks[0].norm_in.to_gamma.in_features == 10


def conditioned(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return perturb(Decoder(**SMALL, use_adaptive_layernorm=True, use_adaptive_layerscale=True, dim_condition=5,
                           rotary_pos_emb=True, shift_tokens=1)).eval()


def test_condition_per_position_and_per_row_agree_and_stay_causal():
    stack, x = conditioned(), stream()
    c = torch.randn(2, 5)
    assert_close(stack(x, condition=c), stack(x, condition=c[:, None].expand(2, 6, 5)))
    per_pos = torch.randn(2, 6, 5)
    out = stack(x, condition=per_pos)
    later = per_pos.clone()
    later[:, 4:] += 1.0
    changed = stack(x, condition=later)
    assert_close(changed[:, :4], out[:, :4])
    assert not torch.allclose(changed[:, 4:], out[:, 4:])


def test_conditioned_decoder_caches_exactly():
    """Cached steps with each step's condition == the uncached forward."""
    stack, x = conditioned(1), stream(n=7)
    cond = torch.randn(2, 7, 5)
    full = stack(x, condition=cond)
    state = stack.new_state(batch=2, max_len=8)
    steps = [stack(x[:, :3], condition=cond[:, :3], state=state)]
    for t in range(3, 7):
        steps.append(stack(x[:, t:t + 1], condition=cond[:, t:t + 1], state=state))
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_condition_is_checked():
    stack = conditioned()
    with pytest.raises(ValueError, match="condition is required"):
        stack(stream())
    with pytest.raises(ValueError, match=r"condition must be a float tensor \(batch=2, dim_condition=5\)"):
        stack(stream(), condition=torch.randn(2, 4))
    with pytest.raises(ValueError, match="condition was given, but this stack reads none"):
        Decoder(**SMALL)(stream(), condition=torch.randn(2, 5))
    with pytest.raises(ValueError, match="dim_condition need.*use_adaptive"):
        Decoder(**SMALL, dim_condition=5)
    with pytest.raises(ValueError, match="'use_adaptive_layernorm' and 'use_rmsnorm' conflict"):
        Decoder(**SMALL, use_adaptive_layernorm=True, use_rmsnorm=True)
    with pytest.raises(ValueError, match="gradient_checkpointing=True"):
        Decoder(**SMALL, use_adaptive_rmsnorm=True, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="act=True runs the rows still pondering on their own"):
        Decoder(**SMALL, use_adaptive_rmsnorm=True, dim_condition=5, universal=True, act=True)
    hourglass = Decoder(**SMALL, use_adaptive_rmsnorm=True, dim_condition=5, hourglass=(2,))
    hourglass(stream(), condition=torch.randn(2, 5))            # one condition per row: every resolution reads it
    with pytest.raises(ValueError, match="condition per position cannot follow hourglass"):
        hourglass(stream(), condition=torch.randn(2, 6, 5))


# --- final norm, feedforward norms ---------------------------------------------------------------------

def test_pre_norm_has_final_norm_false_returns_the_stream():
    torch.manual_seed(0)
    with_final = perturb(Decoder(**SMALL))
    without = Decoder(**SMALL, pre_norm_has_final_norm=False)
    without.load_state_dict({k: v for k, v in with_final.state_dict().items() if not k.startswith("final_norm")})
    x = stream()
    _, record = with_final(x, return_intermediates=True)
    assert without.final_norm is None
    assert_close(without(x), record.hiddens[-1])
    with pytest.raises(ValueError, match="pre_norm_has_final_norm=False: a post-norm stack"):
        Decoder(**SMALL, pre_norm=False, pre_norm_has_final_norm=False)


@pytest.mark.parametrize("glu", [False, True])
def test_post_act_ln_normalises_the_hidden_after_the_gate(glu):
    """W2 LN(act(W1 x)) (NormFormer's FFN LN; with a GLU after the gate), against x-transformers' FeedForward."""
    from x_transformers.x_transformers import FeedForward as Theirs

    torch.manual_seed(0)
    ours = perturb(build(DIM, FeedForwardConfig(mult=2, glu=glu, post_act_ln=True)), scale=0.3)
    assert isinstance(ours, NormedFeedForward)
    theirs = Theirs(DIM, mult=2, glu=glu, post_act_ln=True)
    names = ["ff.0.proj" if glu else "ff.0.0", "ff.1.gamma", "ff.3"]
    state = {f"{names[0]}.weight": ours.proj_in.weight, f"{names[0]}.bias": ours.proj_in.bias,
             names[1]: ours.post_act.weight, f"{names[2]}.weight": ours.proj_out.weight,
             f"{names[2]}.bias": ours.proj_out.bias}
    theirs.load_state_dict(state)
    x = torch.randn(2, 5, DIM)
    assert_close(ours(x), theirs(x))
    h = ours.proj_in(x)
    if glu:
        h, gate = h.chunk(2, dim=-1)
        h = h * F.gelu(gate)
    else:
        h = F.gelu(h)
    assert_close(ours(x), ours.proj_out(F.layer_norm(h, (2 * DIM,), ours.post_act.weight)))


def test_solu_is_layernorm_of_x_softmax_x():
    from x_transformers.x_transformers import FeedForward as Theirs

    torch.manual_seed(0)
    act = perturb(SoLU(8)).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    assert_close(act(x), F.layer_norm(x * torch.softmax(x, -1), (8,), act.norm.weight))
    ours = perturb(build(DIM, FeedForwardConfig(mult=2, activation="solu")), scale=0.3)
    theirs = Theirs(DIM, mult=2, solu=True)
    theirs.load_state_dict({"ff.0.0.weight": ours.proj_in.weight, "ff.0.0.bias": ours.proj_in.bias,
                            "ff.0.1.norm.gamma": ours.act.norm.weight, "ff.2.weight": ours.proj_out.weight,
                            "ff.2.bias": ours.proj_out.bias})
    x = torch.randn(2, 5, DIM)
    assert_close(ours(x), theirs(x))


def test_feedforward_keywords_are_checked():
    with pytest.raises(ValueError, match="'ff_relu_squared' and 'ff_solu' conflict"):
        Decoder(**SMALL, ff_relu_squared=True, ff_solu=True)
    with pytest.raises(ValueError, match="ff_solu=True is built into the dense feedforward"):
        Decoder(**SMALL, ff_solu=True, ff_moe=True, ff_num_experts=2)
    with pytest.raises(ValueError, match="ff_post_act_ln must be True or False"):
        Decoder(**SMALL, ff_post_act_ln=1)


def test_bfloat16_runs_every_option():
    torch.manual_seed(0)
    for kw in (dict(num_residual_streams=2), dict(use_dynamic_tanh=True), dict(ff_solu=True, ff_post_act_ln=True),
               dict(use_adaptive_rmsnorm=True, dim_condition=5)):
        stack = Decoder(**SMALL, **kw)
        c = torch.randn(2, 5) if "dim_condition" in kw else None
        ref = stack(stream(), condition=c)
        low = stack.to(torch.bfloat16)(stream().bfloat16(), condition=None if c is None else c.bfloat16())
        assert low.dtype == torch.bfloat16
        assert_close(low.float(), ref, atol=0.1, rtol=0.05)


def test_options_round_trip_through_json():
    """The options are plain config data: a stack rebuilt from its JSON has the same parameters and output."""
    from polyformer import config as config_mod
    from polyformer.config import LayersConfig

    torch.manual_seed(0)
    stack = perturb(Decoder(**SMALL, num_residual_streams=2, use_adaptive_rmsnorm=True, use_adaptive_layerscale=True,
                            dim_condition=5, adaptive_condition_mlp=True, pre_norm_has_final_norm=False,
                            ff_post_act_ln=True, ff_solu=True))
    cfg = config_mod.from_dict(LayersConfig, config_mod.to_dict(stack.cfg))
    assert cfg == stack.cfg
    rebuilt = Decoder.from_config(cfg)
    rebuilt.load_state_dict(stack.state_dict())
    x, c = stream(), torch.randn(2, 5)
    assert_close(rebuilt(x, condition=c), stack(x, condition=c))
