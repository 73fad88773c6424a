"""The re-encoded downlink (``RunConfig.publish = "aggregate"``, the default for DeMo and SparseLoCo): the
server publishes one frame — the round's exact robust aggregate plus its error buffer, compressed — so
what a node receives does not grow with the node count; every node still holds the server's weights bit
for bit, and a kill -9 mid-run publishes the bytes of an uninterrupted run."""

from __future__ import annotations

import httpx
import pytest
import torch
from torch import nn

import gradwire
from gradwire import read_frame
from gradwire.aggregation import exact_trimmed_mean
from gradwire.client import GradwireClient, Node
from gradwire.frame import SERVER_SENDER
from gradwire.published import read_published
from gradwire.state import state_hash
from gradwire_server.aggregate import Update
from gradwire_server.config import RunConfig
from gradwire_server.transition import RunState
from live_server import LiveServer
from server_helpers import dct_frame, make_run, random_grads, tiny_state, train_together

CODEC = {"chunk_shape": [64], "topk": 8, "index_coding": "rice", "value_bits": 2}
#: Every version replayed from the last checkpoint after a restart (none written inline).
REPLAY_ENV = {"GRADWIRE_CHECKPOINT_EVERY": "1000", "GRADWIRE_CHECKPOINT_EVERY_VERSION_BELOW_BYTES": "0"}
DEMO = {"algorithm": "demo", "demo": {"lr": 3e-3, "beta": 0.9}}
SPARSELOCO = {
    "algorithm": "sparseloco",
    "sparseloco": {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "inner": {"lr": 1e-2}},
}


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """One server for this module's tests, each on runs of its own (a server's start is most of a small
    test's time; the tests that kill a server start their own)."""
    with LiveServer(tmp_path_factory.mktemp("server-data")) as srv:
        yield srv


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _loss(model: nn.Module, node: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * node + step)
    x = torch.randn(32, 16, generator=g)
    return ((model(x) - (x[:, :4] * 0.5 - x[:, 4:8])) ** 2).mean()


def _train_together(url: str, admin_token: str, config: dict, n_nodes: int, steps: int) -> tuple[list[Node], str]:
    admin = GradwireClient(url, admin_token)
    run_id = admin.create_run({**config, "quorum": n_nodes})
    admin.put_state(run_id, {n: p.detach() for n, p in _model().named_parameters()})
    nodes = []
    for _ in range(n_nodes):
        node_id, token = admin.register_node(run_id)
        nodes.append(Node(GradwireClient(url, token), run_id, _model(), gradwire.DCTCodec(**CODEC), node_id, wait=20))
    train_together(nodes, _loss, steps)
    return nodes, run_id


@pytest.mark.parametrize("config", [DEMO, SPARSELOCO], ids=["demo", "sparseloco"])
def test_nine_nodes_hold_the_servers_weights_bit_for_bit_from_one_reencoded_frame_per_version(live_server, config):
    nodes, run_id = _train_together(live_server.url, live_server.admin_token, config, n_nodes=9, steps=4)
    admin = GradwireClient(live_server.url, live_server.admin_token)
    status = admin.status(run_id)
    versions = 4 // config.get("sparseloco", {}).get("sync_every", 1)
    assert status["version"] == versions and status["config"]["publish"] == "aggregate"
    # Every node checked the weights hash after every version; they end on the server's weights exactly.
    assert {state_hash(n.params) for n in nodes} == {status["weights_hash"]}
    batch = nodes[0].client.published(run_id, 0)
    for v in batch.versions:
        assert v.reencoded_from == 9
        assert len(v.frames) == 1 and v.frames[0].sender == SERVER_SENDER


def test_a_nodes_downlink_stays_the_same_from_3_to_9_nodes_while_verbatim_frames_grow(live_server):
    dense = 4 * sum(p.numel() for p in _model().parameters())

    def per_version(n_nodes: int, publish: str) -> float:
        nodes, _ = _train_together(
            live_server.url, live_server.admin_token, {**DEMO, "publish": publish}, n_nodes=n_nodes, steps=3
        )
        assert all(n.state_loads == 1 for n in nodes)
        return (nodes[0].bytes_received - dense) / 3  # less the one full-state load at the start

    reencoded = {n: per_version(n, "aggregate") for n in (3, 9)}
    verbatim = {n: per_version(n, "frames") for n in (3, 9)}
    # One frame of the downlink codec per version whatever the node count (Rice-coded positions vary a few
    # bytes); verbatim publication carries every node's frame.
    assert reencoded[9] <= 1.05 * reencoded[3]
    assert verbatim[9] >= 2.5 * verbatim[3]


def test_one_bit_both_ways_reencodes_every_coordinate_and_nodes_match_the_server_bit_for_bit(live_server):
    """SparseLoCo with 1-bit SGD's codec up and down (docs/ALGORITHMS.md, "One bit both ways"): the server
    re-encodes the mean of 3 or 6 nodes' sign frames as one sign frame under its own error feedback, so a
    node receives the same bytes per version at either node count, and every node ends on its weights."""
    config = {
        "algorithm": "sparseloco",
        "sparseloco": {"sync_every": 2, "error_decay": 1.0, "inner": {"lr": 1e-2}},
        "uplink": {"codec": "onebit"},
        "downlink": {"codec": "onebit"},
    }
    admin = GradwireClient(live_server.url, live_server.admin_token)
    received = {}
    for n_nodes in (3, 6):
        run_id = admin.create_run({**config, "quorum": n_nodes})
        admin.put_state(run_id, {n: p.detach() for n, p in _model().named_parameters()})
        nodes = []
        for _ in range(n_nodes):
            node_id, token = admin.register_node(run_id)
            nodes.append(
                Node(GradwireClient(live_server.url, token), run_id, _model(), gradwire.OneBit(), node_id, wait=20)
            )
        train_together(nodes, _loss, 6)
        status = admin.status(run_id)
        assert status["version"] == 3
        assert {state_hash(n.params) for n in nodes} == {status["weights_hash"]}
        batch = nodes[0].client.published(run_id, 0)
        for v in batch.versions:
            assert v.reencoded_from == n_nodes and len(v.frames) == 1
            assert {e.codec for e in v.frames[0].entries} == {gradwire.OneBit.codec_id}
        received[n_nodes] = [v.nbytes for v in batch.versions]
        # Every coordinate moves at every version: a sign frame drops none, whatever the node count.
        before = {n: p.detach() for n, p in _model().named_parameters()}
        assert all(bool((nodes[0].params[n] != before[n]).all()) for n in before)
    assert received[3] == received[6]


def test_only_the_robust_aggregate_reaches_the_servers_error_buffer():
    # Median of three: a rogue node scaled by 1e6 moves no coordinate of the aggregate beyond the others.
    cfg = RunConfig.model_validate(
        {
            "algorithm": "demo",
            "aggregation": {"rule": "median"},
            "downlink": {"codec": "dct", "params": {"chunk_shape": [64], "topk": 4}},
        }
    )
    master = tiny_state()
    state = RunState.load(cfg, 0, master, None, {}, torch.device("cpu"))
    grads = [random_grads(i) for i in range(3)]
    grads[2] = {n: t * 1e6 for n, t in grads[2].items()}
    updates = [Update(read_frame(dct_frame(g, 0, i + 1)), 1.0, 0.0, i + 1) for i, g in enumerate(grads)]
    published = state.close(updates)
    (version,) = read_published(published)
    assert version.reencoded_from == 3
    median = exact_trimmed_mean([u.frame.entries for u in updates], trim=1)
    sent = version.mean()
    for name in median:
        # The buffer holds exactly what the median lacked after compression, nothing of the rogue's scale.
        torch.testing.assert_close(state.downlink.residual(name), median[name] - sent[name], rtol=0, atol=0)
        assert float(state.downlink.residual(name).abs().max()) < 100.0


def _published(client: httpx.Client, run) -> tuple[bytes, str]:
    r = client.get(run.url("/updates"), params={"since": 0}, headers=run.admin)
    assert r.status_code == 200, r.text
    return r.content, r.headers["X-Gradwire-Weights-Hash"]


@pytest.mark.parametrize("config", [DEMO, SPARSELOCO], ids=["demo", "sparseloco"])
def test_kill_9_mid_run_publishes_the_bytes_of_an_uninterrupted_run(tmp_path, config):
    rounds, crash_round = 6, 3
    reencode = {**config, "downlink": {"codec": "dct", "params": {"chunk_shape": [64], "topk": 2, "value_bits": 2}}}

    def frame(rnd: int, node_id: int) -> bytes:
        return dct_frame(random_grads(1000 * rnd + node_id), rnd, node_id)

    with LiveServer(tmp_path / "ref") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        ref = make_run(c, srv.admin_token, n_nodes=2, quorum=2, **reencode)
        ref.publish_rounds(frame, 0, rounds)
        want, want_hash = _published(c, ref)

    with LiveServer(tmp_path / "data", env=REPLAY_ENV) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            run = make_run(c, srv.admin_token, n_nodes=2, quorum=2, **reencode)
            run.publish_rounds(frame, 0, crash_round)
            first = run.nodes[0]
            assert run.submit(first, crash_round, frame(crash_round, first.node_id)).status_code == 202
        srv.kill()  # the restart replays versions 1..3 from checkpoint 0, re-running the re-encoding
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            run.client = c
            second = run.nodes[1]
            assert run.submit(second, crash_round, frame(crash_round, second.node_id)).status_code == 202
            run.wait_version(crash_round + 1)
            run.publish_rounds(frame, crash_round + 1, rounds)
            got, got_hash = _published(c, run)
            srv.stop()

    assert [v.reencoded_from for v in read_published(got)] == [2] * rounds
    assert got == want, "the restarted run published other bytes than the uninterrupted one"
    assert got_hash == want_hash
