"""A port another process holds stops the server at once, in one line with exit status 1, before the data
directory, the admin token or the store exist; `--check` says the same without serving; and `python -m
gradwire_server` and `gradwire serve` answer alike (one command line)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


@pytest.fixture
def held_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "gradwire_server"],
        ["-m", "gradwire_apps.cli", "serve"],
        ["-m", "gradwire_apps.cli", "serve", "--check"],
    ],
    ids=["python -m gradwire_server", "gradwire serve", "gradwire serve --check"],
)
def test_a_busy_port_is_one_line_and_nothing_is_created(held_port, tmp_path, command):
    data = tmp_path / "gradwire-data"
    env = {k: v for k, v in os.environ.items() if k != "GRADWIRE_ADMIN_TOKEN"}
    done = subprocess.run(
        [sys.executable, *command, "--port", str(held_port), "--data-dir", str(data)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    line = done.stderr.strip()
    prog = "gradwire-server" if "gradwire_server" in command else "gradwire serve"
    assert line == (
        f"{prog}: port {held_port} on 127.0.0.1 is in use by another process (another server?): stop it, or "
        "give this server another --port"
    )
    assert not data.exists()  # no directory, no admin_token, no store
