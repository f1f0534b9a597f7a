"""Expert parallelism: gloo processes, each holding its share of every expert layer's experts (or, data
parallel, all of them) and of the batch, equal one process holding every expert on the whole batch: losses,
every gradient, the clipped AdamW steps after them, the optimizer's state."""

from __future__ import annotations

import faulthandler
import gc
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from polyformer import Decoder, TransformerWrapper
from polyformer.moe import parallel
from polyformer.train.objectives import LanguageModeling
from polyformer.train.setup import optimizer_for

ROWS, STEPS, CLIP, LR = 4, 2, 0.05, 1e-2
MOE = dict(ff_moe=True, ff_num_experts=4, ff_moe_top_k=2, ff_moe_balance_loss=0.1, ff_moe_z_loss=0.01)


def build(**keywords) -> nn.Module:
    torch.manual_seed(0)
    layers = Decoder(dim=16, depth=2, heads=2, **{**MOE, **keywords})
    return TransformerWrapper(num_tokens=32, max_seq_len=12, attn_layers=layers)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (ROWS, 13), generator=g) for _ in range(STEPS)]


def train(model: nn.Module, rows: slice, sync, clip) -> dict:
    """STEPS clipped AdamW steps on the rows of each batch; the losses (the world's mean), the first step's
    gradients and the final weights and optimizer state, whole."""
    objective, optimizer = LanguageModeling(), optimizer_for(model, LR, 0.1)
    losses, grads = [], None
    for batch in batches():
        optimizer.zero_grad()
        loss = objective.loss(model, batch[rows])
        loss.backward()
        sync()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        clip()
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "grads": grads, "weights": model.state_dict(), "optimizer": optimizer}


def reference(**keywords) -> dict:
    model = build(**keywords)
    result = train(model, slice(None), lambda: None, lambda: nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    result["optimizer"] = result["optimizer"].state_dict()
    return result


def _worker(rank: int, port: int, out: str, world: int, size: int, keywords: dict) -> None:
    faulthandler.dump_traceback_later(120, exit=True)     # a deadlock fails the test rather than hanging it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build(**keywords)
        rows = slice(rank, None, world)
        if size > 1:                # experts spread over `size` processes, gradients synchronised by hand
            g = parallel.groups(size)
            parallel.place(model, g)
            result = train(model, rows, lambda: parallel.sync_gradients(model, g),
                           lambda: parallel.clip_grad_norm(model, CLIP, g))
            spread = {f"{prefix}.{name}" for prefix, _ in parallel.expert_layers(model) for name in parallel.PARAMS}
            result["grads"] = {n: parallel._gather(t, g) if n in spread else t for n, t in result["grads"].items()}
            result["weights"] = parallel.full_state_dict(model, g)
            result["optimizer"] = parallel.full_optimizer_state(result["optimizer"], model, g)
        else:                       # data parallel: DDP, every process holding every expert
            parallel.balance_over(model, dist.group.WORLD)
            net = nn.parallel.DistributedDataParallel(model)
            result = train(net, rows, lambda: None, lambda: nn.utils.clip_grad_norm_(net.parameters(), CLIP))
            result["grads"] = {n.removeprefix("module."): t for n, t in result["grads"].items()}
            result["weights"] = model.state_dict()
            result["optimizer"] = result["optimizer"].state_dict()
        dist.all_reduce(result["losses"])
        result["losses"] /= world
        if rank == 0:
            torch.save(result, Path(out) / "result.pt")
    finally:                        # DDP's reference cycles freed while the group lives (see train/distributed.py)
        gc.collect()
        dist.destroy_process_group()


def spawned(tmp_path: Path, size: int, world: int = 2, **keywords) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path), world, size, keywords), nprocs=world, join=True)
    return torch.load(tmp_path / "result.pt", weights_only=False)


def assert_equal(got: dict, want: dict) -> None:
    torch.testing.assert_close(got["losses"], want["losses"], atol=1e-5, rtol=0)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=0, msg=name)
    # AdamW divides by sqrt(v) + eps: a gradient element near eps (~1e-9 after clipping) turns the gradients'
    # summation-order error (~1e-3 relative, within the 1e-5 above) into up to lr / 400 of weight per step
    for name, weight in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, atol=STEPS * LR / 400, rtol=0, msg=name)
    for index, state in want["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["optimizer"]["state"][index][key], value, atol=1e-5, rtol=0)


def test_two_processes_holding_half_the_experts_equal_one(tmp_path):
    want = reference()
    assert want["grads"]["attn_layers.blocks.1.branch.experts.w_in"].abs().sum() > 0
    assert_equal(spawned(tmp_path, 2), want)


@pytest.mark.slow
def test_data_parallel_moe_equals_one_process(tmp_path):
    """W = 2, N = 1: each process holds every expert; the balance loss's f_i is the whole batch's."""
    assert_equal(spawned(tmp_path, 1), reference())


@pytest.mark.slow
def test_expert_and_data_parallel_compose(tmp_path):
    """W = 4, N = 2: two replicas of each expert group; the experts' gradients summed over their replicas."""
    assert_equal(spawned(tmp_path, 2, world=4), reference())


@pytest.mark.slow
def test_expert_parallel_with_capacity_and_shared_experts(tmp_path):
    keywords = dict(ff_moe_capacity_factor=1.0, ff_moe_shared_experts=1, ff_moe_top_k=1, ff_num_experts=2)
    assert_equal(spawned(tmp_path, 2, **keywords), reference(**keywords))


def test_experts_not_divisible_are_refused():
    model = build(ff_num_experts=3, ff_moe_top_k=1)
    with pytest.raises(ValueError, match=r"train\.expert_parallel=2 must divide ff_num_experts=3"):
        parallel.place(model, parallel.Groups(None, None, 2, 0, 2))


def test_a_model_without_experts_is_refused():
    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=32, max_seq_len=12, attn_layers=Decoder(dim=16, depth=1, heads=2))
    with pytest.raises(ValueError, match="train.expert_parallel > 1 .* ff_moe=True"):
        parallel.place(model, parallel.Groups(None, None, 2, 0, 2))


def _buffers_worker(rank: int, port: int, out: str) -> None:
    faulthandler.dump_traceback_later(120, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = build(attn_routing=True, attn_routing_clusters=2, attn_routing_window=4)
        g = parallel.groups(2)
        parallel.place(model, g)

        def sync() -> None:
            parallel.sync_gradients(model, g)
            parallel.broadcast_buffers(model)

        train(model, slice(rank, None, 2), sync, lambda: None)
        centroids = torch.cat([b.flatten() for n, b in model.named_buffers() if n.endswith("centroids")])
        both = [torch.empty_like(centroids) for _ in range(2)]
        dist.all_gather(both, centroids)
        if rank == 0:
            torch.save(both, Path(out) / "centroids.pt")
    finally:                        # reference cycles freed while the group lives (see train/distributed.py)
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.slow
def test_state_a_forward_updates_stays_one_model_across_ranks(tmp_path):
    """k-means centroids move with each rank's own rows; after each step every rank holds rank 0's, as DDP."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_buffers_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    first, second = torch.load(tmp_path / "centroids.pt")
    fresh = build(attn_routing=True, attn_routing_clusters=2, attn_routing_window=4)
    initial = torch.cat([b.flatten() for n, b in fresh.named_buffers() if n.endswith("centroids")])
    assert not torch.allclose(first, initial)      # the forwards did move them
    assert torch.equal(first, second)
