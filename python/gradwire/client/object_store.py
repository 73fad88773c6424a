"""A node's side of a server's object store (docs/SERVER.md, "Object storage"): plain HTTP through the URLs
the server hands out — a presigned PUT for its upload, presigned (or public, CDN) GETs for versions and
checkpoints — so a node needs no storage SDK and no credentials.

:class:`StoreClient` PUTs a frame with exactly the headers its slot names (``If-None-Match: *``, the
checksum; the length is the body's), and GETs an object, refusing one whose size or SHA-256 is not what
the server's manifest says (:class:`~gradwire.client.ProtocolError`) before anything parses it.
Connection errors, 429 and 5xx are retried with capped, jittered back-off; a PUT is idempotent here (the
same bytes to the same key), and a 412 means the key already holds an upload.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Mapping
from typing import Any

import httpx

from .errors import ObjectStoreError, ProtocolError

__all__ = ["StoreClient"]


class StoreClient:
    """PUTs and GETs through URLs handed out by the server (no token: the URL is the permission)."""

    def __init__(self, *, timeout: float = 60.0, retries: int = 5, backoff: float = 0.25, max_backoff: float = 10.0):
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self._http = httpx.Client(timeout=timeout, limits=httpx.Limits(keepalive_expiry=2.0))
        self._jitter = random.Random()
        #: Body bytes sent to and received from the store.
        self.bytes_sent = 0
        self.bytes_received = 0

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = self._http.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                if attempt >= self.retries:
                    raise ObjectStoreError(0, f"{method} {_where(url)}: {type(exc).__name__}: {exc}") from exc
            else:
                status = response.status_code
                if not (status == 429 or status >= 500) or attempt >= self.retries:
                    return response
            delay = min(self.max_backoff, self.backoff * 2**attempt) * (0.5 + 0.5 * self._jitter.random())
            time.sleep(delay)
            attempt += 1

    def put(self, url: str, headers: Mapping[str, str], data: bytes) -> None:
        """PUT ``data`` to a slot's ``url`` with its ``headers``. :class:`ObjectStoreError` if the store
        refuses it (``status`` 412: the key already holds an object)."""
        response = self._send("PUT", url, content=bytes(data), headers=dict(headers))
        if response.status_code >= 300:
            raise ObjectStoreError(response.status_code, f"PUT {_where(url)}: {response.text[:300]}")
        self.bytes_sent += len(data)

    def get(self, entry: Mapping[str, Any]) -> bytes:
        """The bytes of a manifest entry (``url``, ``nbytes``, ``sha256``), checked against both."""
        url, nbytes, sha256 = entry["url"], int(entry["nbytes"]), str(entry["sha256"])
        response = self._send("GET", url)
        if response.status_code != 200:
            raise ObjectStoreError(response.status_code, f"GET {_where(url)}: {response.text[:300]}")
        data = response.content
        self.bytes_received += len(data)
        if len(data) != nbytes:
            raise ProtocolError(f"the object at {_where(url)} is {len(data)} bytes, the server said {nbytes}")
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise ProtocolError(f"the object at {_where(url)} has SHA-256 {got}, the server said {sha256}")
        return data


def _where(url: str) -> str:
    """A URL without its query (a presigned URL's signature is a credential for a while)."""
    return url.split("?", 1)[0]
