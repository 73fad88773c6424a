"""A full disk: every write answers a JSON 507 (never a plain 500), the cause is logged once, /readyz is 503
while the store cannot write, a failing round close is retried with backoff and few log lines, and
everything recovers when space returns.

Two real failures: SQLite's own ``SQLITE_FULL`` from a database at its page limit (``PRAGMA
max_page_count``, no root needed; the app in process), and a real file system out of space (a small
tmpfs, mounted only where the test may mount: it skips otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from gradwire.state import state_from_bytes, state_hash, state_to_bytes
from gradwire_server.app import create_app
from gradwire_server.launcher import LoopbackServer
from gradwire_server.settings import ServerSettings
from server_helpers import bearer, dense_frame, make_run, metric, random_grads, served, tiny_state

ADMIN = "disk-admin"
#: Fast retries, so that a test sees several failed closes in a second or two.
RETRY = {"close_retry_initial_s": 0.1, "close_retry_max_s": 0.4}
#: Two nodes, a round that closes at its deadline with both (quorum 3 is never reached): the close can be
#: made to fail after both updates were acknowledged.
DEADLINE_RUN = {"quorum": 3, "min_updates": 2, "round_deadline_s": 1.5}


def _wait(condition, timeout: float = 15.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def _is_json_507(r: httpx.Response) -> bool:
    return (
        r.status_code == 507
        and r.headers["content-type"].startswith("application/json")
        and r.json()["error"] == "insufficient_storage"
        and "Retry-After" in r.headers
    )


@contextlib.contextmanager
def _database_full(store, run_id: str):
    """The store's database at its page limit, with no room left in any table's last page (filled with rows
    the server never reads: negative rounds and versions, deleted nodes, runs without a row in memory):
    SQLite answers SQLITE_FULL to every write."""
    fillers = {
        "runs": ("INSERT INTO runs (run_id, config, created_at) VALUES ('filler-' || ?, '{}', 0)", lambda i: (i,)),
        "nodes": (
            "INSERT INTO nodes (run_id, node_id, created_at, deleted_at) VALUES (?, ?, 0, 0)",
            lambda i: (run_id, 10**6 + i),
        ),
        "submissions": ("INSERT INTO submissions VALUES (?, ?, -1, -1, '', 0, 0, 0, 0)", lambda i: (run_id, 10**6 + i)),
        "versions": ("INSERT INTO versions VALUES (?, ?, '', 0, 0, 0)", lambda i: (run_id, -1 - i)),
    }
    with store._lock:
        db = store._db
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        start = int(time.time() * 1000)
        for sql, args in fillers.values():
            with pytest.raises(sqlite3.OperationalError, match="full"):
                for i in range(start, start + 10**6):
                    db.execute(sql, args(i))
    try:
        yield
    finally:
        with store._lock:
            store._db.execute("PRAGMA max_page_count = 1073741823")


def test_a_full_database_is_507_logged_once_and_recovers(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="gradwire_server")
    settings = ServerSettings(data_dir=tmp_path, admin_token=ADMIN, **RETRY)
    app = create_app(settings)
    with served(app) as client:
        store = app.state.server.store
        run = make_run(client, ADMIN, n_nodes=2, **DEADLINE_RUN)
        frames = {n.node_id: dense_frame(random_grads(n.node_id), 0, n.node_id) for n in run.nodes}
        assert run.submit(run.nodes[0], 0, frames[1]).status_code == 202
        with _database_full(store, run.run_id):
            # Every write path: a JSON 507 naming the cause, nothing recorded.
            for r in (
                client.post("/v1/runs", json={}, headers=bearer(ADMIN)),
                client.post(run.url("/nodes"), json={"name": "late"}, headers=bearer(ADMIN)),
                run.submit(run.nodes[1], 0, frames[2]),
            ):
                assert _is_json_507(r), (r.status_code, r.text)
                assert "database or disk is full" in r.json()["detail"]
            assert run.status()["submitted"] == 1 and run.status()["nodes"] == 2
            # The refused update's frame, written before its commit failed, is gone: its space is wanted.
            assert len(list((tmp_path / "runs" / run.run_id / "submissions").iterdir())) == 1
            r = client.get("/readyz")
            assert r.status_code == 503 and r.json()["status"] == "storage_failing"
            assert metric(client, "gradwire_store_writable") == 0
        # Space is back: readiness probes a write (at most once a second) and turns 200.
        assert _wait(lambda: client.get("/readyz").status_code == 200, timeout=5)
        assert metric(client, "gradwire_store_writable") == 1
        assert run.submit(run.nodes[1], 0, frames[2]).status_code == 202

        # A round close that fails for want of space: retried with backoff until space returns.
        with _database_full(store, run.run_id):
            assert _wait(lambda: metric(client, "gradwire_round_close_failures_total", 'cause="storage"') >= 3)
            assert run.status()["version"] == 0 and run.status()["status"] == "active"
        run.wait_version(1, timeout=10)
        state = client.get(run.url("/state"), headers=run.admin)
        assert state_hash(state_from_bytes(state.content)) == state.headers["X-Gradwire-Weights-Hash"]

    text = caplog.text
    assert "cannot rollback" not in text
    store_lines = [r for r in caplog.records if r.name == "gradwire_server.store" and r.levelno >= logging.WARNING]
    # Per episode of a full disk: one line when writes start failing, one when they work again.
    assert [r.levelno for r in store_lines] == [logging.ERROR, logging.WARNING] * 2, [
        r.getMessage() for r in store_lines
    ]
    assert all("database or disk is full" in r.getMessage() for r in store_lines)
    close_lines = [
        r.getMessage() for r in caplog.records if r.name == "gradwire_server.rounds" and r.levelno >= logging.WARNING
    ]
    assert len(close_lines) == 2, close_lines  # the first failure (with its backoff), then the recovery
    assert "closing round 0 failed: database or disk is full" in close_lines[0] and "retrying" in close_lines[0]
    assert "round 0 closed after" in close_lines[1]
    assert all(r.exc_info is None for r in caplog.records if r.name.startswith("gradwire_server"))


@pytest.fixture
def tmpfs(tmp_path):
    """An 8 MiB tmpfs at ``tmp_path/fs`` (skips where mounting is not permitted)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Write zeros to ``path`` until the file system is full."""
    block = bytes(1 << 20)
    with open(path, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(block)
        with contextlib.suppress(OSError):
            while True:
                f.write(block[:4096])


def test_a_full_tmpfs_is_507_then_recovers(tmpfs, tmp_path):
    server = LoopbackServer(
        tmpfs / "data",
        admin_token=ADMIN,
        log_path=tmp_path / "server.log",
        env={f"GRADWIRE_{k.upper()}": str(v) for k, v in RETRY.items()},
    )
    with server, httpx.Client(base_url=server.url, timeout=30) as client:
        run = make_run(client, ADMIN, n_nodes=2, **DEADLINE_RUN)
        frames = {n.node_id: dense_frame(random_grads(n.node_id), 0, n.node_id) for n in run.nodes}
        assert run.submit(run.nodes[0], 0, frames[1]).status_code == 202
        filler = tmpfs / "filler"
        _fill(filler)
        r = run.submit(run.nodes[1], 0, frames[2])
        assert _is_json_507(r) and "No space left on device" in r.json()["detail"], r.text
        # The others: what still fits in SQLite's free space may succeed; none is a 500.
        created = client.post("/v1/runs", json={}, headers=bearer(ADMIN))
        for r in (created, client.post(run.url("/nodes"), json={}, headers=bearer(ADMIN))):
            assert r.status_code == 201 or _is_json_507(r), (r.status_code, r.text)
        if created.status_code == 201:  # its initial state does not fit
            r = client.put(
                f"/v1/runs/{created.json()['run_id']}/state",
                content=state_to_bytes(tiny_state()),
                headers=bearer(ADMIN),
            )
            assert _is_json_507(r), (r.status_code, r.text)
        assert client.get("/readyz").status_code == 503
        os.unlink(filler)
        assert _wait(lambda: client.get("/readyz").status_code == 200, timeout=5)
        assert run.submit(run.nodes[1], 0, frames[2]).status_code == 202
        # The round closes at its deadline onto a full disk: retried with backoff, then published.
        _fill(filler)
        assert _wait(lambda: metric(client, "gradwire_round_close_failures_total", 'cause="storage"') >= 3)
        os.unlink(filler)
        run.wait_version(1, timeout=10)
        state = client.get(run.url("/state"), headers=run.admin)
        assert state_hash(state_from_bytes(state.content)) == state.headers["X-Gradwire-Weights-Hash"]
    log = (tmp_path / "server.log").read_text()
    assert "cannot rollback" not in log and "Traceback" not in log, log[-3000:]
    assert log.count("storage cannot write: No space left on device") == 2, log[-3000:]
    assert log.count("closing round 0 failed") == 1 and log.count("round 0 closed after") == 1, log[-3000:]
