"""A full optimizer state saved by one group size resumes in another (gradwire.torch.reshard): each rank's
buffers become their mean over the old ranks, the owners' residual is cut again whole, and the new group
trains on with bit-identical replicas."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradwire.torch as gt
from distributed_toys import all_ranks_equal, flat_parameters, shard
from test_torch_sharded_exchange import PIECE, _make, _net, _train


def _kw(exchange: str) -> dict:
    return dict(piece_numel=PIECE) if exchange == "sharded" else dict(exchange="all_gather")


def _buffers(share: dict) -> dict[str, torch.Tensor]:
    """A share's per-parameter buffers (DeMo's momenta or SparseLoCo's error buffers), by parameter."""
    return {n: f.get("momentum", f.get("error")) for n, f in share["params"].items() if "momentum" in f or "error" in f}


def _residual(opt, parts: list[dict]) -> dict[str, torch.Tensor]:
    """The owners' residuals of every rank, joined into one per tensor (zeros where none is held)."""
    from gradwire.torch.reshard import _owner_feedback

    pieces = opt._route.pieces_for(len(parts))
    # Every owner's residuals in parameter space (the coefficient domain's by their inverse transform), uncut.
    held = _owner_feedback(
        [p["owner"] for p in parts], pieces, pieces, [q.name for q in pieces.pieces], opt.downlink_codec
    )["residuals"]
    return pieces.join({p.name: held.get(p.name, torch.zeros(p.shape)).reshape(p.shape) for p in pieces.pieces})


def _save(rank: int, world: int, which: str, exchange: str, path: str) -> dict:
    x, y = shard(rank)
    model = _net()
    opt = _make(which, model, **_kw(exchange))
    _train(opt, model, x, y, 4)
    full = opt.full_state_dict()  # collective
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": full}, path)
    dist.barrier()
    return {}


def _resume(rank: int, world: int, which: str, exchange: str, path: str) -> dict:
    saved = torch.load(path, weights_only=True)
    model = _net()
    model.load_state_dict(saved["model"])
    opt = _make(which, model, **_kw(exchange))
    opt.load_state_dict(saved["optimizer"])
    old = saved["optimizer"]["gradwire"]["ranks"]
    now = opt.full_state_dict()["gradwire"]["ranks"]  # collective
    mine = _buffers(now[rank])
    mean_old = {n: torch.stack([_buffers(p)[n] for p in old]).sum(0) / len(old) for n in _buffers(old[0])}
    out = dict(
        world=world,
        buffers=len(mine),
        mean_taken=all(torch.allclose(mine[n], m, atol=1e-7) for n, m in mean_old.items()),
    )
    if exchange == "sharded":
        before, after = _residual(opt, old), _residual(opt, now)
        out["residual_kept"] = all(torch.equal(before[n], after[n]) for n in before)
        out["residual_nonzero"] = any(bool(t.abs().sum() > 0) for t in before.values())
    x, y = shard(rank)
    losses = []
    for _ in range(4):  # SparseLoCo syncs every 2 steps: its replicas agree after a sync
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    out.update(
        identical=all_ranks_equal(flat_parameters(model)), finite=all(map(torch.isfinite, map(torch.tensor, losses)))
    )
    return out


@pytest.mark.parametrize(
    "which, exchange, old_world, new_world",
    [
        ("demo", "sharded", 4, 2),
        ("demo", "sharded", 2, 3),
        ("sparseloco", "sharded", 2, 4),
        ("sparseloco", "all_gather", 4, 2),
    ],
)
def test_a_full_state_saved_by_one_group_size_resumes_in_another(tmp_path, which, exchange, old_world, new_world):
    path = str(tmp_path / "checkpoint.pt")
    gt.spawn(_save, old_world, (which, exchange, path), timeout_s=120)
    for r in gt.spawn(_resume, new_world, (which, exchange, path), timeout_s=120):
        assert r["world"] == new_world and r["buffers"] == 6  # the toy model's 6 tensors
        assert r["mean_taken"], "each new rank's buffers are the old ranks' mean"
        if exchange == "sharded":
            assert r["residual_nonzero"] and r["residual_kept"], "the owners' residual is cut again, whole"
        assert r["identical"] and r["finite"]


def _resume_other_exchange(rank: int, world: int, path: str) -> dict:
    saved = torch.load(path, weights_only=True)
    opt = _make("demo", _net(), exchange="all_gather")
    try:
        opt.load_state_dict(saved["optimizer"])
        return {"refused": None}
    except ValueError as e:
        return {"refused": str(e)}


def test_a_full_state_of_the_other_exchange_is_refused_at_another_group_size(tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    gt.spawn(_save, 2, ("demo", "sharded", path), timeout_s=90)
    (r,) = gt.spawn(_resume_other_exchange, 1, (path,), timeout_s=90)
    assert "saved with exchange='sharded'" in r["refused"]
