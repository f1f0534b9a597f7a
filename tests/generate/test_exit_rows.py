"""The early-exit walk over the default plan's rows (polyformer/generate/exit_rows.py): for each exit confidence,
with rows of a batch exiting at different layers, its layers, logits and decode state equal the module path's
(`EarlyExit.decoding`) up to float rounding; a step where no row exits (threshold 1, or one no confidence passes)
is the plain decode step bit for bit; once every row has exited only the later layers' key / value products run."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer.generate import exit_rows, rows
from polyformer.generate.early_exit import ExitStep
from polyformer.generate.fast import fast_step
from tests.helpers import ids, tiny_lm

DEPTH = 4


def model(measure: str, **keywords):
    net = tiny_lm(depth=DEPTH, heads=4, seed=0, rotary_pos_emb=True, exit_layers=(1, 2, 3), exit_confidence=measure,
                  attn_qkv_bias=True, attn_kv_heads=2, **keywords)
    if measure == "classifier":
        net.attn_layers.early_exit.trained += 1          # its random weights stand in for a trained classifier
    return net


def forced(net, x: torch.Tensor, threshold: float, fast: bool):
    """Teacher-forced exit decoding of x (b, n) after a 2-token prompt: (logits (b, n - 2, v), layers (b, n - 2),
    the decode state)."""
    exits, state = net.attn_layers.early_exit, net.new_state(x.shape[0], x.shape[1])
    step = ExitStep(net, exits, threshold) if fast else None
    assert not fast or isinstance(step.walk_rows, exit_rows.ExitRows)
    logits, layers = [], []
    with torch.no_grad():
        net(x[:, :2], state=state)
        for t in range(2, x.shape[1]):
            if fast:
                logits.append(step(x[:, t: t + 1], state=state))
                layers.append(step.layers)
                continue
            with exits.decoding(net.head, threshold) as run:
                logits.append(net(x[:, t: t + 1], state=state))
            layers.append(run.layers)
    return torch.cat(logits, dim=1), torch.cat(layers, dim=1), state


@pytest.mark.parametrize("measure, threshold", [("softmax_margin", 0.005), ("state_change", 0.7),
                                                ("classifier", 0.6), ("softmax_margin", 0.0)])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_rows_walk_equals_the_module_path(measure, threshold, batch):
    net, x = model(measure), ids(batch, 10)
    logits, layers, state = forced(net, x, threshold, fast=True)
    want, want_layers, want_state = forced(net, x, threshold, fast=False)
    assert torch.equal(layers, want_layers) and layers.min() < DEPTH
    if threshold > 0 and batch > 1:
        assert layers.unique().numel() > 2                       # rows exit at different layers
    assert_close(logits, want, atol=1e-5, rtol=1e-5)
    assert_close(state.k, want_state.k, atol=1e-5, rtol=1e-5) and assert_close(state.v, want_state.v, atol=1e-5,
                                                                                  rtol=1e-5)


@pytest.mark.parametrize("threshold", [1.0, 0.999999])
def test_a_step_where_nothing_exits_is_the_plain_step_bit_for_bit(threshold):
    net, x = model("softmax_margin"), ids(2, 9)
    exits = net.attn_layers.early_exit
    plain_state, exit_state = net.new_state(2, 9), net.new_state(2, 9)
    plain, step = fast_step(net), ExitStep(net, exits, threshold)
    with torch.no_grad():
        net(x[:, :2], state=plain_state)
        net(x[:, :2], state=exit_state)
        for t in range(2, x.shape[1]):
            want = plain(x[:, t: t + 1], state=plain_state)
            assert torch.equal(step(x[:, t: t + 1], state=exit_state), want) and step.layers.eq(DEPTH).all()
    assert torch.equal(exit_state.k, plain_state.k) and torch.equal(exit_state.v, plain_state.v)


@pytest.mark.parametrize("keywords", [dict(rotary_interleaved=True, rotary_emb_dim=4),
                                      dict(rotary_dynamic_ntk=(2.0, 8)),        # frequencies follow the length
                                      dict(rotary_yarn=dict(factor=4.0, original_max_len=8, beta_fast=16.0))])
def test_propagated_keys_are_rotated_as_the_module_path_rotates_them(keywords):
    """Every row exits at layer 1, so layers 2.. hold keys rotated by the walk's own key rotation."""
    net, x = model("softmax_margin", **keywords), ids(2, 12)
    logits, layers, state = forced(net, x, 0.0, fast=True)
    want, _, want_state = forced(net, x, 0.0, fast=False)
    assert layers.eq(1).all()
    assert_close(state.k, want_state.k, atol=1e-5, rtol=1e-5) and assert_close(logits, want, atol=1e-5, rtol=1e-5)


def test_rows_that_all_exit_run_only_the_later_key_value_products(monkeypatch):
    net, x, calls = model("softmax_margin"), ids(2, 6), []
    for kind, cls in (("a", rows._Attention), ("f", rows._FeedForward), ("k", exit_rows._Keys)):
        monkeypatch.setattr(cls, "__call__", lambda self, *a, kind=kind, call=cls.__call__: calls.append(kind) or
                            call(self, *a))
    _, layers, _ = forced(net, x, 0.0, fast=True)
    assert layers.eq(1).all() and calls == (["a", "f"] + ["k"] * (DEPTH - 1)) * (x.shape[1] - 2)
