"""x-transformers 2.x attention-score keywords (polyformer/attention/scoring.py, gates.py): each against
x-transformers' own Attention with the same weights where it has the same formula, else against the explicit
formula; the window attn_max_attend_past is; the z-loss; the named refusals. Causality and cache parity:
tests/options.py (KERNEL_OPTIONS) through tests/contracts and tests/generate/test_decode.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, Decoder, Encoder
from polyformer.attention.normalize import Softmax
from polyformer.attention.score_options import ScoreOptions
from polyformer.attention.scoring import ScoreStage
from polyformer.interfaces import Context
from polyformer.losses import AuxLosses
from tests.helpers import ids, tiny_lm
from tests.options import perturb

xt = pytest.importorskip("x_transformers.x_transformers")

DIM, HEADS, DIM_HEAD, N = 32, 4, 8, 7


def ours(stack=Decoder, seed: int = 0, **keywords):
    """The first self-attention block of a one-layer float64 stack, its parameters moved off their init."""
    torch.manual_seed(seed)
    layers = perturb(stack(dim=DIM, depth=1, heads=HEADS, attn_dim_head=DIM_HEAD, **keywords).double(), seed + 1)
    return next(b.branch for b in layers.blocks if b.kind == "a")


def run(block, x: torch.Tensor, need_weights: bool = False):
    ctx = Context(pos=torch.arange(x.shape[1])[None], causal=block.causal, need_weights=need_weights)
    return block(x, ctx)


def theirs(block, **keywords):
    """x-transformers' Attention with the weights of our block."""
    other = xt.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, causal=block.causal, **keywords).double()
    q, k, v = block.project.to_qkv.weight.split(HEADS * DIM_HEAD)
    output = getattr(block.output, "output", block.output)
    with torch.no_grad():
        other.to_q.weight.copy_(q), other.to_k.weight.copy_(k), other.to_v.weight.copy_(v)
        other.to_out.weight.copy_(output.proj.weight)
    return other


def qk_scores(block, x: torch.Tensor) -> torch.Tensor:
    """(b, h, i, j) q_i . k_j / sqrt(d) of our block, computed here."""
    q, k, _ = (x @ block.project.to_qkv.weight.T).split(HEADS * DIM_HEAD, dim=-1)
    q, k = (t.unflatten(-1, (HEADS, DIM_HEAD)).transpose(1, 2) for t in (q, k))
    return q @ k.transpose(-1, -2) * DIM_HEAD ** -0.5


X_CASES = {
    "qk_norm_groups": (dict(attn_qk_norm=True, attn_qk_norm_groups=2), dict(qk_norm=True, qk_norm_groups=2)),
    "qk_norm_scale": (dict(attn_qk_norm=True, attn_qk_norm_scale=4.0), dict(qk_norm=True, qk_norm_scale=4.0)),
    "qk_norm_dim_scale": (dict(attn_qk_norm=True, attn_qk_norm_dim_scale=True),
                          dict(qk_norm=True, qk_norm_dim_scale=True)),
    "sigmoid": (dict(attn_sigmoid=True), dict(sigmoid=True)),
    "softclamp": (dict(attn_softclamp_logits=True, attn_logit_softclamp_value=0.5),
                  dict(softclamp_logits=True, logit_softclamp_value=0.5)),
    "head_learned_sink": (dict(attn_head_learned_sink=True), dict(head_learned_sink=True)),
    "add_zero_kv": (dict(attn_add_zero_kv=True), dict(add_zero_kv=True)),
    "both_sinks": (dict(attn_add_zero_kv=True, attn_head_learned_sink=True),
                   dict(add_zero_kv=True, head_learned_sink=True)),
    "gate_value_heads": (dict(attn_gate_value_heads=True), dict(gate_value_heads=True)),
    "output_gate": (dict(attn_output_gate=True), dict(output_gate=True)),
    "output_gate_headwise": (dict(attn_output_gate=True, attn_output_gate_headwise=True),
                             dict(output_gate=True, output_gate_headwise=True)),
    # hybrid gated attention: the input and output gates fused into one
    "hyga": (dict(attn_gate_values=True, attn_output_gate=True), dict(gate_values=True, output_gate=True)),
    "gate_values_headwise": (dict(attn_gate_values=True, attn_gate_values_headwise=True),
                             dict(gate_values=True, gate_values_headwise=True)),
    "gate_values_rank": (dict(attn_gate_values=True, attn_gate_values_rank=4),
                         dict(gate_values=True, gate_values_rank=4)),
    "output_gate_rank_linear": (dict(attn_output_gate=True, attn_output_gate_rank=4, attn_low_rank_silu_gates=False),
                                dict(output_gate=True, output_gate_rank=4, low_rank_silu_gates=False)),
    "swiglu_values": (dict(attn_gate_values=True, attn_swiglu_values=True, attn_output_gate=True,
                           attn_output_gate_headwise=True),
                      dict(gate_values=True, swiglu_values=True, output_gate=True, output_gate_headwise=True)),
}


def copy_gate(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """A fused gate's projection into x-transformers' (a bias-less linear, or its LoRALinear down / up)."""
    if isinstance(ours, torch.nn.Linear):
        theirs.weight.copy_(ours.weight)
    else:
        theirs.down.weight.copy_(ours[0].weight), theirs.up.weight.copy_(ours[2].weight)


@pytest.mark.parametrize("stack", [Decoder, Encoder], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", sorted(X_CASES))
def test_equals_x_transformers_attention_with_the_same_weights(case, stack):
    mine, their_keywords = X_CASES[case]
    block = ours(stack, **mine)
    other = theirs(block, **their_keywords)
    with torch.no_grad():
        o = block.kernel.normalize
        if getattr(o, "sink", None) is not None:
            other.attend.head_attn_sink.copy_(o.sink)
        if block.qk_norm is not None and block.qk_norm.q_scale is not None:
            other.qk_norm_q_scale.copy_(block.qk_norm.q_scale), other.qk_norm_k_scale.copy_(block.qk_norm.k_scale)
        if getattr(block.output, "value_heads", None) is not None:
            other.to_v_head_gate.load_state_dict(block.output.value_heads.state_dict())
        if getattr(block.output, "out_gate", None) is not None:
            copy_gate(block.output.out_gate, other.to_output_gate)
        if getattr(block.output, "in_gate", None) is not None:
            copy_gate(block.output.in_gate, other.to_v_gate)
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    assert_close(run(block, x).out, other(x))


def test_qk_norm_is_cosine_similarity_times_the_scale():
    """Scores are scale * cos(q, k): scaling the query and key projections leaves the block unchanged, and the
    weights are the softmax of 10 cos(q_i, k_j) (the default scale)."""
    block = ours(Encoder, attn_qk_norm=True)
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    before = run(block, x, need_weights=True)
    q, k, _ = (x @ block.project.to_qkv.weight.T).split(HEADS * DIM_HEAD, dim=-1)
    q, k = (t.unflatten(-1, (HEADS, DIM_HEAD)).transpose(1, 2) for t in (q, k))
    cos = torch.nn.functional.cosine_similarity(q[:, :, :, None], k[:, :, None], dim=-1)
    assert_close(before.weights, (10 * cos).softmax(-1))
    with torch.no_grad():
        block.project.to_qkv.weight[: 2 * HEADS * DIM_HEAD] *= 7.0
    assert_close(run(block, x).out, before.out)


def test_sigmoid_attention_is_the_explicit_formula_with_its_bias():
    """w_ij = sigmoid(q_i . k_j / sqrt(d) + b) for the keys j <= i, no normalisation (arXiv:2409.04431)."""
    block = ours(Decoder, attn_sigmoid=True, attn_sigmoid_bias=-1.5)
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    w = torch.sigmoid(qk_scores(block, x) - 1.5) * torch.ones(N, N).tril()
    got = run(block, x, need_weights=True).weights
    assert_close(got, w)
    assert (got.sum(-1) - 1).abs().max() > 0.1        # not a softmax


def test_softclamp_bounds_the_logits_and_a_wide_cap_is_plain_softmax():
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    plain = run(ours(Encoder), x, need_weights=True).weights
    assert_close(run(ours(Encoder, attn_softclamp_logits=True, attn_logit_softclamp_value=1e7), x, True).weights, plain)
    w = run(ours(Encoder, attn_softclamp_logits=True, attn_logit_softclamp_value=0.25), x, True).weights
    ratio = (w.amax(-1) / w.amin(-1)).max()           # scores in (-c, c): in a row, weights within e^(2c)
    assert 1.05 < ratio < torch.tensor(0.5).exp()


def test_sinks_take_weight_and_give_nothing():
    """w_ij = e^s_ij / (e^sink_h + e^0 + sum_j' e^s_ij'): a learned sink per head and a zero key / value pair."""
    block = ours(Decoder, attn_head_learned_sink=True, attn_add_zero_kv=True)
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    e = qk_scores(block, x).exp() * torch.ones(N, N).tril()
    sink = block.kernel.normalize.sink.detach()
    expected = e / (e.sum(-1, keepdim=True) + sink.exp()[:, None, None] + 1)
    assert_close(run(block, x, need_weights=True).weights, expected)


def test_pre_and_post_talking_heads_are_the_halves_of_attn_talking_heads():
    """attn_pre_talking_heads alone == attn_talking_heads with the post-softmax mix the identity (and vice versa)."""
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    both = ours(Decoder, attn_talking_heads=True)
    for side in ("pre", "post"):
        one = ours(Decoder, **{f"attn_{side}_talking_heads": True})
        mix = getattr(one.kernel.normalize, f"{side}_mix")
        other = "post" if side == "pre" else "pre"
        with torch.no_grad():
            one.project.to_qkv.weight.copy_(both.project.to_qkv.weight)
            one.output.proj.weight.copy_(both.output.proj.weight)
            mix.weight.copy_(getattr(both.kernel, f"{side}_mix").weight)
            getattr(both.kernel, f"{other}_mix").weight.copy_(torch.eye(HEADS))
        assert_close(run(one, x).out, run(both, x).out)


def test_max_attend_past_is_the_causal_window_of_m_plus_one_keys():
    m = 3
    model = tiny_lm(Decoder, depth=1, attn_max_attend_past=m)
    window = tiny_lm(Decoder, depth=1, attn_window=m + 1)
    assert model.attn_layers.cfg.attention.pattern == window.attn_layers.cfg.attention.pattern
    x = ids(n=10)
    i = 8
    far, near = x.clone(), x.clone()
    far[:, i - m - 1] = (far[:, i - m - 1] + 1) % 64          # just out of reach of query i
    near[:, i - m] = (near[:, i - m] + 1) % 64                # the farthest key it sees
    assert_close(model(far)[:, i], model(x)[:, i])
    assert not torch.allclose(model(near)[:, i], model(x)[:, i])


def test_z_loss_is_the_squared_log_normaliser_of_the_kept_scores():
    """mean over (batch, query) of sum over heads of (log sum_{j kept} e^s_ij)^2; a row keeping nothing adds 0."""
    stage = ScoreStage(ScoreOptions(z_loss_weight=0.5), 3, Softmax())
    stage.losses = losses = AuxLosses()
    scores = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    mask = torch.ones(2, 1, 5, 6, dtype=torch.bool).tril(1)
    mask[1, :, 2] = False
    stage(scores, mask)
    total = 0.0
    for b in range(2):
        for i in range(5):
            for h in range(3):
                kept = scores[b, h, i][mask[b, 0, i]]
                total += float(kept.logsumexp(0)) ** 2 if kept.numel() else 0.0
    assert losses.weights["attn_z_loss"] == 0.5
    assert_close(losses.terms["attn_z_loss"].double(), torch.tensor(total / 10, dtype=torch.float64))


def test_z_loss_reaches_the_training_loss_with_its_weight():
    x = ids(n=9)
    model = tiny_lm(Decoder, depth=2, seed=0, attn_z_loss_weight=0.5)
    plain = tiny_lm(Decoder, depth=2, seed=0)
    plain.load_state_dict(model.state_dict())
    _, record = model(x[:, :-1], return_intermediates=True)
    assert set(record.losses.terms) == {"attn_z_loss"} and record.losses.terms["attn_z_loss"] > 0
    assert_close(AutoregressiveWrapper(model)(x) - AutoregressiveWrapper(plain)(x),
                 0.5 * record.losses.terms["attn_z_loss"])


@pytest.mark.parametrize("keywords, match", [
    (dict(attn_qk_norm=True, attn_qk_norm_groups=3), "attn_qk_norm_groups must divide"),
    (dict(attn_qk_norm_scale=4.0), "attn_qk_norm_scale need"),
    (dict(attn_qk_norm="yes"), "attn_qk_norm"),
    (dict(attn_softclamp_logits=True, attn_logit_softclamp_value=-1.0), "attn_logit_softclamp_value must be"),
    (dict(attn_sigmoid=True, attn_sparse_topk=2), "attn_sigmoid and attn_sparse_topk conflict"),
    (dict(attn_sigmoid=True, attn_head_learned_sink=True), "would do nothing"),
    (dict(attn_talking_heads=True, attn_pre_talking_heads=True), "give one spelling"),
    (dict(attn_performer=True, attn_qk_norm=True), "act\\(s\\) on dense attention"),
    (dict(attn_flash=True, attn_softclamp_logits=True), "attn_flash=True"),
    (dict(attn_gate_values_rank=4), "need attn_gate_values=True"),
    (dict(attn_output_gate_rank=4), "need\\(s\\) attn_output_gate=True"),
    (dict(attn_swiglu_values=True), "attn_swiglu_values sets the fused gate's activation"),
    (dict(attn_gate_values=True, attn_gate_values_rank=4, attn_gate_values_headwise=True), "choose one"),
    (dict(attn_output_gate=True, attn_output_gate_rank=DIM), "attn_output_gate_rank must be below"),
    (dict(attn_output_gate=True, attn_output_gate_rank=0), "attn_output_gate_rank must be an integer"),
    (dict(attn_output_gate=True, attn_low_rank_silu_gates=False), "attn_low_rank_silu_gates=False"),
    (dict(attn_max_attend_past=-1), "attn_max_attend_past"),
    (dict(attn_max_attend_past=3, attn_window=2), "conflict"),
    (dict(attn_z_loss_weight=-1.0), "attn_z_loss_weight must be"),
])
def test_bad_values_are_refused_by_name(keywords, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Decoder(dim=DIM, depth=1, heads=HEADS, attn_dim_head=DIM_HEAD, **keywords)


def test_max_attend_past_is_refused_on_an_encoder():
    with pytest.raises(ValueError, match="attn_max_attend_past .* needs a causal stack"):
        Encoder(dim=DIM, depth=1, attn_max_attend_past=3)
