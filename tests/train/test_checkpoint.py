"""Checkpoints: atomic, verified, pruned; resuming gives the same losses as never stopping."""

import json
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

np = pytest.importorskip("numpy")        # (torch does not require it; the global RNG round trip uses it)
pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402

from polyformer import TransformerWrapper, build_model  # noqa: E402
from polyformer.train import checkpoint  # noqa: E402
from polyformer.train.checkpoint import (  # noqa: E402
    ResumeError, latest_checkpoint, list_checkpoints, load_checkpoint, resume_checkpoint, save_checkpoint)
from polyformer.train.rng import restore_rng, rng_state  # noqa: E402
from polyformer.train.run import load_run_config, model_from_run, run_config, save_run_config  # noqa: E402
from tests.helpers import tiny_lm  # noqa: E402

NUM_TOKENS = 32
DATA = torch.randint(0, NUM_TOKENS, (4096,), generator=torch.Generator().manual_seed(7))
SETTINGS = {"lr": 3e-3, "weight_decay": 0.1, "warmup": 8, "batch": 4}


def tiny(depth: int = 2, num_tokens: int = NUM_TOKENS, **keywords) -> TransformerWrapper:
    return tiny_lm(num_tokens=num_tokens, max_seq_len=16, depth=depth, **keywords)


def optimizer_and_scheduler(model):
    opt = torch.optim.AdamW(model.parameters(), lr=SETTINGS["lr"], weight_decay=SETTINGS["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / SETTINGS["warmup"]))
    return opt, sched


def train(model, opt, sched, steps, data_state):
    """Steps that use every source of randomness a real loop has: a data generator whose state is
    in data_state, a data position, Python `random` (crop length) and the global torch RNG (dropout)."""
    losses = []
    model.train()
    for _ in range(steps):
        g = torch.Generator()
        g.set_state(data_state["generator"])
        starts = torch.randint(0, 1024, (SETTINGS["batch"],), generator=g) + data_state["position"]
        n = random.randint(8, 13)
        x = torch.stack([DATA[s: s + n + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        data_state["generator"], data_state["position"] = g.get_state(), data_state["position"] + 17
    return losses


def fresh_data_state():
    return {"position": 0, "generator": torch.Generator().manual_seed(1).get_state()}


def weights_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_resume_gives_bit_identical_losses_and_weights(tmp_path):
    torch.manual_seed(0), random.seed(0)
    straight = tiny(attn_dropout=0.1, ff_dropout=0.1)
    opt, sched = optimizer_and_scheduler(straight)
    expected = train(straight, opt, sched, 6, fresh_data_state())

    torch.manual_seed(0), random.seed(0)
    model = tiny(attn_dropout=0.1, ff_dropout=0.1)
    opt, sched = optimizer_and_scheduler(model)
    data_state = fresh_data_state()
    first = train(model, opt, sched, 3, data_state)
    save_run_config(tmp_path, run_config(model, SETTINGS))
    save_checkpoint(tmp_path, 3, model, opt, sched, data_state, {"losses": first})
    torch.rand(100), random.random(), train(model, opt, sched, 1, data_state)   # the run goes on, then dies
    del model, opt, sched

    config = load_run_config(tmp_path)
    model = build_model(config["model"])
    assert config["train"] == SETTINGS
    opt, sched = optimizer_and_scheduler(model)
    info = load_checkpoint(resume_checkpoint(tmp_path), model, opt, sched)
    assert info["step"] == 3 and info["extra"] == {"losses": first}
    rest = train(model, opt, sched, 3, info["data_state"])
    assert first + rest == expected                       # exact float equality, step by step
    assert weights_equal(model, straight)


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    model = tiny()
    opt, sched = optimizer_and_scheduler(model)
    train(model, opt, sched, 2, fresh_data_state())
    path = save_checkpoint(tmp_path, 2, model, opt, sched, {"position": 34}, {"note": "x"})
    after = (torch.rand(5), random.random(), np.random.rand(3))       # what an uninterrupted run draws next
    torch.rand(7), random.random(), np.random.rand(2)

    other = tiny()
    opt2, sched2 = optimizer_and_scheduler(other)
    info = load_checkpoint(path, other, opt2, sched2)
    assert torch.equal(torch.rand(5), after[0]) and random.random() == after[1]
    assert np.array_equal(np.random.rand(3), after[2])
    assert weights_equal(model, other)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"] and sched.state_dict() == sched2.state_dict()
    for k in s1["state"]:
        assert all(torch.equal(s1["state"][k][name], s2["state"][k][name]) for name in s1["state"][k])
    assert info == {"step": 2, "data_state": {"position": 34}, "extra": {"note": "x"}, "path": path}


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_every_file_of_a_checkpoint_has_the_usual_permissions(tmp_path, umask, mode):
    """safetensors creates its files 0600; a checkpoint's files are ordinary files (0666 less umask)."""
    import os
    import stat

    model = tiny()
    opt, sched = optimizer_and_scheduler(model)
    previous = os.umask(umask)
    try:
        path = save_checkpoint(tmp_path, 1, model, opt, sched)
    finally:
        os.umask(previous)
    modes = {f.name: stat.S_IMODE(os.stat(f).st_mode) for f in path.iterdir()}
    assert set(modes) == {"model.safetensors", "state.pt", "manifest.json"} and set(modes.values()) == {mode}, modes


def test_restore_rng_alone():
    state = rng_state()
    a = torch.rand(3), random.random(), np.random.rand()
    restore_rng(state)
    assert torch.equal(torch.rand(3), a[0]) and random.random() == a[1] and np.random.rand() == a[2]
    with pytest.raises(ValueError, match="RNG state is malformed"):
        restore_rng({"torch": "nope"})


def test_state_loads_with_weights_only_and_refuses_unpicklable_extra(tmp_path):
    model = tiny()
    opt, sched = optimizer_and_scheduler(model)
    train(model, opt, sched, 1, fresh_data_state())
    path = save_checkpoint(tmp_path, 1, model, opt, sched, fresh_data_state(), {"best": 1.5, "seen": [1, 2]})
    state = torch.load(path / "state.pt", weights_only=True)
    assert {"optimizer", "scheduler", "rng", "data_state", "extra", "step"} <= set(state)
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.safetensors", "state.pt"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "state.pt"}
    with pytest.raises(TypeError, match=r"extra\['when'\] is a set"):
        save_checkpoint(tmp_path, 2, model, opt, sched, {}, {"when": {1, 2}})
    with pytest.raises(TypeError, match=r"data_state\['rng'\] is a Generator"):
        save_checkpoint(tmp_path, 2, model, opt, sched, {"rng": torch.Generator()}, {})
    assert list_checkpoints(tmp_path) == [path]


def test_keep_last_prunes_older_checkpoints(tmp_path):
    model = tiny(depth=1)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, None, None, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004", "step-000005"]
    save_checkpoint(tmp_path, 2, model, None, None, keep_last=1)     # after resuming from an older one
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000005"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == []
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 6, model, None, None, keep_last=0)


def test_corrupt_checkpoints_are_skipped_with_a_warning(tmp_path):
    model = tiny(depth=1)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, None, None)
    weights = tmp_path / "checkpoints/step-000003/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])                  # truncated
    with pytest.warns(UserWarning, match=r"step-000003.*model.safetensors is \d+ bytes.*truncated"):
        assert latest_checkpoint(tmp_path).name == "step-000002"
    state = tmp_path / "checkpoints/step-000002/state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF                                      # edited, same size
    state.write_bytes(bytes(data))
    with pytest.warns(UserWarning) as caught:
        assert latest_checkpoint(tmp_path).name == "step-000001"
    messages = [str(w.message) for w in caught]
    assert any("step-000003" in m for m in messages)
    assert any("step-000002" in m and "state.pt does not match its sha256" in m for m in messages)
    with pytest.raises(ValueError, match="step-000002.*corrupt.*state.pt"):
        load_checkpoint(tmp_path / "checkpoints/step-000002", model)
    assert load_checkpoint(tmp_path / "checkpoints/step-000001", model)["step"] == 1


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model = tiny(depth=1)
    opt, sched = optimizer_and_scheduler(model)
    save_checkpoint(tmp_path, 1, model, opt, sched)

    def interrupted(directory, step):
        raise KeyboardInterrupt     # e.g. a second Ctrl-C in the middle of the save
    monkeypatch.setattr(checkpoint, "_write_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, opt, sched)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]
    stale = tmp_path / "checkpoints/.tmp-step-000002-dead"            # a killed process leaves this
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "step-000001"
    assert load_checkpoint(latest_checkpoint(tmp_path), tiny(depth=1), *optimizer_and_scheduler(model))["step"] == 1
    save_checkpoint(tmp_path, 2, model, opt, sched)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001", "step-000002"]


def test_saving_a_step_again_replaces_it(tmp_path):
    model = tiny(depth=1)
    save_checkpoint(tmp_path, 4, model, None, None, extra={"why": "periodic"})
    save_checkpoint(tmp_path, 4, model, None, None, extra={"why": "SIGTERM"})
    info = load_checkpoint(latest_checkpoint(tmp_path), model)
    assert info["extra"] == {"why": "SIGTERM"} and len(list_checkpoints(tmp_path)) == 1


def test_tied_embeddings_round_trip(tmp_path):
    model = tiny(tie_embedding=True).eval()
    path = save_checkpoint(tmp_path, 0, model, None, None)
    other = tiny(tie_embedding=True).eval()
    load_checkpoint(path, other)
    x = torch.randint(0, NUM_TOKENS, (2, 9))
    assert torch.equal(model(x), other(x))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.out.weight = self.inp.weight                # two state-dict names, one tensor


def test_aliased_tensors_are_stored_once_and_stay_shared(tmp_path):
    model = Tied()
    path = save_checkpoint(tmp_path, 0, model, None, None)       # plain safetensors refuses shared tensors
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert list(f.keys()) == ["inp.weight"]
    other = Tied()
    load_checkpoint(path, other)
    assert torch.equal(other.out.weight, model.inp.weight) and other.out.weight is other.inp.weight


def test_mismatched_model_lists_every_mismatch(tmp_path):
    path = save_checkpoint(tmp_path, 0, tiny(), None, None)
    other = tiny(depth=1, num_tokens=40, rel_pos_bias=True)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, other)
    message = str(error.value)
    assert "missing from the checkpoint: attn_layers.shared_bias.embedding.weight" in message
    assert "attn_layers.blocks.2.branch.project.to_qkv.weight" in message       # not in the model
    assert "attn_layers.blocks.3.norm_in.bias" in message
    assert "token_emb.weight (checkpoint (32, 32)" in message and "to_logits.bias" in message
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())   # nothing changed


def test_run_config_round_trip_and_incompatible_versions(tmp_path):
    model = tiny(depth=1)
    save_run_config(tmp_path, run_config(model, SETTINGS))
    config = load_run_config(tmp_path)
    assert config["polyformer_run_format"] == 1 and "polyformer_version" in config
    rebuilt = model_from_run(tmp_path)                                  # freshly initialised, same structure
    assert type(rebuilt) is TransformerWrapper and rebuilt.state_dict().keys() == model.state_dict().keys()
    with pytest.raises(FileExistsError):
        save_run_config(tmp_path, run_config(model, SETTINGS))

    for i, found in enumerate(({"polyformer_run_format": 0}, {"model": {}})):      # another format, none
        old = tmp_path / f"old{i}"
        old.mkdir()
        (old / "config.json").write_text(json.dumps(found))
        text = (old / "config.json").read_text()
        with pytest.raises(ValueError, match="written by an incompatible version"):
            load_run_config(old)
        with pytest.raises(ValueError, match="incompatible version"):
            save_run_config(old, run_config(model, SETTINGS), overwrite=True)
        assert (old / "config.json").read_text() == text                # nothing overwritten
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_run_config(tmp_path / "nowhere")


def test_nothing_to_resume_is_a_clear_error(tmp_path):
    with pytest.raises(ResumeError, match="nothing to resume.*does not exist"):
        resume_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ResumeError, match="nothing to resume.*no checkpoints"):
        resume_checkpoint(tmp_path)
    path = save_checkpoint(tmp_path, 5, tiny(depth=1), None, None)
    (path / "manifest.json").unlink()
    with pytest.raises(ResumeError, match="no checkpoint.*verifies.*step-000005: manifest.json is missing"):
        resume_checkpoint(tmp_path)
    assert issubclass(ResumeError, ValueError)
