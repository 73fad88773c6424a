"""Shared pytest fixtures: a live aggregation server on loopback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Tests import the server package from the source tree (it is also installable with `pip install ./server`).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_server import LiveServer  # noqa: E402


@pytest.fixture
def live_server(tmp_path):
    """A running ``gradwire_server`` on 127.0.0.1 with admin token ``test-admin``; killed afterwards."""
    server = LiveServer(tmp_path / "server-data")
    try:
        yield server
    finally:
        server.close()
