"""One server per data directory: a second server on a held directory exits at once naming the holder,
``serve --check`` reports it, the lock dies with its process (kill -9), and an unusable directory is one
clear line with exit status 2 rather than a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gradwire_server.dirlock import LOCK_NAME, DataDirLock, DataDirLocked, lock_holder
from live_server import LiveServer, free_port


def _second_server(data_dir: Path, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "gradwire_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--data-dir",
            str(data_dir),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "GRADWIRE_ADMIN_TOKEN": "t"},
    )


def _cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gradwire_apps.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_second_server_on_a_held_directory_exits_naming_the_holder(tmp_path):
    server = LiveServer(tmp_path / "data")
    try:
        second = _second_server(tmp_path / "data")
        assert second.returncode == 1, second.stderr
        assert str(tmp_path / "data") in second.stderr
        assert f"process {server.process.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        # The first server is untouched and still answers.
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
        check = _cli("serve", "--check", "--data-dir", str(tmp_path / "data"))
        assert check.returncode == 1
        assert f"in use by process {server.process.pid}" in check.stderr
    finally:
        server.close()


def test_restart_after_kill_9_takes_the_directory_at_once(tmp_path):
    server = LiveServer(tmp_path / "data")
    try:
        pid = server.process.pid
        assert lock_holder(tmp_path / "data") == pid
        server.kill()
        # The kernel dropped the flock with the process: nothing stale to clear by hand.
        assert lock_holder(tmp_path / "data") is None
        assert _cli("serve", "--check", "--data-dir", str(tmp_path / "data")).returncode == 0
        server.start()
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
        assert lock_holder(tmp_path / "data") == server.process.pid != pid
    finally:
        server.close()


def test_lock_is_counted_within_a_process_and_exclusive_across_opens(tmp_path):
    first = DataDirLock(tmp_path).acquire()
    again = DataDirLock(tmp_path).acquire()  # the same process: serve() then its Store
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    again.release()
    # Still held by `first`: another process is refused.
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from gradwire_server.dirlock import DataDirLock, DataDirLocked\n"
            "try:\n DataDirLock(sys.argv[1]).acquire()\nexcept DataDirLocked as e:\n print(e.pid); sys.exit(3)",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 3 and probe.stdout.strip() == str(os.getpid())
    first.release()
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from gradwire_server.dirlock import DataDirLock\nDataDirLock(sys.argv[1]).acquire()",
            str(tmp_path),
        ],
        timeout=60,
    )
    assert probe.returncode == 0


@pytest.mark.parametrize("command", [("serve", "--check"), ("serve", "--port", "0")])
def test_unusable_data_dir_is_one_line_and_exit_2(tmp_path, command):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for bad in ("/proc/nope", str(not_a_dir / "sub"), str(not_a_dir)):
        out = _cli(*command, "--data-dir", bad)
        assert out.returncode == 2, (bad, out.stderr)
        assert "Traceback" not in out.stderr
        assert bad in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_locked_error_names_directory_and_pid(tmp_path):
    exc = DataDirLocked(tmp_path, 4242)
    assert str(tmp_path) in str(exc) and "process 4242" in str(exc)
