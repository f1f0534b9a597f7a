"""`input_major`: the same weights in another memory layout - same values, shapes, parameters and
state dict, outputs equal up to float rounding, generation, checkpoints and training unchanged."""

import pytest
import torch
from torch import nn

from polyformer import AutoregressiveWrapper, input_major
from polyformer.layout import is_input_major
from polyformer.train.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers import ids, tiny_lm


def linears(m):
    return {name: lin for name, lin in m.named_modules() if isinstance(lin, nn.Linear)}


def test_expanding_weights_change_layout_only():
    m = tiny_lm(seed=0, ff_glu=True)
    before = {name: lin.weight.detach().clone() for name, lin in linears(m).items()}
    params = {name: lin.weight for name, lin in linears(m).items()}
    x = ids(2, 10)
    with torch.no_grad():
        expected = m(x)
    assert input_major(m) is m
    for name, lin in linears(m).items():
        assert lin.weight is params[name]                              # the same Parameter object
        assert torch.equal(lin.weight, before[name]) and lin.weight.shape == before[name].shape
        expanding = lin.out_features > lin.in_features
        assert is_input_major(lin.weight) == expanding, name
        assert lin.weight.stride() == ((1, lin.out_features) if expanding else (lin.in_features, 1))
    with torch.no_grad():
        got = m(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    state = m.state_dict()
    assert all(torch.equal(state[name + ".weight"], before[name]) for name in before)


def test_all_layers_skip_and_idempotence():
    m = tiny_lm(seed=0)
    input_major(m, only_expanding=False, skip=("to_logits",))
    assert not is_input_major(m.to_logits.weight)
    assert all(is_input_major(lin.weight) for name, lin in linears(m).items() if name != "to_logits")
    again = {name: lin.weight.data_ptr() for name, lin in linears(m).items()}
    input_major(m, only_expanding=False)
    assert all(lin.weight.data_ptr() == again[name] for name, lin in linears(m).items() if name != "to_logits")


def test_greedy_generation_and_cache_are_unchanged():
    m = tiny_lm(seed=0, rotary_pos_emb=True, attn_kv_heads=2)
    ar = AutoregressiveWrapper(m)
    prompts = ids(2, 5)
    expected = ar.generate(prompts, 12, temperature=0.0)
    input_major(m, only_expanding=False)
    assert torch.equal(ar.generate(prompts, 12, temperature=0.0), expected)
    assert torch.equal(ar.generate(prompts, 12, temperature=0.0, cache_kv=False), expected)


def test_checkpoint_round_trip_and_training(tmp_path):
    m = tiny_lm(seed=0)
    input_major(m, only_expanding=False)
    save_checkpoint(tmp_path, 1, m, None, None)
    fresh = tiny_lm(seed=0)
    torch.manual_seed(5)
    for p in fresh.parameters():
        p.data.normal_()
    input_major(fresh)                                 # loading copies into the new layout as well
    load_checkpoint(tmp_path / "checkpoints" / "step-000001", fresh)
    for (name, a), b in zip(m.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    plain = tiny_lm(seed=0)
    for net in (m, plain):
        net.train()
        AutoregressiveWrapper(net)(ids(2, 8)).backward()
    for (name, p), q in zip(m.named_parameters(), plain.parameters()):   # the same training step
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert is_input_major(m.attn_layers.blocks[0].branch.project.to_qkv.weight)


def test_shared_weights_and_bad_arguments():
    first, second = nn.Linear(4, 8), nn.Linear(4, 8)
    second.weight = first.weight
    input_major(nn.Sequential(first, nn.Sequential(second)))
    assert not is_input_major(first.weight)               # two modules use it: left alone
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 16))
    input_major(net)
    assert is_input_major(net[2].weight)
    with pytest.raises(ValueError, match="skip: no module named"):
        input_major(net, skip=("nope",))
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        input_major("model")
