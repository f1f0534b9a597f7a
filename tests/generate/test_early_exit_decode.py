"""Early-exit decoding (polyformer/generate/early_exit.py): with a threshold that never exits the logits and
tokens are the full model's bit for bit; with exits, the skipped layers' decode state holds the keys / values
computed from the exited state (worked out by hand), their attention and feedforward never run, a batch row
decodes as it would alone, and the mean layers used fall below the depth."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper
from polyformer.attention.attention import Attention
from polyformer.feedforward import FeedForward
from polyformer.generate.early_exit import generate
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


def test_skipped_layers_keys_come_from_the_exited_state():
    net, x = model(), ids(2, 7)
    exits, state = net.attn_layers.early_exit, net.new_state(2, 8)
    with torch.no_grad():
        net(x[:, :-1], state=state)
        with exits.decoding(net.head, 0.0) as run:        # any margin above 0 exits at the first layer
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


def test_exited_tokens_skip_attention_and_feedforward_of_later_layers():
    net = model()
    calls: list[str] = []
    for i, block in enumerate(net.attn_layers.blocks):
        if isinstance(block.branch, (Attention, FeedForward)):
            block.branch.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    out = generate(net, ids(1, 5), 6, threshold=0.0)
    prompt_calls = 2 * DEPTH
    assert calls[:prompt_calls] == list(range(2 * DEPTH))
    assert calls[prompt_calls:] == [0, 1] * 5                        # five cached steps, layer 1 only
    assert out.layers.tolist() == [[DEPTH, 1, 1, 1, 1, 1]] and out.mean_layers < DEPTH


def test_a_row_decodes_as_it_would_alone():
    net, x = model(exit_layers=(1, 2, 3)), ids(3, 5)
    threshold = 0.005                                                  # margins of an untrained model are small
    batch = generate(net, x, 8, threshold=threshold)
    assert batch.layers.unique().numel() > 1                          # rows and steps exit at different layers
    for row in range(3):
        alone = generate(net, x[row: row + 1], 8, threshold=threshold)
        assert torch.equal(alone.tokens[0], batch.tokens[row]) and torch.equal(alone.layers[0], batch.layers[row])


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
