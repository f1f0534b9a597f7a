"""Early-exit decoding (polyformer/generate/early_exit.py): with a threshold that never exits the logits and
tokens are the full model's bit for bit (and the uncached forward's); with exits, the skipped layers' decode
state holds the keys / values computed from the exited state (worked out by hand), their attention and
feedforward never run, on the fast step (ExitStep) as on the module path, which agree; a batch row decodes as
it would alone; a step's logits do not move when later tokens change; the mean layers fall below the depth."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper
from polyformer.attention.attention import Attention
from polyformer.feedforward import FeedForward
from polyformer.generate import exit_rows, rows
from polyformer.generate.early_exit import ExitStep, generate
from tests.helpers import ids, tiny_lm

DEPTH = 4


def model(**keywords):
    return tiny_lm(depth=DEPTH, heads=4, seed=0, **{"rotary_pos_emb": True, "exit_layers": True, **keywords})


@pytest.mark.parametrize("keywords", [{}, dict(attn_kv_heads=2, shift_tokens=1), dict(exit_confidence="state_change"),
                                      dict(pre_norm=False, attn_num_mem_kv=2)])
def test_never_exiting_equals_the_full_model_bit_for_bit(keywords):
    net, x = model(**keywords), ids(2, 6)
    exits = net.attn_layers.early_exit
    plain, early = net.new_state(2, 8), net.new_state(2, 8)
    with torch.no_grad():
        net(x[:, :-1], state=plain)
        net(x[:, :-1], state=early)
        want = net(x[:, -1:], state=plain)
        with exits.decoding(net.head, 1.0) as run:
            got = net(x[:, -1:], state=early)
    assert torch.equal(got, want) and torch.equal(early.k, plain.k) and torch.equal(early.v, plain.v)
    assert run.layers.eq(DEPTH).all()
    wrapper = AutoregressiveWrapper(net)
    for temperature in (0.0, 1.0):
        reference = wrapper.generate(x, 10, temperature=temperature, generator=torch.Generator().manual_seed(3))
        out = generate(net, x, 10, threshold=1.0, temperature=temperature, generator=torch.Generator().manual_seed(3))
        assert torch.equal(out.tokens, reference) and out.mean_layers == DEPTH


def reference_keys(net, layer: int, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-attention block `layer`'s key and value of stream h (b, dim) at positions pos (b, 1), by hand:
    LayerNorm, the key / value rows of the fused projection, split heads, rotate the key."""
    block = net.attn_layers.blocks[2 * layer]
    attn = block.branch
    n = block.norm_in
    x = F.layer_norm(h, (h.shape[-1],), n.weight, n.bias, n.eps)
    q_out, k_out, v_out = attn.project.split
    w = attn.project.to_qkv.weight
    k = (x @ w[q_out: q_out + k_out].t()).view(h.shape[0], attn.project.kv_heads, 1, -1)
    v = (x @ w[q_out + k_out:].t()).view(h.shape[0], attn.project.v_heads, 1, -1)
    d = k.shape[-1]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = pos[:, None, :, None].double() * freq                       # (b, 1, 1, d/2)
    k1, k2 = k[..., : d // 2].double(), k[..., d // 2:].double()       # pairs (i, i + d/2)
    k = torch.cat((k1 * angle.cos() - k2 * angle.sin(), k2 * angle.cos() + k1 * angle.sin()), dim=-1)
    return k.float(), v


@pytest.mark.parametrize("fast", [False, True])
def test_skipped_layers_keys_come_from_the_exited_state(fast):
    net, x = model(), ids(2, 7)
    exits, state = net.attn_layers.early_exit, net.new_state(2, 8)
    with torch.no_grad():
        net(x[:, :-1], state=state)
        if fast:
            run = ExitStep(net, exits, 0.0)                # any margin above 0 exits at the first layer
            run(x[:, -1:], state=state)
        else:
            with exits.decoding(net.head, 0.0) as run:
                net(x[:, -1:], state=state)
        _, record = net(x, return_intermediates=True)    # the full model: its stream after layer 1 is the exit's
    assert run.layers.eq(1).all()
    t, pos = x.shape[1] - 1, torch.full((2, 1), x.shape[1] - 1)
    exited = record.hiddens[2][:, t]
    full_k, full_v = reference_keys(net, 0, record.hiddens[0][:, t], pos)
    assert_close(state.k[0][:, :, t: t + 1], full_k, atol=1e-5, rtol=1e-5)
    for layer in range(1, DEPTH):
        k, v = reference_keys(net, layer, exited, pos)
        assert_close(state.k[layer][:, :, t: t + 1], k, atol=1e-5, rtol=1e-5)
        assert_close(state.v[layer][:, :, t: t + 1], v, atol=1e-5, rtol=1e-5)


def on_module_path(net):
    """`net` with a no-op forward hook: generation then keeps the module path (the fast step refuses hooks)."""
    net.register_forward_hook(lambda *args: None)
    return net


def test_exited_tokens_skip_attention_and_feedforward_of_later_layers():
    net = on_module_path(model())
    calls: list[str] = []
    for i, block in enumerate(net.attn_layers.blocks):
        if isinstance(block.branch, (Attention, FeedForward)):
            block.branch.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    out = generate(net, ids(1, 5), 6, threshold=0.0)
    prompt_calls = 2 * DEPTH
    assert calls[:prompt_calls] == list(range(2 * DEPTH))
    assert calls[prompt_calls:] == [0, 1] * 5                        # five cached steps, layer 1 only
    assert out.layers.tolist() == [[DEPTH, 1, 1, 1, 1, 1]] and out.mean_layers < DEPTH


def test_the_fast_step_skips_attention_and_feedforward_of_later_layers(monkeypatch):
    """Generation runs the default plan's rows (generate/rows.py) layer by layer: an exited token runs no block
    after, only the later layers' key / value products."""
    net, calls = model(), []
    for kind, cls in (("a", rows._Attention), ("f", rows._FeedForward), ("k", exit_rows._Keys)):
        monkeypatch.setattr(cls, "__call__", lambda self, *a, kind=kind, call=cls.__call__: calls.append(kind) or
                            call(self, *a))
    out = generate(net, ids(1, 5), 6, threshold=0.0)
    assert calls == (["a", "f"] + ["k"] * (DEPTH - 1)) * 5 and out.layers.tolist() == [[DEPTH, 1, 1, 1, 1, 1]]
    calls.clear()
    assert generate(net, ids(1, 5), 6, threshold=0.999999).mean_layers == DEPTH
    assert calls == ["a", "f"] * DEPTH * 5


@pytest.mark.parametrize("keywords", [{}, dict(macaron=True), dict(shift_tokens=1)])
def test_a_row_decodes_as_it_would_alone_on_either_path(keywords):
    """Rows exit at different layers; an exited row's stream stays frozen block by block (macaron: a
    feedforward before the attention), so its later keys / values are the propagated ones, as alone."""
    net, x = model(exit_layers=(1, 2, 3), **keywords), ids(3, 5)
    threshold = 0.005                                                  # margins of an untrained model are small
    batch = generate(net, x, 8, threshold=threshold)
    assert batch.layers.unique().numel() > 2                          # rows and steps exit at different layers
    for row in range(3):
        alone = generate(net, x[row: row + 1], 8, threshold=threshold)
        assert torch.equal(alone.tokens[0], batch.tokens[row]) and torch.equal(alone.layers[0], batch.layers[row])
    module = generate(on_module_path(net), x, 8, threshold=threshold)
    assert torch.equal(module.tokens, batch.tokens) and torch.equal(module.layers, batch.layers)


def forced(net, x: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced early-exit decoding of x (b, n) on the fast step: (logits (b, n - 1, v) of positions
    1 .. n - 1, the layers each used (b, n - 1))."""
    exits, state = net.attn_layers.early_exit, net.new_state(x.shape[0], x.shape[1])
    step, logits, layers = ExitStep(net, exits, threshold), [], []
    with torch.no_grad():
        net(x[:, :1], state=state)
        for t in range(1, x.shape[1]):
            logits.append(step(x[:, t: t + 1], state=state))
            layers.append(step.layers)
    return torch.cat(logits, dim=1), torch.cat(layers, dim=1)


def test_exit_decoding_is_causal_and_never_exiting_matches_the_uncached_forward():
    net, x = model(exit_layers=(1, 2, 3)), ids(2, 8)
    logits, layers = forced(net, x, 0.005)
    assert layers.unique().numel() > 2
    y = x.clone()
    y[:, 5:] = ids(2, 3, seed=7)                                       # change only the future
    later, later_layers = forced(net, y, 0.005)
    assert torch.equal(logits[:, :4], later[:, :4]) and torch.equal(layers[:, :4], later_layers[:, :4])
    full, used = forced(net, x, 1.0)
    with torch.no_grad():
        assert_close(full, net(x)[:, 1:], atol=1e-5, rtol=1e-5) and used.eq(DEPTH).all()


def test_exiting_changes_the_state_later_tokens_read():
    """The next step reads the propagated keys: its logits differ from a state filled by the full model."""
    net, x = model(), ids(1, 6)
    exits = net.attn_layers.early_exit
    early, full = net.new_state(1, 8), net.new_state(1, 8)
    with torch.no_grad():
        net(x[:, :-1], state=early)
        net(x[:, :-1], state=full)
        with exits.decoding(net.head, 0.0):
            net(x[:, -1:], state=early)
        net(x[:, -1:], state=full)
        token = ids(1, 1, seed=5)
        after_early, after_full = net(token, state=early), net(token, state=full)
    assert not torch.allclose(after_early, after_full)
    assert torch.equal(early.k[0], full.k[0])                           # layer 1 ran in both


@pytest.mark.slow
def test_cli_generate_with_early_exit_reports_the_mean_layers(tmp_path):
    from tests.train.test_cli import TINY, polyformer

    run, args = tmp_path / "run", [a if a != "1" else "2" for a in TINY]         # depth 2: layer 1 may exit
    done = polyformer("train", *args, "--steps", "10", "--out", str(run), "--model.layers.exit_layers", "true")
    assert done.returncode == 0, done.stderr
    out = polyformer("generate", "--run", str(run), "--max-new-tokens", "8", "--prompt", "a", "--early-exit", "0")
    assert out.returncode == 0 and out.stdout.startswith("a"), out.stderr
    mean = float(re.search(r"early exit at threshold 0: ([0-9.]+) of 2 layers per token", out.stderr).group(1))
    assert 1 <= mean < 2                                    # every token after the first can stop at layer 1
    bad = polyformer("generate", "--run", str(run), "--max-new-tokens", "2", "--early-exit", "1.5")
    assert bad.returncode != 0 and "threshold must be a number in [0, 1]" in bad.stderr
