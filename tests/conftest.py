"""Shared pytest fixtures: a live aggregation server on loopback.

The server package is imported as installed (``make test`` installs ``./server``); this folder is on
``sys.path`` through pytest's ``pythonpath`` setting in pyproject.toml.
"""

from __future__ import annotations

import pytest

from live_server import LiveServer


@pytest.fixture
def live_server(tmp_path):
    """A running ``gradwire_server`` on 127.0.0.1 with admin token ``test-admin``; stopped afterwards."""
    server = LiveServer(tmp_path / "server-data")
    try:
        yield server
    finally:
        server.close()
