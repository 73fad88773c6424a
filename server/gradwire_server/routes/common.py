"""What the routers share: reading a bounded binary body (into memory or spooled to a file), and OpenAPI
declarations of binary bodies."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Request, Response
from starlette.requests import ClientDisconnect

from gradwire.protocol import HASH_HEADER, OCTET_STREAM, VERSION_HEADER

from ..errors import Reason, Rejected

__all__ = [
    "BINARY",
    "ERROR",
    "VERSION_HEADERS",
    "declared_length",
    "octet_request",
    "octet_response",
    "read_body",
    "server",
    "spool_body",
    "versioned_octets",
]

BINARY = {"type": "string", "format": "binary"}
#: The JSON every 4xx carries.
ERROR = {
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"error": {"type": "string"}, "detail": {"type": "string"}},
                "required": ["error", "detail"],
            }
        }
    }
}


def octet_request(description: str) -> dict:
    """``openapi_extra`` declaring an application/octet-stream request body."""
    return {
        "requestBody": {"required": True, "description": description, "content": {OCTET_STREAM: {"schema": BINARY}}}
    }


def octet_response(description: str, headers: dict[str, str] | None = None) -> dict:
    out = {"description": description, "content": {OCTET_STREAM: {"schema": BINARY}}}
    if headers:
        out["headers"] = {k: {"description": v, "schema": {"type": "string"}} for k, v in headers.items()}
    return out


VERSION_HEADERS = {
    VERSION_HEADER: "the run's current version",
    HASH_HEADER: "state_hash of the master weights at that version",
}


def versioned_octets(data: bytes, version: int, weights_hash: str) -> Response:
    """Binary ``data`` with the run's version and weights hash in the protocol's headers."""
    return Response(data, media_type=OCTET_STREAM, headers={VERSION_HEADER: str(version), HASH_HEADER: weights_hash})


def server(request: Request):
    """The app's :class:`~gradwire_server.app.ServerContext`."""
    return request.app.state.server


def declared_length(request: Request, limit: int, reason: Reason = Reason.FRAME_TOO_LARGE) -> int | None:
    """The request's Content-Length (``None`` when it has none), refused with 413 above ``limit``: checked
    before any byte of the body is read."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    try:
        n = int(declared)
    except ValueError:
        raise Rejected(Reason.BAD_REQUEST, f"invalid Content-Length {declared!r}") from None
    if n > limit:
        raise Rejected(reason, f"body of {n} bytes exceeds the limit of {limit} bytes")
    return n


async def _chunks(request: Request, limit: int, reason: Reason) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive, refused with 413 as soon as they pass ``limit`` bytes."""
    declared_length(request, limit, reason)
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Rejected(reason, f"body exceeds the limit of {limit} bytes")
            yield chunk
    except ClientDisconnect:
        # The client went away, or was closed for sending too slowly (.connections): no one reads an answer.
        raise Rejected(Reason.BAD_REQUEST, "the client disconnected before the whole body arrived") from None


async def read_body(request: Request, limit: int, reason: Reason = Reason.FRAME_TOO_LARGE) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes.

    Content-Length is checked first; the stream is counted as it arrives, so no more than ``limit``
    bytes are ever buffered, whatever the header claimed.
    """
    return b"".join([chunk async for chunk in _chunks(request, limit, reason)])


#: Bytes gathered before one write to disk while a body is spooled to a file.
_SPOOL_WRITE_BYTES = 1 << 20


async def spool_body(request: Request, limit: int, folder: Path, reason: Reason) -> Path:
    """The request body written to a new file in ``folder`` as it arrives (never held in memory whole),
    refused with 413 past ``limit`` bytes; the caller removes the file. On any failure it is removed here."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".upload-", suffix=".tmp", dir=folder)
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            pending: list[bytes] = []
            held = 0
            async for chunk in _chunks(request, limit, reason):
                pending.append(chunk)
                held += len(chunk)
                if held >= _SPOOL_WRITE_BYTES:
                    await asyncio.to_thread(f.write, b"".join(pending))
                    pending, held = [], 0
            if pending:
                await asyncio.to_thread(f.write, b"".join(pending))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path
