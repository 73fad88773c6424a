"""The one place where refusals become HTTP answers: the status of every reason and the app's handlers.

Every refusal is answered ``{"error": reason, "detail": message}`` with the status below (docs/API.md)
and counted by reason in the rejection metrics. All are 4xx but the two storage reasons: a full disk is
507 ``insufficient_storage`` and a failing one 503 ``storage_unavailable`` (the request was fine; retry).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from gradwire.protocol import Reason

from .auth import admin, principal
from .errors import Rejected
from .routes.common import ERROR

__all__ = ["STATUS", "install_error_handlers"]

#: The HTTP status each reason is answered with.
STATUS: dict[Reason, int] = {
    Reason.BAD_REQUEST: 400,
    Reason.BAD_STATE: 400,
    Reason.BAD_FRAME: 400,
    Reason.MISSING_TOKEN: 401,
    Reason.INVALID_TOKEN: 401,
    Reason.FORBIDDEN: 403,
    Reason.NOT_FOUND: 404,
    Reason.UNKNOWN_RUN: 404,
    Reason.UNKNOWN_NODE: 404,
    Reason.METHOD_NOT_ALLOWED: 405,
    Reason.ALREADY_STARTED: 409,
    Reason.STATE_NOT_SET: 409,
    Reason.ROUND_NOT_OPEN: 409,
    Reason.CONFLICTING_SUBMISSION: 409,
    Reason.REPLAYED_UPDATE: 409,
    Reason.RUN_PAUSED: 409,
    Reason.RUN_FAILED: 409,
    Reason.LIMIT_REACHED: 409,
    Reason.ROUND_CLOSED: 410,
    Reason.TOO_FAR_BEHIND: 410,
    Reason.FRAME_TOO_LARGE: 413,
    Reason.UPLOAD_IN_PROGRESS: 429,
    Reason.BUSY: 429,
    Reason.STATE_TOO_LARGE: 413,
    Reason.INVALID_REQUEST: 422,
    Reason.VERSION_AHEAD: 422,
    Reason.NOT_A_BUNDLE: 422,
    Reason.SENDER_MISMATCH: 422,
    Reason.ROUND_MISMATCH: 422,
    Reason.RUN_BINDING_MISMATCH: 422,
    Reason.RUN_BINDING_MISSING: 422,
    Reason.TENSOR_MISMATCH: 422,
    Reason.NON_FINITE: 422,
    Reason.NORM_TOO_LARGE: 422,
    Reason.NO_OBJECT_STORE: 409,
    Reason.UPLOAD_KEY_MISMATCH: 422,
    Reason.UPLOAD_NOT_FOUND: 404,
    Reason.WRITTEN_AFTER_DEADLINE: 410,
    Reason.OBJECT_STORE_UNAVAILABLE: 503,
    Reason.STORAGE_UNAVAILABLE: 503,
    Reason.INSUFFICIENT_STORAGE: 507,
}


def _is_update_submission(request: Request) -> bool:
    return request.method == "POST" and request.url.path.endswith("/updates")


def install_error_handlers(app: FastAPI, reject: Callable[[str, bool], None]) -> None:
    """Answer every refusal as JSON with its status; ``reject(reason, is_update)`` counts it."""

    def answer(
        request: Request, status: int, reason: str, detail: str, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        reject(reason, _is_update_submission(request))
        return JSONResponse({"error": reason, "detail": detail}, status_code=status, headers=headers)

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, exc: Rejected):
        return answer(request, STATUS[exc.reason], exc.reason.value, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        # The checks before the request itself come first (docs/API.md): FastAPI parses a JSON body before
        # it runs a route's dependencies, so a body that is not JSON reaches here without them.
        try:
            await _auth_dependencies(request)
        except Rejected as refused:
            return await _rejected(request, refused)
        body = await request.body()
        detail = "; ".join(_validation_message(e, body) for e in exc.errors())
        return answer(request, STATUS[Reason.INVALID_REQUEST], Reason.INVALID_REQUEST.value, detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        reason = {404: Reason.NOT_FOUND, 405: Reason.METHOD_NOT_ALLOWED}.get(exc.status_code, Reason.HTTP_ERROR)
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            # RFC 9110: `Allow` lists every method of the resource; Starlette's lists only the first route
            # of the path's, and a path such as /v1/runs/{run_id} has a route per method.
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return answer(request, exc.status_code, reason.value, str(exc.detail), headers)

    _document_errors(app)


def _validation_message(error: dict, body: bytes) -> str:
    """One validation error as ``where: what``; a body that is not JSON says where it breaks (line, column
    and byte offset) and the decoder's own words, not FastAPI's bare "body.20: JSON decode error"."""
    if error.get("type") == "json_invalid":
        loc = error.get("loc", ())
        at = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
        why = (error.get("ctx") or {}).get("error") or error.get("msg", "invalid JSON")
        if at is None:
            return f"the body is not valid JSON: {why}"
        before = body[:at]
        line, column = before.count(b"\n") + 1, at - (before.rfind(b"\n") + 1) + 1
        return f"the body is not valid JSON: {why} at line {line}, column {column} (byte {at})"
    return f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"


#: The dependencies that authenticate and authorize (401, 404 for the run, 403): run before a 422.
_AUTH_DEPENDENCIES = (admin, principal)


async def _auth_dependencies(request: Request) -> None:
    """Run the matched route's authentication dependencies (they raise ``Rejected``)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    for dependency in getattr(dependant, "dependencies", ()):
        if dependency.call in _AUTH_DEPENDENCIES:
            await dependency.call(request)


#: The methods a resource may have (HEAD comes with GET, as Starlette serves it).
_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def _allowed_methods(request: Request) -> list[str]:
    """The methods that some route of the app fully matches at the request's path."""
    allowed = [
        m
        for m in _METHODS
        if any(route.matches({**request.scope, "method": m})[0] == Match.FULL for route in request.app.router.routes)
    ]
    return allowed + (["HEAD"] if "GET" in allowed else [])


#: The answers any request may get besides its operation's own (docs/API.md, Conventions).
_COMMON_ERRORS = {
    "400": "bad_request: an invalid Content-Length",
    "422": "invalid_request: a parameter or JSON body that does not validate",
}


def _document_errors(app: FastAPI) -> None:
    """``/openapi.json`` declares, on every operation, the errors any request may get, in the JSON shape the
    handlers above send: FastAPI's own 422 declaration is its ``HTTPValidationError``, which this server
    never sends."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.setdefault("responses", {})
                for status, description in _COMMON_ERRORS.items():
                    declared = responses.get(status, {})
                    responses[status] = {**ERROR, "description": declared.get("description", description)}
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        return schema

    app.openapi = openapi
