"""Limits and secrets: caps on runs, nodes per run and stored bytes (409 limit_reached naming the cap),
node token revocation, replacement and node deletion, tokens at rest only as hashes, the admin token from
a file (and a warning for one in argv), /metrics without run ids."""

from __future__ import annotations

import hashlib

import httpx
import pytest
import torch

from gradwire_server.__main__ import main as server_main
from gradwire_server.launcher import LoopbackServer
from server_helpers import bearer, dense_frame, make_run, metric

#: One 1 MiB tensor: the state and each dense update take about 1 MiB on disk.
BIG = {"w": (512, 512)}


def _big_state() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(BIG["w"])}


def _limit(r: httpx.Response, setting: str) -> bool:
    return r.status_code == 409 and r.json()["error"] == "limit_reached" and setting in r.json()["detail"]


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    token_file = tmp / "admin.token"
    token_file.write_text("admin-from-a-file\n")
    token_file.chmod(0o600)
    server = LoopbackServer(
        tmp / "data",
        admin_token="admin-from-a-file",
        log_path=tmp / "server.log",
        env={
            "GRADWIRE_ADMIN_TOKEN": "",
            "GRADWIRE_MAX_RUNS": "2",
            "GRADWIRE_MAX_NODES_PER_RUN": "2",
            "GRADWIRE_MAX_STORED_BYTES": str(3 << 20),
        },
        extra_args=["--admin-token-file", str(token_file)],
    )
    with server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield server, client


def test_caps_on_runs_nodes_and_stored_bytes(capped):
    server, client = capped
    admin = server.admin_headers()
    small = make_run(client, server.admin_token, n_nodes=2)
    r = client.post(small.url("/nodes"), json={}, headers=admin)
    assert _limit(r, "max_nodes_per_run=2"), r.text
    # A deleted node makes room; its id is never given again.
    assert client.delete(small.url("/nodes/2"), headers=admin).status_code == 204
    r = client.post(small.url("/nodes"), json={}, headers=admin)
    assert r.status_code == 201 and r.json()["node_id"] == 3

    big = make_run(client, server.admin_token, n_nodes=2, quorum=3, state=_big_state())
    assert _limit(client.post("/v1/runs", json={}, headers=admin), "max_runs=2")
    grads = {"w": torch.ones(BIG["w"])}
    assert big.submit(big.nodes[0], 0, dense_frame(grads, 0, 1)).status_code == 202
    r = big.submit(big.nodes[1], 0, dense_frame(grads, 0, 2))
    assert _limit(r, "max_stored_bytes=3145728"), r.text
    assert metric(client, "gradwire_stored_bytes") <= 3 << 20
    # Deleting the big run frees its bytes and a run's place.
    assert client.delete(big.url(), headers=admin).status_code == 204
    assert metric(client, "gradwire_stored_bytes") < 1 << 20
    r = client.post("/v1/runs", json={}, headers=admin)
    assert r.status_code == 201
    for run_id in (small.run_id, r.json()["run_id"]):  # the next tests start from no run
        assert client.delete(f"/v1/runs/{run_id}", headers=admin).status_code == 204


def test_revoked_replaced_and_deleted_node_tokens(capped):
    server, client = capped
    admin = server.admin_headers()
    r = client.post("/v1/runs", json={}, headers=admin)
    assert r.status_code == 201, r.text
    run_id = r.json()["run_id"]
    first = client.post(f"/v1/runs/{run_id}/nodes", json={"name": "a"}, headers=admin).json()
    second = client.post(f"/v1/runs/{run_id}/nodes", json={"name": "b"}, headers=admin).json()
    url = f"/v1/runs/{run_id}"
    assert client.get(url, headers=bearer(first["token"])).status_code == 200

    assert client.delete(f"{url}/nodes/1/token", headers=admin).status_code == 204
    r = client.get(url, headers=bearer(first["token"]))
    assert (r.status_code, r.json()["error"]) == (401, "invalid_token")
    assert [n["token"] for n in client.get(f"{url}/nodes", headers=admin).json()] == ["revoked", "active"]
    new = client.post(f"{url}/nodes/1/token", headers=admin)
    assert new.status_code == 201 and new.json()["node_id"] == 1
    assert client.get(url, headers=bearer(new.json()["token"])).status_code == 200
    assert client.get(url, headers=bearer(first["token"])).status_code == 401

    assert client.delete(f"{url}/nodes/2", headers=admin).status_code == 204
    assert client.get(url, headers=bearer(second["token"])).status_code == 401
    assert [n["node_id"] for n in client.get(f"{url}/nodes", headers=admin).json()] == [1]
    assert client.get(url, headers=admin).json()["nodes"] == 1
    r = client.delete(f"{url}/nodes/2", headers=admin)
    assert (r.status_code, r.json()["error"]) == (404, "unknown_node")
    r = client.delete(f"{url}/nodes/1/token", headers=bearer(new.json()["token"]))
    assert (r.status_code, r.json()["error"]) == (403, "forbidden")

    # At rest: the database holds the tokens' SHA-256 hashes, never a token.
    at_rest = b"".join(p.read_bytes() for p in server.data_dir.glob("gradwire.sqlite3*"))
    assert hashlib.sha256(new.json()["token"].encode()).hexdigest().encode() in at_rest
    for token in (first["token"], second["token"], new.json()["token"], server.admin_token):
        assert token.encode() not in at_rest
    assert client.delete(url, headers=admin).status_code == 204


def test_metrics_name_no_run_and_the_admin_token_comes_from_the_file(capped):
    server, client = capped
    admin = server.admin_headers()
    r = client.post("/v1/runs", json={}, headers=admin)
    assert r.status_code == 201, r.text
    run_id = r.json()["run_id"]
    text = client.get("/metrics").text
    assert run_id not in text and "gradwire_version" not in text and 'gradwire_runs{status="active"}' in text
    assert client.get(f"/v1/runs/{run_id}", headers=bearer("anything-else")).status_code == 401
    assert "--admin-token shows" not in server.log()
    assert client.delete(f"/v1/runs/{run_id}", headers=admin).status_code == 204


def test_an_admin_token_in_argv_is_a_usage_error_that_says_where_it_goes(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:  # refused before anything starts or is created
        server_main(["--admin-token", "in-plain-sight", "--data-dir", str(tmp_path / "data")])
    assert done.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "a command line shows in `ps`" in err and "GRADWIRE_ADMIN_TOKEN" in err and "--admin-token-file" in err
    assert not (tmp_path / "data").exists()


def test_a_store_of_the_previous_schema_is_migrated_in_place(tmp_path):
    import sqlite3

    from gradwire_server.auth import hash_token
    from gradwire_server.store import Store

    # The tables as the previous server wrote them: no run status, a node's token hash NOT NULL.
    db = sqlite3.connect(tmp_path / "gradwire.sqlite3")
    db.executescript("""
        CREATE TABLE runs (run_id TEXT PRIMARY KEY, config TEXT NOT NULL, created_at REAL NOT NULL,
            version INTEGER NOT NULL DEFAULT 0, weights_hash TEXT, has_state INTEGER NOT NULL DEFAULT 0,
            round_opened_at REAL, checkpoint_version INTEGER NOT NULL DEFAULT 0, checkpoint_hash TEXT);
        CREATE TABLE nodes (run_id TEXT NOT NULL REFERENCES runs(run_id), node_id INTEGER NOT NULL, name TEXT,
            token_hash TEXT NOT NULL UNIQUE, created_at REAL NOT NULL, PRIMARY KEY (run_id, node_id));
        INSERT INTO runs (run_id, config, created_at) VALUES ('r1', '{}', 0);
    """)
    db.execute("INSERT INTO nodes VALUES ('r1', 1, 'old', ?, 0)", (hash_token("old-token"),))
    db.commit()
    db.close()
    store = Store(tmp_path)
    assert store.get_run("r1").status == "active"
    assert store.node_by_token_hash(hash_token("old-token")).node_id == 1
    assert store.set_node_token("r1", 1, None)  # revocable: the hash column lost its NOT NULL
    assert store.node_by_token_hash(hash_token("old-token")) is None
    assert store.add_node("r1", "new", hash_token("new-token")) == 2
    store.close()
    reopened = Store(tmp_path)  # migrated once: opening again changes nothing
    assert [(n.node_id, n.revoked_at is not None) for n in reopened.list_nodes("r1")] == [(1, True), (2, False)]
    reopened.close()


def test_the_client_speaks_the_admin_endpoints(capped):
    from gradwire.client import AuthError, ConflictError, GradwireClient, NotFoundError

    server, _ = capped
    with GradwireClient(server.url, server.admin_token) as admin:
        run_id = admin.create_run({"quorum": 1})
        admin.put_state(run_id, {"w": torch.zeros(4, 4)})
        node_id, token = admin.register_node(run_id, "n")
        assert admin.pause_run(run_id)["status"] == "paused"
        with GradwireClient(server.url, token, retries=0) as node:
            with pytest.raises(ConflictError, match="run_paused"):
                node.submit(run_id, 0, dense_frame({"w": torch.ones(4, 4)}, 0, node_id))
        assert admin.resume_run(run_id)["status"] == "active"
        new = admin.replace_token(run_id, node_id)
        with GradwireClient(server.url, token, retries=0) as old:
            with pytest.raises(AuthError, match="invalid_token"):
                old.status(run_id)
        admin.revoke_token(run_id, node_id)
        assert [(n["node_id"], n["name"], n["token"]) for n in admin.nodes(run_id)] == [(node_id, "n", "revoked")]
        with GradwireClient(server.url, new, retries=0) as revoked:
            with pytest.raises(AuthError):
                revoked.status(run_id)
        admin.delete_node(run_id, node_id)
        assert admin.nodes(run_id) == []
        admin.delete_run(run_id)
        with pytest.raises(NotFoundError, match="unknown_run"):
            admin.status(run_id)
