"""Requests with a body and no valid token are refused before their body is read.

Every route under ``/v1/`` needs a token. FastAPI reads a route's body before its dependencies run (a JSON
body is parsed first), so without this gate a client with no token could send a header block announcing a
large body, then stall, and hold a socket — and its slot under ``max_connections`` — for the whole body
deadline. The gate runs before the app: a request that announces a body (``Content-Length`` > 0 or
``Transfer-Encoding``) and carries a missing, malformed or unknown bearer token is answered 401 at once,
in the same JSON as every other refusal. The answer begins before the body, so :mod:`.connections` marks
it ``Connection: close``, shuts its write side once it is sent, and drops what the client still sends
(the gate itself must not say ``close``: uvicorn would then reset the socket with the body unread, and
the client would read a reset instead of its 401). Authorization (403: the admin, the run)
stays with the routes; the gate only authenticates, with the same function they use (:func:`.auth.authenticate`).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .auth import authenticate, bearer_token
from .errors import Rejected
from .http_errors import STATUS

__all__ = ["TokenGate"]

#: The paths the gate guards (health and metrics need no token).
GUARDED_PREFIX = "/v1/"


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _announces_body(scope) -> bool:
    if _header(scope, b"transfer-encoding") is not None:
        return True
    length = _header(scope, b"content-length")
    try:
        return length is not None and int(length) > 0
    except ValueError:
        return True


class TokenGate:
    """ASGI middleware: 401 before the body for a request under ``/v1/`` with a body and no valid token."""

    def __init__(self, app, server):
        self.app = app
        self.server = server  # the app's ServerContext: admin token hash, store, metrics

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or not scope["path"].startswith(GUARDED_PREFIX)
            or not _announces_body(scope)
            or self.server.store is None
        ):
            await self.app(scope, receive, send)  # no store yet: the routes answer 503 as before
            return
        authorization = _header(scope, b"authorization")
        try:
            authenticate(self.server, bearer_token(authorization.decode("latin-1") if authorization else None))
        except Rejected as refused:
            is_update = scope["method"] == "POST" and scope["path"].endswith("/updates")
            self.server.metrics.reject(refused.reason.value, update=is_update)
            response = JSONResponse(
                {"error": refused.reason.value, "detail": refused.detail},
                status_code=STATUS[refused.reason],
                headers=refused.headers,
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
