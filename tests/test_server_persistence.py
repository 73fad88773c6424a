"""Crash safety: kill -9 at any moment loses no acknowledged update and applies nothing twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

import gradwire
from gradwire.client import split_frames
from gradwire.state import apply_update, state_hash
from gradwire_server.store import atomic_write
from live_server import LiveServer
from server_helpers import dct_frame, eventually, make_run, random_grads, tiny_state

CONFIG = dict(optimizer={"lr": 0.01}, downlink={"codec": "dct", "params": {"chunk_shape": [64], "topk": 8}})


def _frame(rnd, node_id):
    return dct_frame(random_grads(1000 * rnd + node_id), rnd, node_id)


@pytest.fixture
def server(tmp_path):
    with LiveServer(tmp_path / "data") as srv:
        yield srv


def _client(srv):
    return httpx.Client(base_url=srv.url, timeout=60)


def _reference_hashes(srv, rounds, n_nodes):
    """Hashes of versions 1..rounds of a run that sees the same frames and never crashes."""
    with _client(srv) as c:
        ref = make_run(c, srv.admin_token, n_nodes=n_nodes, quorum=n_nodes, **CONFIG)
        hashes = []
        for rnd in range(rounds):
            for node in ref.nodes:
                assert ref.submit(node, rnd, _frame(rnd, node.node_id)).status_code == 202
            hashes.append(ref.wait_version(rnd + 1).headers["X-Gradwire-Weights-Hash"])
        return hashes


def test_kill_mid_round_keeps_every_acknowledged_update(server):
    with _client(server) as c:
        run = make_run(c, server.admin_token, n_nodes=3, quorum=3, **CONFIG)
        for node in run.nodes[:2]:
            r = run.submit(node, 0, _frame(0, node.node_id))
            assert r.status_code == 202 and not r.json()["duplicate"]
    server.kill()
    server.start()
    with _client(server) as c:
        run.client = c
        st = run.status()
        assert st["version"] == 0 and st["submitted"] == 2
        again = run.submit(run.nodes[0], 0, _frame(0, 1))
        assert again.status_code == 202 and again.json()["duplicate"] is True and again.json()["submitted"] == 2
        conflict = run.submit(run.nodes[1], 0, _frame(0, 99))
        assert conflict.status_code == 409
        assert run.submit(run.nodes[2], 0, _frame(0, 3)).status_code == 202
        published = run.wait_version(1).headers["X-Gradwire-Weights-Hash"]
    assert published == _reference_hashes(server, 1, 3)[0]


def test_kill_right_after_quorum_applies_each_round_exactly_once(server):
    rounds = 3
    with _client(server) as c:
        run = make_run(c, server.admin_token, n_nodes=2, quorum=2, **CONFIG)
        replica = tiny_state()
    for rnd in range(rounds):
        with _client(server) as c:
            run.client = c
            for node in run.nodes:
                assert run.submit(node, rnd, _frame(rnd, node.node_id)).status_code == 202
        # The quorum is reached: the round is closing (aggregate, AdamW, files, commit) as we kill it.
        server.kill()
        server.start()
        with _client(server) as c:
            run.client = c
            r = run.wait_version(rnd + 1)
            assert r.headers["X-Gradwire-Version"] == str(rnd + 1)
            for f in split_frames(r.content):
                apply_update(replica, gradwire.decode_bundle(f))
            assert state_hash(replica) == r.headers["X-Gradwire-Weights-Hash"]
    with _client(server) as c:
        run.client = c
        st = run.status()
    assert st["version"] == rounds and st["submitted"] == 0
    assert st["weights_hash"] == _reference_hashes(server, rounds, 2)[-1]


def test_graceful_restart_keeps_the_open_round(server):
    with _client(server) as c:
        run = make_run(c, server.admin_token, n_nodes=2, quorum=2, **CONFIG)
        assert run.submit(run.nodes[0], 0, _frame(0, 1)).status_code == 202
    server.stop()
    server.start()
    with _client(server) as c:
        run.client = c
        assert run.status()["submitted"] == 1
        assert run.submit(run.nodes[1], 0, _frame(0, 2)).status_code == 202
        assert run.wait_version(1).headers["X-Gradwire-Weights-Hash"] == _reference_hashes(server, 1, 2)[0]


def test_uncommitted_files_are_ignored_and_removed(server):
    with _client(server) as c:
        run = make_run(c, server.admin_token, n_nodes=1, **CONFIG)
        assert run.submit(run.nodes[0], 0, _frame(0, 1)).status_code == 202
        h1 = run.wait_version(1).headers["X-Gradwire-Weights-Hash"]
    server.kill()
    root = server.data_dir / "runs" / run.run_id
    planted = [
        root / "diffs" / "v000000002.gwf",
        root / "weights" / "v000000002.safetensors",
        root / "moments" / "v000000002.safetensors",
        root / "submissions" / f"r000000001-n1-{'ab' * 16}.gwf",
        root / "weights" / ".v000000002.safetensors.abcd.tmp",
    ]
    for p in planted:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"written before a crash, never committed")
    server.start()
    with _client(server) as c:
        run.client = c
        st = run.status()
        assert st["version"] == 1 and st["weights_hash"] == h1 and st["submitted"] == 0
        assert not any(p.exists() for p in planted)
        # The half-recorded submission left no trace: the node can submit round 1 afresh.
        r = run.submit(run.nodes[0], 1, _frame(1, 1))
        assert r.status_code == 202 and r.json()["duplicate"] is False
        run.wait_version(2)
    # Older states are pruned once a newer one is committed (just after its readers are woken).
    names = eventually(lambda: {p.name for p in (root / "weights").iterdir()}, {"v000000002.safetensors"})
    assert names == {"v000000002.safetensors"}


_WRITER = """
from pathlib import Path

from gradwire_server.store import atomic_write
path = Path({path!r})
i = 0
while True:
    atomic_write(path, bytes([1 + i % 2]) * (8 << 20))
    i += 1
"""


def test_atomic_write_survives_kill_9(tmp_path):
    path = tmp_path / "state.bin"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER.format(path=str(path))])
    try:
        # Wait (bounded) until it has replaced the file a few times — each rename is a new inode —
        # then kill it at whatever moment it has reached.
        deadline = time.monotonic() + 60
        inodes = set()
        while len(inodes) < 3:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                inodes.add(os.stat(path).st_ino)
            except FileNotFoundError:
                pass
            try:
                proc.wait(timeout=0.01)
            except subprocess.TimeoutExpired:
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    data = path.read_bytes()
    assert len(data) == 8 << 20 and data in (b"\x01" * (8 << 20), b"\x02" * (8 << 20))


def test_atomic_write_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    atomic_write(path, b"old contents")
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    real_write = os.write
    calls = []

    def failing_write(fd, data):  # a disk that fills up after the first chunk
        calls.append(1)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real_write(fd, bytes(data)[:3])

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(OSError):
        atomic_write(path, b"new contents that will not fit")
    monkeypatch.undo()
    assert path.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]
