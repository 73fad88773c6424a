"""Aggregation rules: unit level on gradwire_server.aggregate, and a rogue node against the real server."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

import gradwire
from gradwire.client import split_frames
from gradwire.state import apply_update, state_hash
from gradwire_server.aggregate import Update, aggregate, clip_factors
from live_server import LiveServer
from server_helpers import dct_frame, dense_frame, make_run

SHAPES = {"w": (24, 40), "b": (24,)}
NAMES = sorted(SHAPES)


def _grads(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def _update(grads, node_id, codec="dct", weight=1.0):
    make = dct_frame if codec == "dct" else dense_frame
    frame = gradwire.read_frame(make(grads, 0, node_id, topk=16) if codec == "dct" else make(grads, 0, node_id))
    norm = sum(gradwire.accumulate.entry_norm(e) ** 2 for e in frame.entries) ** 0.5
    return Update(frame, weight=weight, norm=norm, node_id=node_id)


def _decoded(update):
    return {n: t.to(torch.float32) for n, t in gradwire.decode_bundle(update.frame).items()}


def _flat(d):
    return torch.cat([d[n].reshape(-1) for n in NAMES])


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(_flat(a), _flat(b), dim=0))


# -- unit level ---------------------------------------------------------------------------------


def test_mean_in_the_dct_domain_equals_the_dense_mean():
    ups = [_update(_grads(i), i + 1, weight=w) for i, w in enumerate([1.0, 1.0, 0.5, 0.25])]
    got = aggregate(ups, NAMES, "mean")
    dec = [_decoded(u) for u in ups]
    total = sum(u.weight for u in ups)
    for n in NAMES:
        want = sum(d[n] * u.weight for d, u in zip(dec, ups)) / total
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-6)


def test_clip_factors_scale_to_the_median_norm():
    # median of {0, 1, 2, 3, 300} is 2
    assert clip_factors([1.0, 2.0, 3.0, 300.0, 0.0]) == [1.0, 1.0, pytest.approx(2 / 3), pytest.approx(2 / 300), 1.0]
    assert clip_factors([4.0, 1.0]) == [pytest.approx(2.5 / 4.0), 1.0]


def test_clipped_mean_equals_the_mean_of_clipped_dense_updates():
    ups = [_update(_grads(i, scale=s), i + 1) for i, s in enumerate([1.0, 2.0, 0.5, 50.0])]
    got = aggregate(ups, NAMES, "clipped_mean")
    dense = [_decoded(u) for u in ups]
    # The server's norms come from the DCT coefficients (Parseval); "w" has no padding, so there they
    # equal the dense norms; "b" (24 values in chunks of 64) is padded, where they bound them from above.
    norms = [u.norm for u in ups]
    for u, d in zip(ups, dense):
        assert float(d["w"].norm()) == pytest.approx(gradwire.accumulate.entry_norm(u.entries()["w"]), rel=1e-5)
        assert float(_flat(d).norm()) <= u.norm * (1 + 1e-6)
    med = float(np.median(norms))
    for n in NAMES:
        want = sum(d[n] * min(1.0, med / nm) for d, nm in zip(dense, norms)) / len(ups)
        torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("codec", ["dct", "identity"])
def test_trimmed_mean_and_median_match_numpy(codec):
    from scipy import stats

    ups = [_update(_grads(i), i + 1, codec=codec) for i in range(7)]
    stacked = {n: np.stack([_decoded(u)[n].numpy() for u in ups]) for n in NAMES}
    trimmed = aggregate(ups, NAMES, "trimmed_mean", trim_fraction=0.3)  # floor(0.3 * 7) = 2 each side
    median = aggregate(ups, NAMES, "median")
    for n in NAMES:
        np.testing.assert_allclose(trimmed[n].numpy(), stats.trim_mean(stacked[n], 2 / 7, axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(median[n].numpy(), np.median(stacked[n], axis=0), rtol=1e-6, atol=1e-7)
    even = aggregate(ups[:4], NAMES, "median")
    for n in NAMES:
        np.testing.assert_allclose(even[n].numpy(), np.median(stacked[n][:4], axis=0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rogue", ["scaled", "random"])
def test_robust_rules_stay_on_course_against_one_rogue_node(rogue):
    true = _grads(100)
    honest = [{n: true[n] + 0.3 * g for n, g in _grads(200 + i).items()} for i in range(4)]
    if rogue == "scaled":
        bad = {n: -1000.0 * honest[0][n] for n in NAMES}
    else:
        bad = _grads(999, scale=1000.0)
    ups = [_update(g, i + 1) for i, g in enumerate(honest + [bad])]
    honest_mean = aggregate(ups[:4], NAMES, "mean")
    assert _cos(aggregate(ups, NAMES, "mean"), honest_mean) < 0.5  # the plain mean is hijacked
    for rule in ("clipped_mean", "trimmed_mean", "median"):
        assert _cos(aggregate(ups, NAMES, rule, trim_fraction=0.2), honest_mean) > 0.9, rule


def test_aggregation_is_deterministic_and_order_fixed_by_the_caller():
    ups = [_update(_grads(i), i + 1) for i in range(5)]
    for rule in ("mean", "clipped_mean", "trimmed_mean", "median"):
        a, b = aggregate(ups, NAMES, rule), aggregate(ups, NAMES, rule)
        assert all(torch.equal(a[n], b[n]) for n in NAMES)


def test_single_update_and_errors():
    up = _update(_grads(1), 1)
    for rule in ("mean", "clipped_mean", "trimmed_mean", "median"):
        got = aggregate([up], NAMES, rule)
        torch.testing.assert_close(got["w"], _decoded(up)["w"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        aggregate([], NAMES)
    with pytest.raises(ValueError):
        aggregate([up], NAMES, "mode")


# -- through the real server --------------------------------------------------------------------

MODEL = {"w": (8, 16), "b": (8,)}


def _regression(seed=0, n=256):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(8, 16, generator=g)
    b_true = torch.randn(8, generator=g)
    x = torch.randn(n, 16, generator=g)
    return x, x @ w_true.T + b_true


def _loss_and_grads(state, x, y):
    w = state["w"].clone().requires_grad_(True)
    b = state["b"].clone().requires_grad_(True)
    loss = ((x @ w.T + b - y) ** 2).mean()
    loss.backward()
    return float(loss.detach()), {"w": w.grad, "b": b.grad}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("aggregation")) as srv:
        yield srv


@pytest.mark.parametrize(
    "rule,rogue,should_train",
    [
        ("clipped_mean", "scaled", True),
        ("median", "random", True),
        ("trimmed_mean", "scaled", True),
        ("mean", "scaled", False),
    ],
)
def test_training_through_the_server_with_a_rogue_node(server, rule, rogue, should_train):
    x, y = _regression()
    shards = list(zip(x.chunk(4), y.chunk(4)))
    init = {"w": torch.zeros(8, 16), "b": torch.zeros(8)}
    codec = {"codec": "dct", "params": {"chunk_shape": [64], "topk": 32}}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        run = make_run(
            client,
            server.admin_token,
            n_nodes=5,
            state=init,
            quorum=5,
            uplink=codec,
            downlink=codec,
            optimizer={"lr": 0.1, "weight_decay": 0.0},
            aggregation={"rule": rule, "trim_fraction": 0.2},
        )
        replica = {n: t.clone() for n, t in init.items()}
        feedback = [gradwire.ErrorFeedback(gradwire.DCTCodec(chunk_shape=(64,), topk=32)) for _ in range(4)]
        first = _loss_and_grads(replica, x, y)[0]
        g = torch.Generator().manual_seed(5)
        for rnd in range(12):
            for i, node in enumerate(run.nodes):
                if i < 4:
                    _, grads = _loss_and_grads(replica, *shards[i])
                    frame = feedback[i].encode_bundle(grads, round=rnd, sender=node.node_id)
                else:
                    _, grads = _loss_and_grads(replica, x, y)
                    if rogue == "scaled":
                        bad = {n: -1000.0 * t for n, t in grads.items()}
                    else:
                        bad = {n: torch.randn(t.shape, generator=g) * 1000.0 for n, t in grads.items()}
                    frame = dense_frame(bad, rnd, node.node_id)
                assert run.submit(node, rnd, frame).status_code == 202
            r = run.wait_version(rnd + 1)
            for f in split_frames(r.content):
                apply_update(replica, gradwire.decode_bundle(f))
            assert state_hash(replica) == r.headers["X-Gradwire-Weights-Hash"]
        last = _loss_and_grads(replica, x, y)[0]
    if should_train:
        assert last < 0.5 * first, (rule, rogue, first, last)
    else:
        assert last > 0.9 * first, (rule, rogue, first, last)  # the plain mean follows the rogue
