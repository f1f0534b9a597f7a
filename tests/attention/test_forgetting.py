"""Forgetting Transformer, attn_data_dependent_alibi (polyformer/attention/forgetting.py): the bias is the sum of
log forget gates (explicit float64 formula), our block equals x-transformers' Attention with the same weights (causal,
bidirectional, per row), gates that never forget leave plain attention, gates that forget all leave each token
alone, the decode state keeps the gate terms through rollback, reorder and a prompt cache, XL memories continue a
segment, and the named refusals. Causality and cached == uncached for every decoder option: tests/options.py through
tests/contracts and tests/generate/test_decode.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder, Encoder, load_prompt_cache, next_token_logits, save_prompt_cache
from polyformer.interfaces import Context
from tests.helpers import ids, tiny_lm
from tests.options import perturb

xt = pytest.importorskip("x_transformers.x_transformers")

DIM, HEADS, DIM_HEAD, N = 32, 4, 8, 7
ON = dict(attn_data_dependent_alibi=True)
PER_ROW = dict(ON, attn_data_dependent_alibi_per_row=True, attn_data_dependent_alibi_per_row_dim_head=4)


def block_of(stack=Decoder, seed: int = 0, **keywords):
    """The self-attention block of a one-layer float64 stack, its parameters moved off their init."""
    torch.manual_seed(seed)
    layers = perturb(stack(dim=DIM, depth=1, heads=HEADS, attn_dim_head=DIM_HEAD, **keywords).double(), seed + 1)
    return next(b.branch for b in layers.blocks if b.kind == "a")


def run(block, x: torch.Tensor, mask: torch.Tensor | None = None, need_weights: bool = False):
    ctx = Context(pos=torch.arange(x.shape[1])[None], mask=mask, causal=block.causal, need_weights=need_weights)
    return block(x, ctx)


def explicit_bias(block, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """bias_ij = s Σ_{t=j+1..i} log σ(w_h · x_t + b_h) for j <= i (0 above), padding forgetting nothing."""
    gates = block.forget.to_gates
    log_f = F.logsigmoid(x @ gates.weight.T + gates.bias) * block.forget.scale       # (b, n, h)
    if mask is not None:
        log_f = log_f * mask[..., None]
    b, n, h = log_f.shape
    bias = torch.zeros(b, h, n, n, dtype=x.dtype)
    for i in range(n):
        for j in range(i):
            bias[:, :, i, j] = log_f[:, j + 1:i + 1].sum(1)
    return bias


def qk_scores(block, x: torch.Tensor) -> torch.Tensor:
    q, k, _ = (x @ block.project.to_qkv.weight.T).split(HEADS * DIM_HEAD, dim=-1)
    q, k = (t.unflatten(-1, (HEADS, DIM_HEAD)).transpose(1, 2) for t in (q, k))
    return q @ k.transpose(-1, -2) * DIM_HEAD ** -0.5


def test_weights_are_the_softmax_of_scores_plus_the_summed_log_gates():
    block = block_of(**ON, attn_data_dependent_alibi_kwargs=dict(bias_init=1.0, post_log_scale=0.5))
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1, 2] = False                                       # a padded token inside row 1: it forgets nothing
    bias = explicit_bias(block, x, mask)
    assert bias[:, :, -1, 0].abs().min() > 0.5               # the gates forget: the test can see them
    keep = torch.ones(N, N, dtype=torch.bool).tril() & mask[:, None, None, :]
    expected = (qk_scores(block, x) + bias).masked_fill(~keep, float("-inf")).softmax(-1)
    assert_close(run(block, x, mask, need_weights=True).weights, expected)


def copy_gates(block, other) -> None:
    module = other.data_dependent_alibi.to_forget_gates[0]
    with torch.no_grad():
        module.weight.copy_(block.forget.to_gates.weight)
        if module.bias is not None:
            module.bias.copy_(block.forget.to_gates.bias)


@pytest.mark.parametrize("stack, mine, their_keywords", [
    (Decoder, dict(ON, attn_data_dependent_alibi_kwargs=dict(bias_init=2.0, post_log_scale=0.5)),
     dict(data_dependent_alibi=True, data_dependent_alibi_kwargs=dict(bias_init=2.0, post_log_scale=0.5))),
    (Encoder, ON, dict(data_dependent_alibi=True)),
    (Decoder, dict(PER_ROW, attn_data_dependent_alibi_kwargs=dict(post_log_scale=2.0)),
     dict(data_dependent_alibi=True, data_dependent_alibi_per_row=True, data_dependent_alibi_per_row_dim_head=4,
          data_dependent_alibi_kwargs=dict(post_log_scale=2.0))),
], ids=["causal", "bidirectional", "per_row"])
def test_equals_x_transformers_attention_with_the_same_weights(stack, mine, their_keywords):
    block = block_of(stack, **mine)
    other = xt.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, causal=block.causal, **their_keywords).double()
    q, k, v = block.project.to_qkv.weight.split(HEADS * DIM_HEAD)
    with torch.no_grad():
        other.to_q.weight.copy_(q), other.to_k.weight.copy_(k), other.to_v.weight.copy_(v)
        other.to_out.weight.copy_(block.output.proj.weight)
    copy_gates(block, other)
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    assert_close(run(block, x).out, other(x))
    assert_close(block.forget.bias(block.forget.key_terms(x), x, None), other.data_dependent_alibi(x))


def test_gates_that_never_forget_leave_plain_attention():
    """f_t = 1 (w = 0, b = 50): every bias is 0 and the model is the one without the keyword, same weights."""
    torch.manual_seed(0)
    forgetful = tiny_lm(**ON, attn_data_dependent_alibi_kwargs=dict(bias_init=50.0), rotary_pos_emb=True)
    plain = tiny_lm(rotary_pos_emb=True)
    plain.load_state_dict({k: v for k, v in forgetful.state_dict().items() if ".forget." not in k})
    for block in forgetful.attn_layers.blocks:
        if block.kind == "a":
            torch.nn.init.zeros_(block.branch.forget.to_gates.weight)
    x = ids(2, 12)
    assert_close(forgetful(x), plain(x))


def test_gates_that_forget_everything_leave_each_token_alone():
    """f_t = σ(-50): a query's weight on any earlier key is e^-50 of its own, so with no position embedding
    each output is that of its token alone."""
    model = tiny_lm(**ON, attn_data_dependent_alibi_kwargs=dict(bias_init=-50.0), use_abs_pos_emb=False, seed=0)
    for block in model.attn_layers.blocks:
        if block.kind == "a":
            torch.nn.init.zeros_(block.branch.forget.to_gates.weight)
    x = ids(2, 9)
    alone = torch.cat([model(x[:, t:t + 1]) for t in range(9)], dim=1)
    assert_close(model(x), alone)
    assert not torch.allclose(tiny_lm(use_abs_pos_emb=False, seed=0)(x)[:, 1:], alone[:, 1:])


DECODE = {"gated": dict(ON, attn_data_dependent_alibi_kwargs=dict(bias_init=1.0), attn_kv_heads=2,
                        rotary_pos_emb=True),
          "per_row": dict(PER_ROW, attn_kv_heads=2)}


def decoder(name: str):
    torch.manual_seed(0)
    return perturb(tiny_lm(**DECODE[name]), scale=0.05)


@pytest.mark.parametrize("name", DECODE)
def test_rollback_and_reorder_keep_the_gate_terms_with_their_keys(name):
    model, x = decoder(name), ids(2, 12)
    state = model.new_state(2, 15)
    model(x[:, :9], state=state)
    state.rollback(3)                                       # forget positions 6, 7, 8
    y = torch.cat((x[:, :6], x.flip(0)[:, 6:]), dim=1)      # continue with other tokens
    assert_close(model(y[:, 6:], state=state), model(y)[:, 6:], atol=1e-5, rtol=1e-5)
    state.reorder(torch.tensor([1, 0]))
    more = ids(2, 3, seed=3)
    assert_close(model(more, state=state), model(torch.cat((y.flip(0), more), dim=1))[:, 12:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", DECODE)
def test_a_prompt_cache_continues_like_the_uncached_forward(name, tmp_path):
    model, x = decoder(name), ids(1, 10)
    state = model.new_state(1, 6)
    model(x[:, :6], state=state)
    save_prompt_cache(tmp_path / "prompt.safetensors", model, state, x[:, :6])
    loaded, prompt = load_prompt_cache(tmp_path / "prompt.safetensors", model, max_len=10)
    full = model(x)
    assert_close(next_token_logits(model, loaded, prompt), full[:, 5], atol=1e-5, rtol=1e-5)
    assert_close(model(x[:, 6:], state=loaded), full[:, 6:], atol=1e-5, rtol=1e-5)


def test_xl_memories_continue_the_gates_across_segments():
    """The gates of the memory tokens join the sums: segment 2 with segment 1's memories equals the causal
    forward over both."""
    torch.manual_seed(0)
    model = perturb(tiny_lm(**DECODE["gated"], max_mem_len=6), scale=0.05)
    x = ids(2, 12)
    _, mems = model(x[:, :6], return_mems=True)
    assert_close(model(x[:, 6:], mems=mems), model(x)[:, 6:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keywords, message", [
    (dict(PER_ROW, stack=Encoder), "attn_data_dependent_alibi_per_row .*causal"),
    (dict(ON, alibi_pos_emb=True), "attn_data_dependent_alibi and alibi_pos_emb conflict"),
    (dict(ON, rel_pos_bias=True), "attn_data_dependent_alibi and rel_pos_bias conflict"),
    (dict(ON, attn_window=4), "attn_data_dependent_alibi cannot combine with attn_window"),
    (dict(ON, attn_max_attend_past=3), "attn_data_dependent_alibi cannot combine with attn_window"),
    (dict(ON, attn_performer=True), "attn_data_dependent_alibi adds terms to the dense scores; attn_performer"),
    (dict(ON, attn_fnet=True, stack=Encoder), "attn_fnet replaces attention"),
    (dict(ON, exit_layers=True), "exit_layers"),
    (dict(PER_ROW, attn_data_dependent_alibi_per_row_dim_head=0), "per_row_dim_head must be an integer >= 1"),
    (dict(ON, attn_data_dependent_alibi_per_row_dim_head=4), "per_row_dim_head is set but .*per_row is not True"),
    (dict(PER_ROW, attn_data_dependent_alibi_kwargs=dict(bias_init=1.0)), "bias_init has no use"),
    (dict(ON, attn_data_dependent_alibi_kwargs=dict(post_log_scale="big")), "post_log_scale must be a finite"),
    (dict(ON, attn_data_dependent_alibi_per_row="yes"), "per_row must be True or False"),
    (dict(attn_data_dependent_alibi_per_row=True), "need\\(s\\) attn_data_dependent_alibi=True"),
])
def test_bad_options_are_refused_by_name(keywords, message):
    stack = keywords.pop("stack", Decoder)
    with pytest.raises(ValueError, match=message):
        stack(dim=DIM, depth=1, heads=HEADS, **keywords)


def test_unknown_kwargs_are_refused_by_name():
    with pytest.raises(TypeError, match="bias_init.*post_log_scale"):
        Decoder(dim=DIM, depth=1, heads=HEADS, **ON, attn_data_dependent_alibi_kwargs=dict(bias=1.0))


def test_blocks_of_one_decode_state_must_agree_on_the_gates():
    with pytest.raises(ValueError, match="attn_data_dependent_alibi"):
        Decoder(dim=DIM, depth=2, heads=HEADS, attn_per_layer=[ON, PER_ROW])
