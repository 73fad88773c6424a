"""gradwire.torch.LowPrecisionDecentralized (Bagua's algorithm) on real gloo process groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwire
import gradwire.torch as gt
from distributed_toys import flat_parameters, gather, make_model, shard


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _ring(rank: int, world: int, steps: int) -> dict:
    model = make_model(seed=rank)  # different on every rank: the broadcast makes them equal
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    algo = gt.LowPrecisionDecentralized(model, opt)  # ring, MinMax uint8
    # What this rank's frames say, summed on top of its start: all any peer can know of it.
    from_frames = flat_parameters(model).clone()
    x, y = shard(rank)
    losses = []
    replicas_match = True
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        algo.step()
        losses.append(loss.item())
        from_frames.add_(gradwire.decode(algo.last_frame))
        models = gather(flat_parameters(model))
        replicas_match &= all(torch.equal(_flat(algo.replica(p).values()), models[p]) for p in algo.peers)
    models = gather(flat_parameters(model))
    return dict(
        losses=losses,
        replicas_match=replicas_match,
        own_is_sum_of_frames=torch.equal(from_frames, flat_parameters(model)),
        spread=max(float((m - models[0]).abs().max()) for m in models),
        scale=float(models[0].abs().max()),
        codec=type(algo.codec).__name__,
        peers=list(algo.peers),
        frame_bytes=algo.frame_bytes_per_step(),
        sent_bytes=algo.sent_bytes_per_step(),
        dense_bytes=4 * models[0].numel(),
    )


def test_ring_converges_and_replicas_equal_what_peers_sent():
    steps = 30
    results = gt.spawn(_ring, 3, (steps,))
    for rank, r in enumerate(results):
        assert r["codec"] == "MinMaxUInt8"
        assert sorted(r["peers"]) == sorted({(rank - 1) % 3, (rank + 1) % 3})
        assert sum(r["losses"][-5:]) / 5 < 0.8 * r["losses"][0], r["losses"]
        # Each worker's model is its start plus exactly what its frames carried, and every peer's
        # replica of it is that same tensor, bit for bit.
        assert r["own_is_sum_of_frames"]
        assert r["replicas_match"]
        # The workers agree closely (each sees different data, so not exactly).
        assert r["spread"] < 0.1 * r["scale"], r
        # One byte per element plus per-chunk ranges and framing, against 4 bytes dense; to each peer.
        assert r["frame_bytes"] < 0.27 * r["dense_bytes"], r
        assert r["sent_bytes"] == 2 * (r["frame_bytes"] + 8)


def _exact_step(rank: int, world: int, steps: int) -> dict:
    """With an exact codec and two workers, a step is x ← (x_0 + x_1)/2 − γ g, computed here by hand."""
    lr = 0.3
    model = make_model(seed=rank)
    algo = gt.LowPrecisionDecentralized(model, codec=gradwire.IdentityCodec(), lr=lr, broadcast_parameters=False)
    x, y = shard(rank)
    worst = 0.0
    identical_replica = True
    for _ in range(steps):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        both = gather(flat_parameters(model))
        expected = (both[0] + both[1]) / 2 - lr * _flat(p.grad for p in model.parameters())
        algo.step()
        worst = max(worst, float((flat_parameters(model) - expected).abs().max()))
        other = 1 - rank
        identical_replica &= torch.equal(_flat(algo.replica(other).values()), gather(flat_parameters(model))[other])
    return dict(worst=worst, identical_replica=identical_replica, weights=algo.weights)


def test_exact_codec_two_workers_follow_the_formula():
    for r in gt.spawn(_exact_step, 2, (5,)):
        assert r["weights"] == {"0": 0.5, "1": 0.5}
        assert r["worst"] < 1e-6, r
        assert r["identical_replica"]


STAR = {0: [1, 2], 1: [0], 2: [0]}


def _gossip_only(rank: int, world: int, steps: int) -> dict:
    """No gradient (lr 0): pure mixing of different starting models over a star graph."""
    model = make_model(seed=rank)
    algo = gt.LowPrecisionDecentralized(
        model, peers=STAR, codec=gradwire.IdentityCodec(), lr=0.0, broadcast_parameters=False
    )
    before = gather(flat_parameters(model))
    for _ in range(steps):
        algo.step()
    after = gather(flat_parameters(model))
    mean_before, mean_after = torch.stack(before).mean(0), torch.stack(after).mean(0)
    return dict(
        weights=algo.weights,
        mean_drift=float((mean_after - mean_before).abs().max()),
        spread_before=max(float((m - mean_before).abs().max()) for m in before),
        spread_after=max(float((m - mean_after).abs().max()) for m in after),
    )


def test_star_graph_weights_keep_the_mean_and_reach_consensus():
    results = gt.spawn(_gossip_only, 3, (20,))
    # Metropolis–Hastings: W_ij = 1 / (1 + max(deg_i, deg_j)); uniform 1/(1+deg) would give the leaves
    # 1/2 and move the workers' mean.
    assert results[0]["weights"] == pytest.approx({"0": 1 / 3, "1": 1 / 3, "2": 1 / 3})
    assert results[1]["weights"] == pytest.approx({"0": 1 / 3, "1": 2 / 3})
    for r in results:
        assert r["mean_drift"] < 1e-6, r
        assert r["spread_after"] < 0.05 * r["spread_before"], r


def _asymmetric(rank: int, world: int) -> str:
    try:
        gt.LowPrecisionDecentralized(make_model(), lr=0.1, peers={0: [1], 1: [2], 2: [0]})
    except ValueError as e:
        return str(e)
    return ""


def test_asymmetric_peer_graph_is_refused_on_every_rank():
    for message in gt.spawn(_asymmetric, 3):
        assert "symmetric" in message


def test_ring_peers():
    assert gt.ring_peers(0, 4) == (1, 3)
    assert gt.ring_peers(1, 2) == (0,)
    assert gt.ring_peers(0, 1) == ()


def test_needs_exactly_one_of_optimizer_and_lr():
    model = make_model()
    with pytest.raises(ValueError, match="optimizer, or lr"):
        gt.LowPrecisionDecentralized(model)
    with pytest.raises(ValueError, match="lr is the step"):
        gt.LowPrecisionDecentralized(model, torch.optim.SGD(model.parameters(), lr=0.1), lr=0.1)


def _ring_on_gpus(rank: int, world: int, steps: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    model = make_model(seed=rank).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    algo = gt.LowPrecisionDecentralized(model, opt)
    x, y = (t.to(device) for t in shard(rank))
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        algo.step()
        losses.append(loss.item())
    models = gather(flat_parameters(model))
    match = all(torch.equal(_flat(algo.replica(p).values()), models[p]) for p in algo.peers)
    return dict(losses=losses, replicas_match=match)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ring_on_nccl():
    for r in gt.spawn(_ring_on_gpus, 2, (20,), backend="nccl"):
        assert r["replicas_match"]
        assert r["losses"][-1] < r["losses"][0]
