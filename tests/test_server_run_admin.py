"""A run whose round close keeps failing the same way is marked failed (status, metrics, readiness) and
refuses updates until the admin resumes it; the admin pauses, resumes and deletes runs."""

from __future__ import annotations

import logging
import threading
import time

from gradwire_server.app import create_app
from gradwire_server.settings import ServerSettings
from server_helpers import dense_frame, make_run, metric, random_grads, served

ADMIN = "run-admin"


def _wait(condition, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_close_failing_the_same_way_marks_the_run_failed_until_resumed(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gradwire_server")
    settings = ServerSettings(
        data_dir=tmp_path,
        admin_token=ADMIN,
        close_retry_initial_s=0.05,
        close_retry_max_s=0.2,
        close_failures_before_failed=3,
        metrics_run_ids=True,
    )
    with served(create_app(settings)) as client:
        run = make_run(client, ADMIN, n_nodes=3, quorum=2)
        # The run's diffs folder is a file: publishing fails the same way every time (not for want of space).
        blocker = tmp_path / "runs" / run.run_id / "diffs"
        blocker.write_bytes(b"in the way")
        for node in run.nodes[:2]:
            assert run.submit(node, 0, dense_frame(random_grads(node.node_id), 0, node.node_id)).status_code == 202
        _wait(lambda: run.status()["status"] == "failed")
        st = run.status()
        assert st["version"] == 0 and "failed 3 times in a row: NotADirectoryError" in st["status_detail"]
        assert metric(client, "gradwire_runs", 'status="failed"') == 1
        assert metric(client, "gradwire_round_close_failures_total", 'cause="error"') == 3
        ready = client.get("/readyz")
        # One failed run does not take the server out of service; readiness names it (run ids are on here).
        assert ready.status_code == 200 and ready.json()["runs"]["failed"] == 1
        assert ready.json()["failed_runs"] == {run.run_id: st["status_detail"]}
        late = run.submit(run.nodes[2], 0, dense_frame(random_grads(3), 0, 3))
        assert (late.status_code, late.json()["error"]) == (409, "run_failed")
        time.sleep(0.5)  # no more retries while failed
        assert metric(client, "gradwire_round_close_failures_total", 'cause="error"') == 3

        blocker.unlink()
        r = client.post(run.url("/resume"), headers=run.admin)
        assert r.status_code == 200 and r.json()["status"] == "active" and r.json()["status_detail"] is None
        run.wait_version(1)
        assert metric(client, "gradwire_runs", 'status="failed"') == 0

    lines = [r for r in caplog.records if r.name == "gradwire_server.rounds" and r.levelno >= logging.WARNING]
    # The first failure (with its one traceback), the run marked failed, resumed by the admin: one line per change.
    assert len(lines) == 3, [r.getMessage() for r in lines]
    assert "closing round 0 failed: NotADirectoryError" in lines[0].getMessage() and lines[0].exc_info is not None
    assert "marked failed" in lines[1].getMessage() and lines[1].exc_info is None
    assert "resumed by the admin" in lines[2].getMessage()


def test_pause_resume_and_delete_a_run(tmp_path):
    settings = ServerSettings(data_dir=tmp_path, admin_token=ADMIN, metrics_run_ids=True)
    with served(create_app(settings)) as client:
        run = make_run(client, ADMIN, n_nodes=2, quorum=2)
        other = make_run(client, ADMIN, n_nodes=1, quorum=1)
        frame = lambda rnd, n: dense_frame(random_grads(10 * rnd + n), rnd, n)  # noqa: E731
        assert run.submit(run.nodes[0], 0, frame(0, 1)).status_code == 202
        # Paused: no update is taken and no round closes; reads go on.
        node_only = client.post(run.url("/pause"), headers=run.nodes[0].headers)
        assert (node_only.status_code, node_only.json()["error"]) == (403, "forbidden")
        assert client.post(run.url("/pause"), headers=run.admin).json()["status"] == "paused"
        r = run.submit(run.nodes[1], 0, frame(0, 2))
        assert (r.status_code, r.json()["error"]) == (409, "run_paused")
        assert client.get(run.url("/state"), headers=run.nodes[1].headers).status_code == 200
        assert metric(client, "gradwire_runs", 'status="paused"') == 1
        assert client.post(run.url("/resume"), headers=run.admin).json()["status"] == "active"
        assert run.submit(run.nodes[1], 0, frame(0, 2)).status_code == 202
        run.wait_version(1)
        assert f'gradwire_version{{run="{run.run_id}"}}' in client.get("/metrics").text

        # Deleted: its tokens, its rows, its files and its metric go, a long poll on it ends; the other run is
        # untouched.
        polled: list = []
        poll = threading.Thread(
            target=lambda: polled.append(
                client.get(run.url("/updates"), params={"since": 1, "wait": 30}, headers=run.nodes[0].headers)
            )
        )
        poll.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        r = client.delete(run.url(), headers=run.admin)
        assert r.status_code == 204
        poll.join(timeout=10)
        assert time.monotonic() - t0 < 5 and polled[0].json()["error"] == "unknown_run"
        assert client.get(run.url(), headers=run.admin).json()["error"] == "unknown_run"
        assert client.get(run.url(), headers=run.nodes[0].headers).json()["error"] == "invalid_token"
        assert not (tmp_path / "runs" / run.run_id).exists()
        assert run.run_id not in client.get("/metrics").text
        assert client.delete(run.url(), headers=run.admin).status_code == 404
        assert other.submit(other.nodes[0], 0, frame(0, 1)).status_code == 202
        other.wait_version(1)

    # After a restart the deleted run stays deleted and a paused run stays paused.
    with served(create_app(settings)) as client:
        assert client.post(other.url("/pause"), headers=other.admin).status_code == 200
        assert client.get(run.url(), headers=run.admin).status_code == 404
    with served(create_app(settings)) as client:
        other.client = client
        assert other.status()["status"] == "paused" and other.status()["version"] == 1


def test_a_run_that_cannot_be_recovered_is_failed_and_the_others_start(tmp_path):
    settings = ServerSettings(data_dir=tmp_path, admin_token=ADMIN)
    with served(create_app(settings)) as client:
        broken = make_run(client, ADMIN, n_nodes=1)
        fine = make_run(client, ADMIN, n_nodes=1)
    weights = next((tmp_path / "runs" / broken.run_id / "weights").iterdir())
    good = weights.read_bytes()
    weights.write_bytes(good[:-4] + b"\x00\x00\x80\x7f")  # its checkpoint no longer matches its hash
    with served(create_app(settings)) as client:
        assert client.get("/readyz").json()["runs"] == {"active": 1, "paused": 0, "failed": 1}
        broken.client = fine.client = client
        st = broken.status()
        assert st["status"] == "failed" and "does not match its hash" in st["status_detail"]
        r = broken.submit(broken.nodes[0], 0, dense_frame(random_grads(1), 0, 1))
        assert (r.status_code, r.json()["error"]) == (409, "run_failed")
        r = client.post(broken.url("/resume"), headers=broken.admin)
        assert (r.status_code, r.json()["error"]) == (409, "run_failed")  # still broken
        assert fine.submit(fine.nodes[0], 0, dense_frame(random_grads(1), 0, 1)).status_code == 202
        fine.wait_version(1)
        weights.write_bytes(good)
        assert client.post(broken.url("/resume"), headers=broken.admin).json()["status"] == "active"
        assert broken.submit(broken.nodes[0], 0, dense_frame(random_grads(1), 0, 1)).status_code == 202
        broken.wait_version(1)
