"""DeMo and SparseLoCo beside DistributedDataParallel, and BatchNorm buffers, on 2 gloo ranks.

A model wrapped in DDP all-reduces its gradients densely during backward(): beside the optimizers' own
frames that saves nothing. The first step says so (DenseAllReduceError, naming the parameters) unless
the DDP module's hook is gradwire.torch.local_gradients_hook, under which each rank keeps its own
gradient and the optimizers' exchange alone makes the ranks identical. The DDP hook itself takes bf16 and
fp16 buckets. BatchNorm's running statistics are buffers, not parameters: they drift apart until
gradwire.torch.average_buffers (or DDP's buffer broadcast) makes them one.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire
import gradwire.torch as gt
from distributed_toys import all_ranks_equal, flat_parameters, make_model, shard


def _optimizer(which: str, model: nn.Module):
    if which == "demo":
        return gt.DeMo(model.named_parameters(), lr=0.02, beta=0.9)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    return gt.SparseLoCo(model.named_parameters(), inner, sync_every=1)


def my_own_hook(state, bucket):  # unannotated: this file's annotations are strings, which DDP refuses
    return gt.local_gradients_hook(state, bucket)


def _under_ddp_run(rank: int, world: int, which: str, hook: str) -> dict:
    model = make_model()
    ddp = DDP(model)
    if hook == "local":
        assert gt.skip_ddp_all_reduce(ddp) is ddp
    elif hook == "gradwire":
        ddp.register_comm_hook(*gt.ddp_hook(gradwire.DCTCodec(topk=8)))
    elif hook == "custom":  # a hook the check cannot judge: it warns and lets it run
        ddp.register_comm_hook(None, my_own_hook)
    opt = _optimizer(which, model)
    x, y = shard(rank)
    local, losses = True, []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                loss = nn.functional.cross_entropy(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                local &= not all_ranks_equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
                opt.step()
                losses.append(loss.item())
    except gt.DenseAllReduceError as e:
        return dict(error=str(e))
    return dict(
        error=None,
        local=local,
        identical=all_ranks_equal(flat_parameters(model)),
        losses=losses,
        sent=opt.bytes_sent,
        warned=[str(w.message) for w in caught],
    )


@pytest.mark.parametrize("which", ["demo", "sparseloco"])
def test_ddp_that_all_reduces_is_refused_and_the_local_hook_trains(which):
    (r0, r1) = gt.spawn(_under_ddp_run, 2, (which, "default"))
    for r in (r0, r1):
        name = "DeMo" if which == "demo" else "SparseLoCo"
        assert r["error"].startswith(f"{name}: the model is wrapped in DistributedDataParallel"), r
        assert "head.weight" in r["error"] and "local_gradients_hook" in r["error"], r
    (g0, _) = gt.spawn(_under_ddp_run, 2, (which, "gradwire"))
    assert g0["error"] and "comm hook gradwire_hook" in g0["error"], g0
    for r in gt.spawn(_under_ddp_run, 2, (which, "local")):
        assert r["error"] is None, r
        assert r["local"], "DDP still averaged the gradients"
        assert r["identical"] and r["sent"] > 0
        assert r["losses"][-1] < r["losses"][0]


def _hook_dtype_run(rank: int, world: int, dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    model = make_model().to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets, rebuilt after the first step
    state, hook = gt.ddp_hook(gradwire.DCTCodec(topk=8))
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    x, y = shard(rank)
    losses = []
    for _ in range(6):
        loss = nn.functional.cross_entropy(ddp(x.to(dtype)).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = flat_parameters(model)
    return dict(
        identical=all_ranks_equal(params),
        dtype=str(params.dtype),
        losses=losses,
        dense=state.dense_bytes,
        steps=state.steps,
        numel=params.numel(),
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ddp_hook_with_half_precision_buckets(dtype):
    for r in gt.spawn(_hook_dtype_run, 2, (dtype,)):
        assert r["identical"] and r["dtype"] == f"torch.{dtype}"
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        assert r["dense"] == 2 * r["numel"] * r["steps"]  # the buckets are counted at 2 bytes an element


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 48)
        self.norm = nn.BatchNorm1d(48)
        self.head = nn.Linear(48, 8)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.body(x))))


def _buffers_run(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = WithBatchNorm()
    opt = gt.DeMo(model.parameters(), lr=0.02, beta=0.9)
    x, y = shard(rank)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    buffers = lambda: torch.cat([b.reshape(-1).float() for b in model.buffers()])  # noqa: E731
    before = all_ranks_equal(buffers())
    mean = model.norm.running_mean.clone()
    averaged = gt.average_buffers(model)
    return dict(
        params=all_ranks_equal(flat_parameters(model)),
        before=before,
        after=all_ranks_equal(buffers()),
        averaged=averaged,
        moved=not torch.equal(mean, model.norm.running_mean),
    )


def test_batchnorm_buffers_drift_apart_until_averaged():
    for r in gt.spawn(_buffers_run, 2, ()):
        assert r["params"] and not r["before"], r  # parameters identical, running statistics not
        assert r["after"] and r["averaged"] == 2 and r["moved"], r


def test_a_comm_hook_of_unknown_kind_gets_a_warning():
    for r in gt.spawn(_under_ddp_run, 2, ("demo", "custom")):
        assert r["error"] is None and r["identical"], r
        assert any("comm hook my_own_hook" in w and "if it communicates" in w for w in r["warned"]), r["warned"]
