"""The REST API of the aggregation server against a real uvicorn on 127.0.0.1 (docs/API.md)."""

from __future__ import annotations

import os
import sqlite3
import stat

import httpx
import pytest
import torch

import gradwire
from gradwire.client import split_frames
from gradwire.state import apply_update, state_from_bytes, state_hash, state_to_bytes
from live_server import LiveServer
from server_helpers import SHAPES, dct_frame, dense_frame, eventually, make_run, metric, random_grads, tiny_state


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("api")) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_health_ready_and_metrics(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    text = client.get("/metrics").text
    for name in (
        "gradwire_updates_accepted_total",
        "gradwire_bytes_in_total",
        "gradwire_bytes_out_total",
        "gradwire_compression_ratio",
        "gradwire_round_duration_seconds_bucket",
        "gradwire_decode_seconds_bucket",
        "gradwire_aggregate_seconds_bucket",
        "gradwire_live_nodes",
        "gradwire_commit_group_size_bucket",
    ):
        assert name in text


def test_openapi_declares_binary_bodies(client):
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    post = paths["/v1/runs/{run_id}/rounds/{round}/updates"]["post"]
    assert post["requestBody"]["content"]["application/octet-stream"]["schema"]["format"] == "binary"
    assert "application/octet-stream" in paths["/v1/runs/{run_id}/state"]["put"]["requestBody"]["content"]
    assert "application/octet-stream" in paths["/v1/runs/{run_id}/state"]["get"]["responses"]["200"]["content"]
    assert "application/octet-stream" in paths["/v1/runs/{run_id}/updates"]["get"]["responses"]["200"]["content"]
    assert "X-Gradwire-Version" in paths["/v1/runs/{run_id}/updates"]["get"]["responses"]["200"]["headers"]
    for code in ("401", "409", "410", "413", "422"):
        assert code in post["responses"]


def test_create_run_defaults_and_invalid_config(server, client):
    admin = server.admin_headers()
    r = client.post("/v1/runs", headers=admin)
    assert r.status_code == 201
    run_id = r.json()["run_id"]
    st = client.get(f"/v1/runs/{run_id}", headers=admin).json()
    assert st["version"] == 0 and st["open_round"] == 0 and st["weights_hash"] is None and st["nodes"] == 0
    cfg = st["config"]
    assert cfg["uplink"] == {"codec": "dct", "params": {"chunk_shape": [64, 64], "topk": 32}}
    assert cfg["optimizer"]["betas"] == [0.9, 0.999] and cfg["aggregation"]["rule"] == "bounded_mean"
    assert cfg["quorum"] == 1 and cfg["late_policy"] == "reject" and cfg["keep_versions"] == 1000
    assert st["warnings"] == []  # the default rule bounds one node's influence
    for bad in (
        {"quorum": 0},
        {"aggregation": {"rule": "mode"}},
        {"uplink": {"codec": "nope"}},
        {"optimizer": {"schedule": "cosine"}},
        {"unknown_field": 1},
    ):
        r = client.post("/v1/runs", json=bad, headers=admin)
        assert r.status_code == 422, bad
        assert r.json()["error"] == "invalid_request"


def test_nodes_get_ids_from_one_and_tokens_are_stored_hashed(server, client):
    run = make_run(client, server.admin_token, n_nodes=3)
    assert [n.node_id for n in run.nodes] == [1, 2, 3]
    assert len({n.token for n in run.nodes}) == 3
    assert all(len(n.token) >= 43 for n in run.nodes)  # 32 bytes, URL-safe base64
    db = sqlite3.connect(server.data_dir / "gradwire.sqlite3")
    stored = [row[0] for row in db.execute("SELECT token_hash FROM nodes WHERE run_id = ?", (run.run_id,))]
    db.close()
    assert len(stored) == 3
    assert not any(n.token in stored for n in run.nodes)
    import hashlib

    assert sorted(stored) == sorted(hashlib.sha256(n.token.encode()).hexdigest() for n in run.nodes)
    assert run.status()["nodes"] == 3


def test_state_roundtrip_and_already_started(server, client):
    state = tiny_state(3)
    run = make_run(client, server.admin_token, n_nodes=1, state=state, quorum=2)
    r = client.get(run.url("/state"), headers=run.nodes[0].headers)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    got = state_from_bytes(r.content)
    assert state_hash(got) == state_hash(state) == r.headers["X-Gradwire-Weights-Hash"]
    assert r.headers["X-Gradwire-Version"] == "0"
    # Replacing the initial state is allowed until an update was accepted.
    r = client.put(run.url("/state"), content=state_to_bytes(tiny_state(4)), headers=run.admin)
    assert r.status_code == 200 and r.json() == {"version": 0, "weights_hash": state_hash(tiny_state(4))}
    assert run.submit(run.nodes[0], 0, dct_frame(random_grads(1), 0, 1)).status_code == 202
    r = client.put(run.url("/state"), content=state_to_bytes(state), headers=run.admin)
    assert r.status_code == 409 and r.json()["error"] == "already_started"
    r = client.put(run.url("/state"), content=b"not safetensors", headers=run.admin)
    assert r.status_code in (400, 409)


def test_bad_initial_state_is_refused(server, client):
    admin = server.admin_headers()
    run_id = client.post("/v1/runs", headers=admin).json()["run_id"]
    for body, what in [
        (b"\x00" * 20, "garbage"),
        (state_to_bytes({"w": torch.tensor([1.0, float("nan")])}), "NaN"),
        (state_to_bytes({"w": torch.arange(4)}), "integer tensor"),
    ]:
        r = client.put(f"/v1/runs/{run_id}/state", content=body, headers=admin)
        assert r.status_code == 400, what
        assert r.json()["error"] == "bad_state"
    # Before a state exists, nodes have nothing to submit to.
    node = client.post(f"/v1/runs/{run_id}/nodes", json={}, headers=admin).json()
    r = client.post(
        f"/v1/runs/{run_id}/rounds/0/updates", content=b"x" * 40, headers={"Authorization": f"Bearer {node['token']}"}
    )
    assert r.status_code == 409 and r.json()["error"] == "state_not_set"


def test_rounds_publish_and_nodes_stay_bit_identical(server, client):
    state = tiny_state(5)
    run = make_run(
        client,
        server.admin_token,
        n_nodes=2,
        state=state,
        quorum=2,
        optimizer={"lr": 0.01},
        downlink={"codec": "dct", "params": {"chunk_shape": [64], "topk": 8}},
    )
    replica = {n: t.clone() for n, t in state.items()}
    frames_seen = []
    for rnd in range(3):
        for node in run.nodes:
            r = run.submit(node, rnd, dct_frame(random_grads(10 * rnd + node.node_id), rnd, node.node_id))
            assert r.status_code == 202, r.text
            body = r.json()
            assert body["round"] == rnd and body["node_id"] == node.node_id and body["duplicate"] is False
        r = run.wait_version(rnd + 1)
        frames = split_frames(r.content)
        assert len(frames) == 1
        f = gradwire.read_frame(frames[0])
        assert f.bundle and f.round == rnd + 1 and f.sender == 0xFFFFFFFF
        assert {e.name for e in f.entries} == set(SHAPES) and all(e.codec == 1 for e in f.entries)
        apply_update(replica, gradwire.decode_bundle(frames[0]))
        assert state_hash(replica) == r.headers["X-Gradwire-Weights-Hash"]
        frames_seen.append(frames[0])
    # One request returns every version since v, in order; the empty answer when up to date.
    r = client.get(run.url("/updates"), params={"since": 0}, headers=run.nodes[0].headers)
    assert split_frames(r.content) == frames_seen and r.headers["X-Gradwire-Version"] == "3"
    r = client.get(run.url("/updates"), params={"since": 3}, headers=run.nodes[0].headers)
    assert r.status_code == 200 and r.content == b""
    r = client.get(run.url("/updates"), params={"since": 4}, headers=run.nodes[0].headers)
    assert r.status_code == 422
    # A late joiner takes the full state and is in sync.
    r = client.get(run.url("/state"), headers=run.nodes[1].headers)
    assert state_hash(state_from_bytes(r.content)) == state_hash(replica) == r.headers["X-Gradwire-Weights-Hash"]
    st = run.status()
    assert st["version"] == 3 and st["open_round"] == 3 and st["submitted"] == 0
    assert st["weights_hash"] == state_hash(replica) and st["quorum"] == 2


def test_idempotent_resubmission_conflict_late_and_early(server, client):
    run = make_run(client, server.admin_token, n_nodes=2, quorum=2)
    a, b = run.nodes
    frame = dct_frame(random_grads(1), 0, a.node_id)
    accepted = metric(client, "gradwire_updates_accepted_total")
    r1 = run.submit(a, 0, frame)
    r2 = run.submit(a, 0, frame)
    assert r1.status_code == r2.status_code == 202
    assert r1.json()["duplicate"] is False and r2.json()["duplicate"] is True
    assert r1.json()["submitted"] == r2.json()["submitted"] == 1
    assert metric(client, "gradwire_updates_accepted_total") == accepted + 1
    r = run.submit(a, 0, dct_frame(random_grads(2), 0, a.node_id))
    assert r.status_code == 409 and r.json()["error"] == "conflicting_submission"
    r = run.submit(b, 1, dct_frame(random_grads(3), 1, b.node_id))
    assert r.status_code == 409 and r.json()["error"] == "round_not_open"
    assert run.status()["submitted"] == 1
    assert run.submit(b, 0, dct_frame(random_grads(4), 0, b.node_id)).status_code == 202
    run.wait_version(1)
    r = run.submit(b, 0, dct_frame(random_grads(5), 0, b.node_id))
    assert r.status_code == 409  # other bytes for a (node, round) already recorded: still a conflict
    late = run.submit(a, 0, frame)
    assert late.status_code == 202 and late.json()["duplicate"] is True  # retry of an acknowledged update
    # A node that missed round 0 entirely and submits it late:
    run2 = make_run(client, server.admin_token, n_nodes=2, quorum=1)
    assert run2.submit(run2.nodes[0], 0, dct_frame(random_grads(6), 0, 1)).status_code == 202
    run2.wait_version(1)
    r = run2.submit(run2.nodes[1], 0, dct_frame(random_grads(7), 0, 2))
    assert r.status_code == 410 and r.json()["error"] == "round_closed"
    assert metric(client, "gradwire_updates_rejected_total", 'reason="round_closed"') >= 1


def test_staleness_policy_counts_a_late_update_in_the_open_round(server, client):
    run = make_run(client, server.admin_token, n_nodes=2, quorum=2, late_policy="staleness")
    a, b = run.nodes
    run.submit(a, 0, dct_frame(random_grads(1), 0, 1))
    run.submit(b, 0, dct_frame(random_grads(2), 0, 2))
    run.wait_version(1)
    run.submit(a, 1, dct_frame(random_grads(3), 1, 1))
    # Staleness does not reopen a (node, round) already recorded: other bytes for it still conflict.
    late = run.submit(b, 0, dct_frame(random_grads(4), 0, 2))
    assert late.status_code == 409 and late.json()["error"] == "conflicting_submission"
    r = run.submit(b, 1, dct_frame(random_grads(5), 1, 2))
    assert r.status_code == 202
    run.wait_version(2)
    run3 = make_run(client, server.admin_token, n_nodes=3, quorum=2, late_policy="staleness")
    x, y, z = run3.nodes
    run3.submit(x, 0, dct_frame(random_grads(1), 0, 1))
    run3.submit(y, 0, dct_frame(random_grads(2), 0, 2))
    run3.wait_version(1)
    r = run3.submit(z, 0, dct_frame(random_grads(3), 0, 3))  # one version stale: weight 1/2
    assert r.status_code == 202 and r.json()["submitted"] == 1
    db = sqlite3.connect(server.data_dir / "gradwire.sqlite3")
    weight, target = db.execute(
        "SELECT weight, target_round FROM submissions WHERE run_id = ? AND node_id = 3", (run3.run_id,)
    ).fetchone()
    db.close()
    assert weight == pytest.approx(0.5) and target == 1


def test_deadline_closes_a_round_without_the_straggler(server, client):
    run = make_run(client, server.admin_token, n_nodes=3, quorum=3, min_updates=1, round_deadline_s=0.5)
    r = run.submit(run.nodes[0], 0, dct_frame(random_grads(1), 0, 1))
    assert r.status_code == 202
    assert 0.0 <= run.status()["deadline_in_s"] <= 0.5
    run.wait_version(1, timeout=20)
    st = run.status()
    assert st["version"] == 1 and st["submitted"] == 0


def test_too_far_behind_after_pruning(server, client):
    run = make_run(client, server.admin_token, n_nodes=1, keep_versions=2)
    for rnd in range(4):
        assert run.submit(run.nodes[0], rnd, dct_frame(random_grads(rnd), rnd, 1)).status_code == 202
        run.wait_version(rnd + 1)
    ok = client.get(run.url("/updates"), params={"since": 2}, headers=run.admin)
    assert ok.status_code == 200 and len(split_frames(ok.content)) == 2
    r = client.get(run.url("/updates"), params={"since": 1}, headers=run.admin)
    assert r.status_code == 410 and r.json()["error"] == "too_far_behind"
    diffs_dir = server.data_dir / "runs" / run.run_id / "diffs"
    expected = ["v000000003.gwf", "v000000004.gwf"]
    assert eventually(lambda: sorted(p.name for p in diffs_dir.iterdir()), expected) == expected


def test_long_poll_waits_for_the_next_version(server, client):
    import threading

    run = make_run(client, server.admin_token, n_nodes=1)
    got = {}

    def poll():
        with httpx.Client(base_url=server.url, timeout=60) as c:
            got["r"] = c.get(run.url("/updates"), params={"since": 0, "wait": 30}, headers=run.admin)

    t = threading.Thread(target=poll)
    t.start()
    assert run.submit(run.nodes[0], 0, dense_frame(random_grads(1), 0, 1)).status_code == 202
    t.join(timeout=60)
    assert got["r"].status_code == 200 and got["r"].headers["X-Gradwire-Version"] == "1"
    assert len(split_frames(got["r"].content)) == 1


def test_metrics_count_bytes_and_ratio(server, client):
    run = make_run(client, server.admin_token, n_nodes=1)
    before_in = metric(client, "gradwire_bytes_in_total")
    frame = dct_frame(random_grads(1), 0, 1)
    run.submit(run.nodes[0], 0, frame)
    assert metric(client, "gradwire_bytes_in_total") == before_in + len(frame)
    dense = sum(4 * torch.Size(s).numel() for s in SHAPES.values())
    assert metric(client, "gradwire_compression_ratio") == pytest.approx(dense / len(frame))
    before_out = metric(client, "gradwire_bytes_out_total")
    r = run.wait_version(1)
    assert metric(client, "gradwire_bytes_out_total") == before_out + len(r.content)
    assert metric(client, "gradwire_live_nodes") >= 1
    assert metric(client, "gradwire_round_duration_seconds_count") >= 1


def test_generated_admin_token_file_is_private(tmp_path):
    from gradwire_server.app import ServerContext
    from gradwire_server.auth import hash_token
    from gradwire_server.settings import ServerSettings

    ctx = ServerContext(ServerSettings(data_dir=tmp_path, admin_token=None))
    path = tmp_path / "admin_token"
    token = path.read_text().strip()
    assert len(token) >= 43 and ctx.admin_token_hash == hash_token(token)  # only the hash is kept in memory
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert ServerContext(ServerSettings(data_dir=tmp_path, admin_token=None)).admin_token_hash == ctx.admin_token_hash


def test_graceful_shutdown_closes_the_store_and_logs_json(tmp_path):
    import json

    srv = LiveServer(tmp_path / "g", env={"GRADWIRE_LOG_JSON": "true"})
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            make_run(c, srv.admin_token, n_nodes=1)
        srv.stop()
        records = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
        messages = [r["message"] for r in records if r["logger"].startswith("gradwire_server")]
        assert any("ready" in m for m in messages) and any("stopped cleanly" in m for m in messages)
        assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/readyz").status_code == 200
    finally:
        srv.close()


def test_cli_flags_override_the_environment(monkeypatch, tmp_path):
    from gradwire_server.settings import ServerSettings

    monkeypatch.setenv("GRADWIRE_PORT", "9000")
    monkeypatch.setenv("GRADWIRE_MAX_FRAME_BYTES", "1000")
    s = ServerSettings(_cli_parse_args=["--port", "9001", "--data-dir", str(tmp_path), "--log-json", "true"])
    assert (s.port, s.data_dir, s.log_json, s.max_frame_bytes) == (9001, tmp_path, True, 1000)


def test_a_body_that_is_not_json_says_where_and_what(live_server):
    r = httpx.post(
        f"{live_server.url}/v1/runs",
        content=b'{"quorum": 2,\n "x": }',
        headers={"Authorization": f"Bearer {live_server.admin_token}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 422
    body = r.json()
    assert body["error"] == "invalid_request"
    assert body["detail"] == "the body is not valid JSON: Expecting value at line 2, column 7 (byte 20)"
