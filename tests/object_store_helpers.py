"""Helpers of the object-store tests: a server with a store on loopback, and an upload through a slot."""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Iterator

import httpx

from gradwire_server.app import create_app
from gradwire_server.loopback_store import LoopbackS3
from gradwire_server.settings import ServerSettings
from server_helpers import Node, Run, served


@contextlib.contextmanager
def store_env(s3: LoopbackS3) -> Iterator[None]:
    """The store's endpoint and credentials in this process's environment (as a server reads them)."""
    saved = {k: os.environ.get(k) for k in s3.env()}
    os.environ.update(s3.env())
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def store_server(s3: LoopbackS3, data_dir, **settings) -> Iterator[tuple[httpx.Client, object]]:
    """An in-process server (real uvicorn on loopback) whose object store is ``s3`` under a fresh prefix:
    ``(client, app)``."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with store_env(s3):
        app = create_app(
            ServerSettings(data_dir=data_dir, admin_token="test-admin", object_store=s3.url(prefix), **settings)
        )
        with served(app) as client:
            yield client, app


def upload(run: Run, node: Node, rnd: int, frame: bytes, store: httpx.Client | None = None) -> httpx.Response:
    """Slot, PUT to the store, tell: the server's answer to the tell (or the refused slot's)."""
    slot = run.client.post(
        run.url(f"/rounds/{rnd}/slot"),
        json={"nbytes": len(frame), "sha256": hashlib.sha256(frame).hexdigest()},
        headers=node.headers,
    )
    if slot.status_code != 200:
        return slot
    s = slot.json()
    put = (store or httpx).put(s["url"], content=frame, headers=s["headers"])
    # 412: the key holds an upload already (a retry): it is told all the same, as Node does.
    assert put.status_code in (200, 412), put.text
    return tell(run, node, rnd, s["key"])


def tell(run: Run, node: Node, rnd: int, key: str) -> httpx.Response:
    return run.client.post(run.url(f"/rounds/{rnd}/uploaded"), json={"key": key}, headers=node.headers)


def publish_through_store(run: Run, frame, first: int, last: int) -> None:
    """Rounds ``first … last - 1``: every node uploads ``frame(round, node_id)`` through the store (202
    each), then the version is waited for."""
    with httpx.Client() as store:
        for rnd in range(first, last):
            for node in run.nodes:
                r = upload(run, node, rnd, frame(rnd, node.node_id), store)
                assert r.status_code == 202, r.text
            run.wait_version(rnd + 1)
