"""gradwire_server.launcher.LoopbackServer: the one way the demo, the tests and the benches start a server."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from gradwire_server.launcher import LoopbackServer, ServerStartError


def test_context_manager_starts_on_a_free_port_and_cleans_up():
    with LoopbackServer(env={"OMP_NUM_THREADS": "1"}) as server:
        assert server.running and server.url.startswith("http://127.0.0.1:")
        assert len(server.admin_token) >= 16  # random when not given
        data_dir = server.data_dir
        assert httpx.get(f"{server.url}/readyz").status_code == 200
        r = httpx.post(f"{server.url}/v1/runs", json={}, headers=server.admin_headers())
        assert r.status_code == 201, r.text
        run_id = r.json()["run_id"]
        port = server.port

        server.kill()  # SIGKILL: a crash
        assert not server.running and server.process.returncode == -signal.SIGKILL
        server.start()  # same port, same data: the run is still there
        assert server.port == port
        assert httpx.get(f"{server.url}/v1/runs/{run_id}", headers=server.admin_headers()).status_code == 200

        server.restart()  # graceful stop, then start again
        assert server.running and server.port == port
    assert server.process.returncode is not None  # stopped on exit
    assert not data_dir.exists()  # the temporary data directory it made is gone


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    server = LoopbackServer(tmp_path, extra_args=["--log-level", "no-such-level"], ready_timeout_s=60)
    with pytest.raises(ServerStartError, match="exited"):
        server.start()
    assert not server.running
    server.close()
    assert tmp_path.exists()  # a data directory it was given is left alone


def test_relative_pythonpath_entries_resolve_against_the_callers_directory(tmp_path, monkeypatch):
    # The server runs with its data directory as cwd; PYTHONPATH=python:server from a checkout must still
    # mean the checkout's code. A sitecustomize on a relative entry proves which directory it resolved to.
    marker = tmp_path / "imported"
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    pythonpath = os.pathsep.join(["shim", *filter(None, [os.environ.get("PYTHONPATH")])])
    with LoopbackServer(tmp_path / "data", env={"PYTHONPATH": pythonpath}) as server:
        assert server.running
    assert marker.exists()
