"""What the routers share: reading a bounded binary body, and OpenAPI declarations of binary bodies."""

from __future__ import annotations

from fastapi import Request, Response

from gradwire.protocol import HASH_HEADER, OCTET_STREAM, VERSION_HEADER

from ..errors import Reason, Rejected

__all__ = ["BINARY", "ERROR", "VERSION_HEADERS", "octet_request", "octet_response", "read_body", "server", "versioned_octets"]

BINARY = {"type": "string", "format": "binary"}
#: The JSON every 4xx carries.
ERROR = {"content": {"application/json": {"schema": {
    "type": "object",
    "properties": {"error": {"type": "string"}, "detail": {"type": "string"}},
    "required": ["error", "detail"],
}}}}


def octet_request(description: str) -> dict:
    """``openapi_extra`` declaring an application/octet-stream request body."""
    return {"requestBody": {"required": True, "description": description,
                            "content": {OCTET_STREAM: {"schema": BINARY}}}}


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


async def read_body(request: Request, limit: int, reason: Reason = Reason.FRAME_TOO_LARGE) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes.

    Content-Length is checked first; the stream is counted as it arrives, so no more than ``limit``
    bytes are ever buffered, whatever the header claimed.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise Rejected(Reason.BAD_REQUEST, f"invalid Content-Length {declared!r}") from None
        if n > limit:
            raise Rejected(reason, f"body of {n} bytes exceeds the limit of {limit} bytes")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Rejected(reason, f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
