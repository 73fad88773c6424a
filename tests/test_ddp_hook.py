"""gradwire.torch.ddp_hook on real gloo process groups (2–3 local ranks, forked)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire
import gradwire.torch as gt
from distributed_toys import all_ranks_equal, flat_parameters, gather, make_model, shard
from gradwire.frame import Limits

# Small buckets, so DDP's rebuild after iteration 0 regroups the parameters into two buckets.
BUCKET_MB = 0.001


def _train(model: DDP, rank: int, steps: int, lr: float = 0.2) -> list[float]:
    x, y = shard(rank)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _identity_parity(rank: int, world: int, steps: int, per_parameter: bool) -> dict:
    plain = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
    hooked = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
    state, hook = gt.ddp_hook(gradwire.IdentityCodec(), per_parameter=per_parameter)
    hooked.register_comm_hook(state, hook)
    plain_losses = _train(plain, rank, steps)
    hooked_losses = _train(hooked, rank, steps)
    a, b = flat_parameters(plain.module), flat_parameters(hooked.module)
    moved = flat_parameters(make_model())
    return dict(
        max_diff=float((a - b).abs().max()),
        moved=float((b - moved).abs().max()),
        identical=all_ranks_equal(b),
        loss_diff=max(abs(p - h) for p, h in zip(plain_losses, hooked_losses)),
        steps=state.steps,
        bytes_sent=state.bytes_sent,
        numel=b.numel(),
    )


@pytest.mark.parametrize("world, per_parameter", [(2, False), (3, False), (2, True)])
def test_identity_hook_matches_plain_ddp(world, per_parameter):
    steps = 6
    results = gt.spawn(_identity_parity, world, (steps, per_parameter))
    for r in results:
        assert r["moved"] > 1e-3  # training did move the weights
        assert r["max_diff"] < 1e-6, r
        assert r["loss_diff"] < 1e-6, r
        assert r["identical"]
        assert r["steps"] == steps
        # fp32 values travel as they are: at least 4 bytes per parameter per step, plus framing.
        assert 4 * r["numel"] * steps < r["bytes_sent"] < 4 * r["numel"] * steps + 600 * steps


def _codec_run(rank: int, world: int, codec_name: str, params: dict, steps: int) -> dict:
    model = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
    state, hook = gt.ddp_hook(codec_name, **params)
    model.register_comm_hook(state, hook)
    x, y = shard(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, identical = [], True
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        identical &= all_ranks_equal(flat_parameters(model.module))
    return dict(
        losses=losses,
        identical=identical,
        ratio=state.compression_ratio(),
        wire=state.wire_bytes_per_step(),
        dense=state.dense_bytes / state.steps,
    )


@pytest.mark.parametrize(
    "codec_name, params, min_ratio",
    [
        ("dct", dict(chunk_shape=(256,), topk=16), 8.0),
        ("dct", dict(mode="tiles", topk=4), 4.0),
        ("3lc", dict(), 6.0),
        ("3lc", dict(per_parameter=True), 6.0),
        ("topk", dict(density=0.05, scope="global", per_parameter=True), 8.0),
    ],
    ids=["dct-flat", "dct-tiles", "3lc", "3lc-per-parameter", "global-topk-per-parameter"],
)
def test_lossy_codec_replicas_bit_identical_and_loss_decreases(codec_name, params, min_ratio):
    steps = 25
    results = gt.spawn(_codec_run, 3, (codec_name, params, steps))
    for r in results:
        assert r["identical"], "parameters differ between ranks after some step"
        losses = r["losses"]
        assert sum(losses[-5:]) / 5 < 0.8 * losses[0], losses
        assert r["ratio"] > min_ratio, r
        assert r["wire"] < r["dense"] / min_ratio


def _feedback_conservation(rank: int, world: int, steps: int) -> dict:
    """Σ_t (averaged gradient) = mean over ranks of (Σ_t local gradient − residual), per parameter.

    Error feedback only delays what a codec drops; if the bucket rebuild after iteration 0 lost a
    residual, the two sides would differ by it.
    """
    model = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
    state, hook = gt.ddp_hook(gradwire.DCTCodec(chunk_shape=(64,), topk=4))
    model.register_comm_hook(state, hook)
    local = copy.deepcopy(model.module)
    x, y = shard(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.module.parameters())
    averaged = [torch.zeros_like(p) for p in params]
    local_sum = [torch.zeros_like(p) for p in params]
    bucket_counts = []
    for _ in range(steps):
        local.load_state_dict(model.module.state_dict())
        grads = torch.autograd.grad(nn.functional.cross_entropy(local(x), y), list(local.parameters()))
        for acc, g in zip(local_sum, grads):
            acc += g
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for acc, p in zip(averaged, params):
            acc += p.grad
        opt.step()
        bucket_counts.append(len(state.feedback.names()))
    worst = 0.0
    for p, avg, g in zip(params, averaged, local_sum):
        expected = g - state.parameter_residual(p)
        dist.all_reduce(expected)
        expected /= world
        worst = max(worst, float((avg - expected).abs().max() / avg.abs().max()))
    return dict(worst=worst, rebuilds=state.residual_rebuilds, buckets=bucket_counts)


def test_error_feedback_survives_bucket_rebuild():
    results = gt.spawn(_feedback_conservation, 2, (6,))
    for r in results:
        assert r["buckets"][0] == 1 and r["buckets"][-1] == 2, r  # the rebuild did regroup
        assert r["rebuilds"] >= 1
        assert r["worst"] < 1e-5, r


def _exchange(rank: int, world: int) -> dict:
    payload = bytes([rank]) * (rank * 7)  # rank 0 sends nothing
    got = gt.all_gather_bytes(payload)
    ok = [bytes(a) == bytes([r]) * (r * 7) for r, a in enumerate(got)]
    try:
        gt.all_gather_bytes(b"x" * (100 + rank), limits=Limits(max_frame_bytes=100))
        refused = ""
    except gradwire.FrameError as e:
        refused = str(e)
    return dict(ok=ok, padded=got.bytes_out, refused=refused)


def test_all_gather_bytes_uneven_lengths_and_limit():
    results = gt.spawn(_exchange, 3)
    for r in results:
        assert r["ok"] == [True, True, True]
        assert r["padded"] == 8 + 14
        # Rank 0's 100 bytes are within the limit, rank 1's 101 are not: every rank refuses.
        assert "rank 1" in r["refused"] and "limit" in r["refused"]


def test_subpackage_does_not_shadow_torch():
    import gradwire.codecs.base as base
    import gradwire.frame as frame

    assert gradwire.torch is gt
    assert base.torch is torch and frame.torch is torch
    assert gradwire.decode(gradwire.IdentityCodec().encode(torch.ones(3))).tolist() == [1.0, 1.0, 1.0]


def test_hook_rejects_codec_params_with_an_instance():
    with pytest.raises(TypeError):
        gt.ddp_hook(gradwire.DCTCodec(), topk=3)


def _nccl_run(rank: int, world: int, steps: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    model = DDP(make_model().to(device), device_ids=[device.index], bucket_cap_mb=BUCKET_MB)
    state, hook = gt.ddp_hook(gradwire.DCTCodec(chunk_shape=(256,), topk=16))
    model.register_comm_hook(state, hook)
    x, y = (t.to(device) for t in shard(rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = flat_parameters(model.module)
    return dict(losses=losses, identical=all(torch.equal(params, p) for p in gather(params)))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_dct_hook_on_nccl():
    for r in gt.spawn(_nccl_run, 2, (20,), backend="nccl"):
        assert r["identical"]
        assert r["losses"][-1] < r["losses"][0]


def _desynchronized(rank: int, world: int) -> str:
    model = DDP(make_model())
    state, hook = gt.ddp_hook("dct", chunk_shape=(256,), topk=16)
    model.register_comm_hook(state, hook)
    if rank == 1:
        state.steps = 7  # this rank believes it is at another step: its frames say round 7
    x, y = shard(rank)
    try:
        nn.functional.cross_entropy(model(x), y).backward()
    except Exception as e:  # raised inside DDP's reducer, surfaced by backward()
        return f"{type(e).__name__}: {e}"
    return ""


def test_frames_from_another_round_are_refused_on_every_rank():
    for message in gt.spawn(_desynchronized, 2):
        assert "FrameError" in message or "rank 1 sent" in message, message
        assert "round 7" in message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dct_hook_on_one_gpu_nccl():
    # A group of one on NCCL still runs every device path: frames gathered on the GPU, decoded there.
    (r,) = gt.spawn(_nccl_run, 1, (20,), backend="nccl")
    assert r["identical"]
    assert r["losses"][-1] < r["losses"][0]


def _limit_broken(rank: int, world: int) -> str:
    model = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
    state, hook = gt.ddp_hook("dct", chunk_shape=(64,), topk=8)
    model.register_comm_hook(state, hook)
    x, y = shard(rank)
    nn.functional.cross_entropy(model(x), y).backward()
    # From the second step on (after DDP's rebuild: two buckets) every frame is over the limit, the
    # frames of a bucket before the last included.
    state.limits = Limits(max_frame_bytes=64)
    try:
        nn.functional.cross_entropy(model(x), y).backward()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def test_frames_over_the_limit_fail_backward_on_every_rank():
    for message in gt.spawn(_limit_broken, 2):
        assert "FrameError" in message and "limit" in message, message
