"""Crashes and outages with an object store (SeaweedFS on loopback): kill -9 of the server mid-round and
right after a quorum loses no acknowledged upload and publishes no version twice; while the store cannot
be reached, uploads are refused 503 naming the store, a round that is due waits, nothing is lost, and it
publishes once the store is back; an initial state waits for the store too."""

from __future__ import annotations

import time
import uuid

import httpx

import gradwire
from gradwire.client import StoreClient
from gradwire.state import apply_update, state_hash, state_to_bytes
from gradwire_server.loopback_store import LoopbackS3
from live_server import LiveServer
from object_store_helpers import upload
from server_helpers import dct_frame, make_run, metric, random_grads, tiny_state

CONFIG = dict(optimizer={"lr": 0.01}, downlink={"codec": "dct", "params": {"chunk_shape": [64], "topk": 8}})


def _frame(rnd, node_id):
    return dct_frame(random_grads(1000 * rnd + node_id), rnd, node_id)


def _server(s3: LoopbackS3, data_dir, **env) -> LiveServer:
    return LiveServer(
        data_dir,
        env={**s3.env(), **{f"GRADWIRE_{k.upper()}": str(v) for k, v in env.items()}},
        extra_args=["--object-store", s3.url(f"t-{uuid.uuid4().hex[:12]}")],
    )


def _versions(client: httpx.Client, run) -> list[dict]:
    """The versions the store holds for ``run``, as the server lists them from version 0 (each GOT and
    checked against its SHA-256)."""
    manifest = client.get(run.url("/objects"), params={"since": 0}, headers=run.admin).json()
    with StoreClient() as store:
        for v in manifest["versions"]:
            store.get(v)
    return manifest["versions"]


def _replay(versions: list[dict]) -> str:
    """The weights hash of the tiny initial state with the stored versions applied, in order."""
    replica = tiny_state()
    with StoreClient() as store:
        for v in versions:
            apply_update(replica, gradwire.decode_bundle(store.get(v)))
    return state_hash(replica)


def test_kill_9_mid_round_and_after_a_quorum_loses_nothing_and_publishes_once(s3_store, tmp_path):
    with _server(s3_store, tmp_path / "data") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        run = make_run(c, srv.admin_token, n_nodes=3, quorum=3, **CONFIG)
        ref = make_run(c, srv.admin_token, n_nodes=3, quorum=3, **CONFIG)  # the same frames, never crashed
        for rnd in range(2):
            for node in ref.nodes:
                assert upload(ref, node, rnd, _frame(rnd, node.node_id)).status_code == 202
            ref.wait_version(rnd + 1)
        # Mid-round: two uploads acknowledged, then kill -9.
        for node in run.nodes[:2]:
            assert upload(run, node, 0, _frame(0, node.node_id)).status_code == 202
        srv.kill()
        srv.start()
        run.client = ref.client = c
        assert run.status()["submitted"] == 2
        # A node retrying after the crash: its PUT finds the key written (412) and its tell is a duplicate.
        again = upload(run, run.nodes[0], 0, _frame(0, run.nodes[0].node_id))
        assert again.status_code == 202 and again.json()["duplicate"] is True
        assert upload(run, run.nodes[2], 0, _frame(0, run.nodes[2].node_id)).status_code == 202
        run.wait_version(1)
        # Right after a quorum: the round is closing (aggregate, AdamW, the version's PUT, the commit) when
        # the server dies.
        for node in run.nodes:
            assert upload(run, node, 1, _frame(1, node.node_id)).status_code == 202
        srv.kill()
        srv.start()
        run.wait_version(2)
        versions = _versions(c, run)
        assert [v["version"] for v in versions] == [1, 2]  # each once
        assert [v["weights_hash"] for v in versions] == [v["weights_hash"] for v in _versions(c, ref)]
        assert _replay(versions) == run.status()["weights_hash"] == ref.status()["weights_hash"]


def test_store_unreachable_uploads_wait_a_due_round_waits_and_nothing_is_lost(tmp_path):
    with LoopbackS3(tmp_path / "s3") as s3:
        srv = _server(s3, tmp_path / "data", close_retry_initial_s=0.2, close_retry_max_s=0.5)
        with srv, httpx.Client(base_url=srv.url, timeout=60) as c:
            run = make_run(c, srv.admin_token, n_nodes=3, quorum=3, **CONFIG)
            a, b, n3 = run.nodes
            assert upload(run, a, 0, _frame(0, a.node_id)).status_code == 202
            store = s3.url()
            late = c.post("/v1/runs", json={}, headers=run.admin).json()["run_id"]
            s3.stop()
            # The initial state goes to the store first (nodes start there): with the store down it is 503
            # naming the store, and nothing is set.
            body = state_to_bytes(tiny_state())
            r = c.put(f"/v1/runs/{late}/state", content=body, headers=run.admin)
            assert (
                r.status_code == 503 and r.json()["error"] == "object_store_unavailable" and store in r.json()["detail"]
            )
            assert c.get(f"/v1/runs/{late}", headers=run.admin).json()["weights_hash"] is None
            # An upload told while the store is down: 503, naming the store, nothing recorded.
            slot = c.post(run.url("/rounds/0/slot"), json={"nbytes": 10, "sha256": "1" * 64}, headers=b.headers)
            r = c.post(run.url("/rounds/0/uploaded"), json={"key": slot.json()["key"]}, headers=b.headers)
            assert r.status_code == 503 and r.json()["error"] == "object_store_unavailable"
            assert store in r.json()["detail"] and s3.endpoint in r.json()["detail"] and r.headers["Retry-After"]
            # The round becomes due (the other two through the server's own port, which needs no store); its
            # close cannot write the version to the store and waits, retried.
            for node in (b, n3):
                r = run.submit(node, 0, _frame(0, node.node_id))
                assert r.status_code == 202, r.text
            deadline = time.monotonic() + 60
            while metric(c, "gradwire_round_close_failures_total", 'cause="storage"') < 2:
                assert time.monotonic() < deadline, srv.log()
                r = c.get(run.url("/updates"), params={"since": 0, "wait": 0.2}, headers=run.admin)
            st = run.status()
            assert st["version"] == 0 and st["submitted"] == 3
            assert f"the object store {store}" in srv.log()
            s3.start()
            run.wait_version(1, timeout=60)
            (version,) = _versions(c, run)
            assert version["version"] == 1 and run.status()["submitted"] == 0
            assert _replay([version]) == run.status()["weights_hash"]
            assert c.put(f"/v1/runs/{late}/state", content=body, headers=run.admin).status_code == 200
