"""gradwire.torch.powersgd_hook against torch's own powerSGD_hook, on real gloo process groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire.torch as gt
from distributed_toys import all_ranks_equal, flat_parameters, make_model, shard
from gradwire.lowrank import orthogonalize_ as orthogonalize


def _train(model: DDP, rank: int, steps: int, *, check_identical: bool = False) -> tuple[list[float], bool]:
    x, y = shard(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, identical = [], True
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if check_identical:
            identical &= all_ranks_equal(flat_parameters(model.module))
    return losses, identical


def _ours_vs_torch(rank: int, world: int, approx_rank: int, steps: int, start: int) -> dict:
    # One bucket (DDP's default cap): torch's hook issues its later all-reduces from future
    # callbacks, which with several buckets on gloo may interleave differently on different ranks.
    theirs = DDP(make_model())
    torch_state = torch_powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=approx_rank, start_powerSGD_iter=start, min_compression_rate=1
    )
    theirs.register_comm_hook(torch_state, torch_powersgd.powerSGD_hook)
    ours = DDP(make_model())
    state = gt.PowerSGDState(rank=approx_rank, start_iter=start, min_compression_rate=1)
    ours.register_comm_hook(state, gt.powersgd_hook)

    their_losses, _ = _train(theirs, rank, steps)
    our_losses, identical = _train(ours, rank, steps, check_identical=True)
    dense = sum(p.numel() for p in ours.parameters())
    _, _, their_compressed = torch_state.compression_stats()
    return dict(
        loss_gap=max(abs(a - b) for a, b in zip(their_losses, our_losses)),
        param_gap=float((flat_parameters(theirs.module) - flat_parameters(ours.module)).abs().max()),
        identical=identical,
        ours_bytes=state.bytes_sent,
        # torch counts elements once compression starts; the dense warm-up steps send every element.
        their_bytes=4 * (their_compressed + start * dense),
        dense_bytes=4 * dense * steps,
        first=our_losses[0],
        last=our_losses[-1],
    )


@pytest.mark.parametrize("approx_rank, world", [(1, 2), (4, 3)], ids=["rank1-2ranks", "rank4-qr-3ranks"])
def test_matches_torch_powersgd_hook(approx_rank, world):
    for r in gt.spawn(_ours_vs_torch, world, (approx_rank, 20, 2)):
        # Same arithmetic and the same seeded first Q: the two runs agree to float rounding.
        assert r["loss_gap"] < 1e-5, r
        assert r["param_gap"] < 1e-5, r
        assert r["identical"]
        assert r["ours_bytes"] == r["their_bytes"]
        assert r["ours_bytes"] < r["dense_bytes"] / 2
        assert r["last"] < 0.85 * r["first"]


def _from_iteration_zero(rank: int, world: int, steps: int) -> dict:
    # Small buckets: DDP regroups them after iteration 0; state is kept per parameter, so PowerSGD
    # may run from the start (torch's hook refuses start_powerSGD_iter < 2).
    model = DDP(make_model(), bucket_cap_mb=0.001)
    state = gt.PowerSGDState(rank=2, start_iter=0)
    model.register_comm_hook(state, gt.powersgd_hook)
    losses, identical = _train(model, rank, steps, check_identical=True)
    dense = 4 * sum(p.numel() for p in model.parameters())
    return dict(losses=losses, identical=identical, per_step=state.bytes_per_step(), dense=dense, iters=state.iter)


def test_compresses_from_iteration_zero_across_bucket_rebuild():
    steps = 25
    for r in gt.spawn(_from_iteration_zero, 3, (steps,)):
        assert r["identical"]
        assert r["iters"] == steps
        assert r["per_step"] < r["dense"] / 4, r
        assert sum(r["losses"][-5:]) / 5 < 0.8 * r["losses"][0], r["losses"]


@pytest.mark.parametrize("r", [1, 2, 4])
def test_orthogonalize_gives_orthonormal_columns(r):
    m = torch.randn(40, r, generator=torch.Generator().manual_seed(r))
    q = orthogonalize(m.clone())
    assert torch.allclose(q.t() @ q, torch.eye(r), atol=1e-5)
    # Same column space: projecting m onto q's columns gives m back.
    assert torch.allclose(q @ (q.t() @ m), m, atol=1e-4)


def test_orthogonalize_keeps_a_zero_column_finite():
    m = torch.zeros(10, 2)
    m[:, 1] = 1.0
    q = orthogonalize(m)
    assert torch.isfinite(q).all()
    assert q[:, 0].abs().sum() == 0


def test_state_rejects_bad_hyperparameters():
    with pytest.raises(ValueError):
        gt.PowerSGDState(rank=0)
    with pytest.raises(ValueError):
        gt.PowerSGDState(start_iter=-1)


def _on_gpus(rank: int, world: int, steps: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    model = DDP(make_model().to(device), device_ids=[device.index], bucket_cap_mb=0.001)
    state = gt.PowerSGDState(rank=2, start_iter=0)
    model.register_comm_hook(state, gt.powersgd_hook)
    x, y = (t.to(device) for t in shard(rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, identical = [], True
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        identical &= all_ranks_equal(flat_parameters(model.module))
    return dict(losses=losses, identical=identical)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_powersgd_on_nccl():
    for r in gt.spawn(_on_gpus, 2, (20,), backend="nccl"):
        assert r["identical"]
        assert r["losses"][-1] < r["losses"][0]
