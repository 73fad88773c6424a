"""The optimizers' state through ``torch.distributed.checkpoint`` (DCP), as FSDP2 and torchtitan save it:
per-parameter state in torch's ``"state"``, which DCP keeps (it drops anything else), and a group of
another size resumes from it. DCP takes non-DTensor state as replicated and keeps one rank's copy of each
tensor, so every rank resumes with the same buffers; the owners' error feedback and the byte counters
start afresh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import gradwire.torch as gt
from distributed_toys import all_ranks_equal, flat_parameters, shard
from test_torch_sharded_exchange import PIECE, _make, _net, _train


def _momenta(opt) -> dict[str, torch.Tensor]:
    share = opt.full_state_dict()["gradwire"]["ranks"][dist.get_rank()]  # collective
    return {n: f.get("momentum", f.get("error")) for n, f in share["params"].items() if "momentum" in f or "error" in f}


def _save(rank: int, world: int, which: str, path: str) -> dict:
    x, y = shard(rank)
    model = _net()
    opt = _make(which, model, piece_numel=PIECE)
    _train(opt, model, x, y, 4)
    before = (
        flat_parameters(model).clone(),
        _momenta(opt),
        getattr(opt, "steps", None),
        getattr(opt, "local_steps", None),
    )
    osd = get_optimizer_state_dict(model, opt)
    after = (flat_parameters(model), _momenta(opt), getattr(opt, "steps", None), getattr(opt, "local_steps", None))
    untouched = (
        torch.equal(before[0], after[0])
        and before[2:] == after[2:]
        and all(torch.equal(before[1][n], after[1][n]) for n in before[1])
    )
    dcp.save({"model": model.state_dict(), "optim": osd}, checkpoint_id=path)
    saved = [_momenta(opt)]
    gathered = [None] * world
    dist.all_gather_object(gathered, {n: t.tolist() for n, t in saved[0].items()})
    return dict(untouched=untouched, keys=sorted({k for f in osd["state"].values() for k in f}), momenta=gathered)


def _load(rank: int, world: int, which: str, path: str) -> dict:
    model = _net()
    opt = _make(which, model, piece_numel=PIECE)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = {n: t.tolist() for n, t in _momenta(opt).items()}
    x, y = shard(rank)
    _train(opt, model, x, y, 4)
    return dict(
        loaded=loaded,
        identical=all_ranks_equal(flat_parameters(model)),
        steps=getattr(opt, "steps", getattr(opt, "local_steps", None)),
    )


@pytest.mark.parametrize("which, new_world", [("demo", 2), ("demo", 3), ("sparseloco", 3)])
def test_dcp_saves_the_per_parameter_state_and_any_group_size_resumes_from_it(tmp_path, which, new_world):
    path = str(tmp_path / "dcp")
    saved = gt.spawn(_save, 2, (which, path), timeout_s=120)
    for r in saved:
        assert r["untouched"], "get_optimizer_state_dict must not step an optimizer that has state"
        assert ("momentum" if which == "demo" else "error") in r["keys"] and "step" in r["keys"]
    per_rank = saved[0]["momenta"]
    loads = gt.spawn(_load, new_world, (which, path), timeout_s=120)
    for r in loads:
        # DCP keeps one rank's copy of each tensor (which rank, its planner's choice): every tensor resumes
        # as one saved rank held it, the same on every new rank.
        assert set(r["loaded"]) == set(per_rank[0])
        assert all(r["loaded"][n] in [m[n] for m in per_rank] for n in r["loaded"])
        assert r["loaded"] == loads[0]["loaded"]
        assert r["identical"]
        assert r["steps"] == 8  # 4 saved, 4 more


def _fsdp_round_trip(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from test_torch_fsdp import _batch, _loss, _sharded

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))

    def build():
        model = _sharded(mesh["shard"])
        return model, gt.DeMo(model.parameters(), lr=3e-3, process_group=mesh.get_group("replicate"))

    model, opt = build()
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    osd = get_optimizer_state_dict(model, opt)
    momenta = [f["momentum"] for f in osd["state"].values()]
    saved = {k: f["momentum"].to_local().clone() for k, f in osd["state"].items()}
    dcp.save({"model": model.state_dict(), "optim": osd}, checkpoint_id=path)
    fresh, fresh_opt = build()
    state = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    loaded = get_optimizer_state_dict(fresh, fresh_opt)["state"]
    return dict(
        dtensors=all(isinstance(m, DTensor) for m in momenta),
        same=all(torch.equal(loaded[k]["momentum"].to_local(), saved[k]) for k in saved),
        steps=fresh_opt.steps,
    )


def test_fsdp2_momenta_go_through_dcp_as_dtensors_shard_by_shard(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    for r in gt.spawn(_fsdp_round_trip, 2, (str(tmp_path / "dcp"),), timeout_s=120):
        assert r["dtensors"] and r["same"] and r["steps"] == 3
