"""Early exit (polyformer/early_exit.py, calibrate.py): each confidence measure equals its formula; the training
loss is CALM's index-weighted average of the exit layers' losses and the classifier learns the oracle labels;
Learn-then-Test's p-values equal their formulas, and the threshold it calibrates on a tiny trained model keeps
held-out prompts consistent with the full model; bad input is named."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from benchmarks.early_exit import V, task    # half the rows count up by one (one layer suffices), half add mod V
from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper
from polyformer.calibrate import binomial_tail, calibrate_exit, hoeffding_bentkus
from polyformer.config import LayersConfig, from_dict, to_dict
from polyformer.early_exit import next_token_loss, state_change
from polyformer.generate.early_exit import generate
from polyformer.train.objectives import LanguageModeling
from tests.helpers import ids, tiny_lm

DEPTH = 4


def model(**keywords) -> TransformerWrapper:
    return tiny_lm(depth=DEPTH, heads=2, seed=0, rotary_pos_emb=True, **{"exit_layers": True, **keywords})


def streams(net: TransformerWrapper, x: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream after layers 0 (the input), 1, ..., DEPTH (before the final norm)."""
    _, record = net(x, return_intermediates=True)
    unit = len(net.attn_layers.layout) // DEPTH
    return [record.hiddens[n * unit] for n in range(DEPTH + 1)]


def test_softmax_margin_is_the_top_two_probabilities_difference():
    net, x = model(), ids(2, 7)
    h = streams(net, x)
    exits = net.attn_layers.early_exit
    with torch.no_grad():
        got = exits.confidence(net.attn_layers, h[2], h[1], 2, net.head)
        logits = net.to_logits(F.layer_norm(h[2], (32,), net.attn_layers.final_norm.weight,
                                            net.attn_layers.final_norm.bias, 1e-5))
        p = logits.double().exp() / logits.double().exp().sum(-1, keepdim=True)
        top = p.sort(-1, descending=True).values
    assert_close(got.double(), top[..., 0] - top[..., 1], atol=1e-6, rtol=0)


def test_state_change_is_the_cosine_of_consecutive_exit_streams():
    net, x = model(exit_confidence="state_change", exit_layers=(1, 3)), ids(2, 7)
    h = streams(net, x)
    with torch.no_grad():
        got = net.attn_layers.early_exit.confidence(net.attn_layers, h[3], h[1], 3, net.head)
    a, b = h[3].double(), h[1].double()
    assert_close(got.double(), (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)), atol=1e-6, rtol=0)
    near = torch.randn(1000, 32, generator=torch.Generator().manual_seed(0))
    assert state_change(near * 1.0001, near).max() <= 1.0        # rounding stays below threshold 1 (never exits)


def test_state_change_decoding_compares_with_the_previous_exit_layer():
    """At threshold t a step exits at layer 3 exactly when cos(h_3, h_1) > t and cos(h_1, input) <= t."""
    net, x = model(exit_confidence="state_change", exit_layers=(1, 3)), ids(1, 7)
    h = [s[:, -1] for s in streams(net, x)]
    first = F.cosine_similarity(h[1], h[0], dim=-1).item()
    second = F.cosine_similarity(h[3], h[1], dim=-1).item()
    if second <= first:
        pytest.skip("this seed's streams do not separate the two exits")
    exits, state = net.attn_layers.early_exit, net.new_state(1, 8)
    net(x[:, :-1], state=state)
    with torch.no_grad(), exits.decoding(net.head, (first + second) / 2) as run:
        net(x[:, -1:], state=state)
    assert run.layers.tolist() == [[3]]


def test_classifier_confidence_is_a_sigmoid_of_a_linear_map_per_exit_layer():
    net, x = model(exit_confidence="classifier", exit_layers=(1, 2)), ids(2, 7)
    h = streams(net, x)
    exits = net.attn_layers.early_exit
    with torch.no_grad():
        got = exits.confidence(net.attn_layers, h[2], h[1], 2, net.head)
        f = net.attn_layers.final_norm(h[2])
        want = torch.sigmoid(f @ exits.classifier.weight[1] + exits.classifier.bias[1])
    assert_close(got, want, atol=1e-6, rtol=0)


def test_loss_is_the_index_weighted_average_of_the_exit_layers_losses():
    net, x = model(exit_layers=(1, 3)), ids(2, 9)
    net.train()
    loss, aux = AutoregressiveWrapper(net)(x, return_losses=True)
    h = streams(net, x[:, :-1])
    ce = {n: F.cross_entropy(net.head(net.attn_layers.final_norm(h[n])).transpose(1, 2), x[:, 1:]) for n in (1, 3, 4)}
    assert_close(loss, (1 * ce[1] + 3 * ce[3] + 4 * ce[4]) / 8)      # w_n = n / (1 + 3 + 4)
    assert set(aux.terms) == {"exit_ce_1", "exit_ce_3", "exit_ce_4"} and aux.weights["exit_ce_1"] == 0.0
    assert_close(aux.terms["exit_ce_1"], ce[1].detach())
    objective = LanguageModeling()
    assert_close(objective.loss(net, x), loss) and objective.aux.terms.keys() == aux.terms.keys()
    loss.backward()
    assert net.attn_layers.blocks[0].branch.project.to_qkv.weight.grad.abs().sum() > 0
    net.eval()                        # evaluation scores the full model
    assert_close(AutoregressiveWrapper(net)(x), F.cross_entropy(net(x[:, :-1]).transpose(1, 2), x[:, 1:]))


def test_classifier_learns_the_oracle_labels_on_detached_states():
    net, x = model(exit_confidence="classifier", exit_layers=(2,)), ids(3, 9)
    net.train()
    exits = net.attn_layers.early_exit
    loss, aux = next_token_loss(net, x[:, :-1], x[:, 1:])
    h = streams(net, x[:, :-1])
    f2, f4 = (net.attn_layers.final_norm(h[n]) for n in (2, 4))
    label = (net.head(f2).argmax(-1) == net.head(f4).argmax(-1)).float()
    want = F.binary_cross_entropy_with_logits(exits.classifier(f2)[..., 0], label)
    assert_close(aux.terms["exit_classifier"], want) and aux.weights["exit_classifier"] == 1.0
    assert int(exits.trained) == 1
    grads = torch.autograd.grad(aux.terms["exit_classifier"], [exits.classifier.weight, net.to_logits.weight],
                                allow_unused=True)
    assert grads[0].abs().sum() > 0 and grads[1] is None          # the language model is not moved by it


def test_classifier_untrained_is_refused_when_decoding():
    net = model(exit_confidence="classifier")
    with pytest.raises(ValueError, match="exit_confidence='classifier' needs a trained classifier"):
        generate(net, ids(1, 4), 3)


def test_config_round_trips_through_json():
    cfg = model(exit_layers=[1, 2], exit_confidence="state_change", exit_threshold=0.7).attn_layers.cfg
    assert from_dict(LayersConfig, to_dict(cfg)) == cfg and cfg.early_exit.layers == (1, 2)


@pytest.mark.parametrize("keywords, message", [
    (dict(exit_layers=(0, 2)), "exit_layers must be layer counts in \\[1, depth=4\\]"),
    (dict(exit_layers=(5,)), "exit_layers must be layer counts in \\[1, depth=4\\]"),
    (dict(exit_layers=(4,)), "names only the last layer"),
    (dict(exit_layers=(1, 1)), "names a layer twice"),
    (dict(exit_layers="all"), "exit_layers.*expected True or a sequence"),
    (dict(exit_layers=True, exit_confidence="entropy"), "exit_confidence must be one of"),
    (dict(exit_layers=True, exit_threshold=1.5), "exit_threshold must be a number in \\[0, 1\\]"),
    (dict(exit_layers=True, exit_threshold=-0.1), "exit_threshold must be a number in \\[0, 1\\]"),
    (dict(exit_threshold=0.5), "exit_threshold need\\(s\\) exit_layers"),
    (dict(exit_layers=True, universal=True), "exit_layers cannot combine with universal=True"),
    (dict(exit_layers=True, attn_performer=True), "exit_layers cannot combine with attn_performer"),
    (dict(exit_layers=True, gau=True), "gau=True replaces self-attention"),
    (dict(exit_layers=True, sandwich_coef=1), "one repeating unit"),
    (dict(exit_layers=True, ff_moe=True, ff_num_experts=4, ff_moe_capacity_factor=1.0), "running capacity counts"),
])
def test_bad_keywords_are_named(keywords, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Decoder(dim=32, depth=DEPTH, **keywords)


def test_encoder_is_refused():
    with pytest.raises(ValueError, match="needs a causal stack"):
        Encoder(dim=32, depth=2, exit_layers=True)


def test_generation_refuses_bad_thresholds_and_models_without_exits():
    with pytest.raises(ValueError, match="threshold must be a number in \\[0, 1\\]"):
        generate(model(), ids(1, 4), 3, threshold=2.0)
    with pytest.raises(ValueError, match="needs a model built with exit_layers"):
        generate(tiny_lm(), ids(1, 4), 3)


def test_p_values_equal_their_formulas():
    n, eps = 40, 0.2
    tail = sum(math.comb(n, i) * eps ** i * (1 - eps) ** (n - i) for i in range(3))
    assert_close(binomial_tail(2 / n, n, eps), tail)
    r = 0.1
    h = r * math.log(r / eps) + (1 - r) * math.log((1 - r) / (1 - eps))
    tail4 = sum(math.comb(n, i) * eps ** i * (1 - eps) ** (n - i) for i in range(5))
    assert_close(hoeffding_bentkus(r, n, eps), min(math.exp(-n * h), math.e * tail4))
    assert hoeffding_bentkus(0.3, n, eps) == 1.0          # an empirical risk above epsilon never rejects


@pytest.mark.parametrize("keywords, message", [
    (dict(delta=0.0, epsilon=0.1), "delta must be a number in \\(0, 1\\)"),
    (dict(delta=0.1, epsilon=1.0), "epsilon must be a number in \\(0, 1\\)"),
    (dict(delta=0.1, epsilon=0.1, loss="bleu"), "loss must be 'tokens' or 'sequence'"),
    (dict(delta=0.1, epsilon=0.1, thresholds=[1.5]), "thresholds must be numbers in \\[0, 1\\]"),
])
def test_calibration_refuses_bad_arguments(keywords, message):
    with pytest.raises(ValueError, match=message):
        calibrate_exit(model(), ids(4, 3), **keywords)


def test_calibrated_threshold_keeps_held_out_prompts_consistent():
    torch.manual_seed(0)
    net = TransformerWrapper(num_tokens=V, max_seq_len=32, attn_layers=Decoder(
        dim=32, depth=DEPTH, heads=2, attn_dim_head=16, rotary_pos_emb=True, exit_layers=True))
    wrapper, g = AutoregressiveWrapper(net), torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(300):
        opt.zero_grad()
        wrapper(task(16, 12, g)).backward()
        opt.step()
    net.eval()
    calibration, held_out = task(150, 4, g), task(150, 4, g)
    epsilon = 0.1
    result = calibrate_exit(net, calibration, delta=0.1, epsilon=epsilon, seq_len=8)
    assert result.threshold < 1 and result.valid and result.tested[-1][2] > 0.1    # the search stopped at a failure
    full = generate(net, held_out, 8, threshold=1.0).tokens
    early = generate(net, held_out, 8, threshold=result.threshold)
    assert (early.tokens != full).float().mean() <= epsilon
    assert early.mean_layers < DEPTH - 1


def test_a_token_that_exits_writes_multi_latent_inputs_for_the_blocks_it_skips():
    """With a multi-latent stack the state keeps latents: a skipped block's row holds the latent of the exit
    stream (write_keys), which the next step up-projects and rotates as it would the block's own keys."""
    from polyformer.early_exit import write_keys
    from polyformer.interfaces import KV, Context
    from polyformer.memory.kv_cache import DecodeState

    net = model(attn_use_latent_kv=True, attn_dim_latent_kv=6, attn_latent_rope_subheads=1)
    latent_state = net.new_state(1, 4)
    assert latent_state.keeps_latents
    attn = net.attn_layers.blocks[0].branch
    keys_state = DecodeState(1, 1, 4, *attn.decode_dims)
    h, pos = torch.randn(1, 3, 32), torch.arange(3)[None]
    for state in (latent_state, keys_state):
        state.begin(pos, None)
        write_keys(attn, h, Context(pos=pos, causal=True, state=state))
    read = attn.project.expand(KV(latent_state.k[0, :, :, :3], latent_state.v[0, :, :, :3], pos, None))
    _, rotated = attn.position(read.k, read.k, pos, pos)
    assert_close(rotated, keys_state.k[0, :, :, :3])
    assert_close(read.v, keys_state.v[0, :, :, :3])
