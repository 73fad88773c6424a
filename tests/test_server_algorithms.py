"""DeMo and SparseLoCo through the server: nodes in sync with it after every version, a late joiner that
gets the outer momentum, and a kill -9 between syncs that loses nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwire
from gradwire.client import GradwireClient, Node
from gradwire.state import state_hash
from live_server import LiveServer
from server_helpers import train_together

CODEC = {"chunk_shape": [64], "topk": 8, "index_coding": "rice", "value_bits": 2}


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """One server for this module's tests, each on runs of its own (a server's start is most of a small
    test's time; the tests that kill a server start their own)."""
    with LiveServer(tmp_path_factory.mktemp("server-data")) as srv:
        yield srv


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(node: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * node + step)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4] * 0.5 - x[:, 4:8]


def _loss(model: nn.Module, node: int, step: int) -> torch.Tensor:
    x, y = _batch(node, step)
    return ((model(x) - y) ** 2).mean()


def _run(url: str, admin_token: str, config: dict) -> tuple[GradwireClient, str]:
    admin = GradwireClient(url, admin_token)
    run_id = admin.create_run(config)
    admin.put_state(run_id, {n: p.detach() for n, p in _model().named_parameters()})
    return admin, run_id


def _node(url: str, admin: GradwireClient, run_id: str) -> Node:
    node_id, token = admin.register_node(run_id)
    return Node(GradwireClient(url, token), run_id, _model(), gradwire.DCTCodec(**CODEC), node_id, wait=10)


def _together(nodes: list[Node], steps: int) -> None:
    train_together(nodes, _loss, steps, timeout=120)


def test_demo_nodes_hold_the_servers_weights_after_every_version(live_server):
    admin, run_id = _run(
        live_server.url, live_server.admin_token, {"algorithm": "demo", "quorum": 2, "demo": {"lr": 3e-3, "beta": 0.9}}
    )
    nodes = [_node(live_server.url, admin, run_id) for _ in range(2)]
    before = [_loss(n.module, 99, 0).item() for n in nodes]
    _together(nodes, steps=6)
    status = admin.status(run_id)
    assert status["version"] == 6
    # Every node checked the hash after each version; they end on the server's weights, bit for bit.
    assert {state_hash(n.params) for n in nodes} == {status["weights_hash"]}
    assert all(n.algorithm.name == "demo" and n.side.state.momenta for n in nodes)
    # The downlink of a version is a small header plus the round's node frames, not a dense model.
    dense = 4 * sum(p.numel() for p in nodes[0].module.parameters())
    assert nodes[0].bytes_received < 6 * dense
    assert _loss(nodes[0].module, 99, 0).item() < before[0]


def test_sparseloco_syncs_survive_kill_9_and_a_late_joiner_gets_the_outer_momentum(tmp_path):
    config = {
        "algorithm": "sparseloco",
        "quorum": 2,
        "sparseloco": {
            "sync_every": 2,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "nesterov": True,
            "inner": {"lr": 1e-2},
        },
    }
    with LiveServer(tmp_path / "data") as srv:
        admin, run_id = _run(srv.url, srv.admin_token, config)
        nodes = [_node(srv.url, admin, run_id) for _ in range(2)]
        _together(nodes, steps=4)  # two syncs
        assert admin.status(run_id)["version"] == 2

        # The server dies between syncs; its outer momentum must come back from the store.
        srv.kill()
        srv.start()
        _together(nodes, steps=2)  # a third sync: every node checks the server's hash after it
        status = admin.status(run_id)
        assert status["version"] == 3
        assert {state_hash(n.params) for n in nodes} == {status["weights_hash"]}

        # A node joining now loads the weights and the outer momentum of the same version ...
        late = _node(srv.url, admin, run_id)
        late.sync()
        assert set(late._algorithm_state["outer"]["buffers"]) == set(late.params)
        # ... so it applies the next version exactly as the server does (Nesterov needs the momentum).
        _together(nodes, steps=2)
        late.catch_up(wait=10)
        status = admin.status(run_id)
        assert late.version == status["version"] == 4
        assert state_hash(late.params) == status["weights_hash"]


def test_a_median_demo_run_publishes_the_trim_and_nodes_hold_the_servers_weights(live_server):
    # three nodes, median: each coordinate's middle value, which a node alone cannot move
    admin, run_id = _run(
        live_server.url,
        live_server.admin_token,
        {
            "algorithm": "demo",
            "quorum": 3,
            "demo": {"lr": 3e-3, "beta": 0.9},
            "aggregation": {"rule": "median"},
            "publish": "frames",
        },
    )
    nodes = [_node(live_server.url, admin, run_id) for _ in range(3)]
    before = _loss(nodes[0].module, 99, 0).item()
    _together(nodes, steps=4)
    status = admin.status(run_id)
    assert status["version"] == 4
    assert {state_hash(n.params) for n in nodes} == {status["weights_hash"]}
    assert _loss(nodes[0].module, 99, 0).item() < before
    # the published versions carry trim 1 (the middle of three) and apply the coordinate-wise median
    batch = nodes[0].client.published(run_id, 0)
    assert [v.trim for v in batch.versions] == [1, 1, 1, 1]
    assert all(len(v.frames) == 3 for v in batch.versions)


def _record_names(node: Node, run_id: str) -> set:
    """The record names of every node frame the run has published."""
    batch = node.client.published(node.run_id, 0)
    return {e.name for v in batch.versions for f in v.frames for e in f.entries}


def test_a_model_record_demo_run_sends_one_record_and_nodes_hold_the_servers_weights(live_server):
    def train(model_record: bool) -> tuple[list[Node], str]:
        admin, run_id = _run(
            live_server.url,
            live_server.admin_token,
            {"algorithm": "demo", "quorum": 2, "demo": {"lr": 3e-3, "beta": 0.9}, "model_record": model_record},
        )
        nodes = [_node(live_server.url, admin, run_id) for _ in range(2)]
        _together(nodes, steps=4)
        status = admin.status(run_id)
        assert status["version"] == 4
        assert {state_hash(n.params) for n in nodes} == {status["weights_hash"]}
        return nodes, run_id

    per_tensor, _ = train(False)
    whole, run_id = train(True)
    spec = whole[0].model_spec
    assert spec is not None and _record_names(whole[0], run_id) == {spec.record_name}
    # one record's headers instead of four, and the flat chunks of the (64,) codec
    assert whole[0].bytes_sent < per_tensor[0].bytes_sent


def test_a_model_record_sparseloco_run_survives_kill_9_and_a_late_joiner_follows(tmp_path):
    config = {
        "algorithm": "sparseloco",
        "quorum": 2,
        "model_record": True,
        "sparseloco": {
            "sync_every": 2,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "nesterov": True,
            "inner": {"lr": 1e-2},
        },
    }
    with LiveServer(tmp_path / "data") as srv:
        admin, run_id = _run(srv.url, srv.admin_token, config)
        nodes = [_node(srv.url, admin, run_id) for _ in range(2)]
        _together(nodes, steps=4)
        srv.kill()  # the restart replays the published model-record frames
        srv.start()
        _together(nodes, steps=2)
        status = admin.status(run_id)
        assert status["version"] == 3
        assert {state_hash(n.params) for n in nodes} == {status["weights_hash"]}
        assert _record_names(nodes[0], run_id) == {nodes[0].model_spec.record_name}
        late = _node(srv.url, admin, run_id)
        late.sync()
        _together(nodes, steps=2)
        late.catch_up(wait=10)
        assert state_hash(late.params) == admin.status(run_id)["weights_hash"]


def test_a_model_record_run_refuses_a_frame_per_tensor(live_server):
    from gradwire.client import FrameRejectedError

    admin, run_id = _run(
        live_server.url, live_server.admin_token, {"algorithm": "demo", "quorum": 1, "model_record": True}
    )
    node_id, token = admin.register_node(run_id)
    client = GradwireClient(live_server.url, token)
    grads = {n: torch.zeros_like(p) for n, p in _model().named_parameters()}
    per_tensor = gradwire.DCTCodec(**CODEC).encode_bundle(grads, round=0, sender=node_id)
    try:
        client.submit(run_id, 0, per_tensor)
        raise AssertionError("a per-tensor frame was accepted by a model_record run")
    except FrameRejectedError as exc:
        assert exc.error == "tensor_mismatch" and "@model:" in str(exc)
    assert admin.status(run_id)["version"] == 0


def test_model_record_is_refused_for_adamw_runs():
    from gradwire_server.config import RunConfig

    with pytest.raises(ValueError, match="model_record"):
        RunConfig.model_validate({"algorithm": "adamw", "model_record": True})


def test_a_codec_named_without_params_gets_its_own_defaults_not_the_dcts():
    from gradwire_server.config import RunConfig

    cfg = RunConfig.model_validate(
        {"algorithm": "sparseloco", "uplink": {"codec": "onebit"}, "downlink": {"codec": "onebit"}}
    )
    assert (cfg.uplink.params, cfg.downlink.params) == ({}, {})
    assert isinstance(cfg.downlink.build(), gradwire.OneBit)
    assert RunConfig.model_validate({"uplink": {"codec": "dct"}}).uplink.params == {"chunk_shape": [64, 64], "topk": 32}
    with pytest.raises(ValueError, match="onebit"):  # a parameter the codec does not take is still refused
        RunConfig.model_validate({"uplink": {"codec": "onebit", "params": {"topk": 4}}})
