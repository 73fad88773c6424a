"""The client's errors: one class per way a request can fail, chosen from the server's status and its
snake_case reason (docs/API.md), so a training loop can tell "round closed, catch up" from "your frame is
bad"."""

from __future__ import annotations

import httpx

from ..protocol import Reason

__all__ = [
    "AuthError",
    "ConflictError",
    "FrameRejectedError",
    "GradwireClientError",
    "GradwireConnectionError",
    "GradwireHTTPError",
    "NotFoundError",
    "ObjectStoreError",
    "OutOfSyncError",
    "ProtocolError",
    "RequestRejectedError",
    "RoundClosedError",
    "TooFarBehindError",
    "connection_error",
    "http_error",
]


class GradwireClientError(RuntimeError):
    """Base of every error this module raises (besides :class:`~gradwire.FrameError` for bad frames)."""


class GradwireConnectionError(GradwireClientError):
    """The server could not be reached (or kept failing) after every retry. Its message is one line (the
    server's address, the request, the transport's error, the attempts); the transport's own exception is
    ``cause`` (not chained: a script that lets it through prints no page of httpx internals)."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


def connection_error(
    url: str, method: str, path: str, exc: BaseException, *, attempts: int, seconds: float
) -> GradwireConnectionError:
    """The :class:`GradwireConnectionError` for a request that failed ``attempts`` times over ``seconds``."""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        said = f"no gradwire server answers at {url}: is it running? (`gradwire serve`; {detail}"
    else:
        said = f"the gradwire server at {url} failed {method} {path} ({type(exc).__name__}: {detail}"
    tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
    return GradwireConnectionError(f"{said}; {tries} over {seconds:.1f} s)", exc)


class ProtocolError(GradwireClientError):
    """The server's answer breaks the API contract (a missing header, downlink frames that do not chain)."""


class OutOfSyncError(GradwireClientError):
    """The local replica's weights hash differs from the server's at the same version."""


class ObjectStoreError(GradwireClientError):
    """A request to the object store through a URL the server handed out failed: ``status`` is the store's
    HTTP status (0: it could not be reached), ``detail`` the store's own words. ``status`` 412 on an
    upload: the key was already written (``If-None-Match: *``)."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"object store: {status or 'unreachable'}: {detail}")
        self.status = status
        self.detail = detail


class GradwireHTTPError(GradwireClientError):
    """The server answered with an error status; ``error`` is its snake_case reason, ``detail`` its words."""

    def __init__(self, status: int, error: str, detail: str):
        super().__init__(f"{status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail


class AuthError(GradwireHTTPError):
    """401 (missing or invalid token) or 403 (a token not allowed here)."""


class NotFoundError(GradwireHTTPError):
    """404: no such run (or route)."""


class ConflictError(GradwireHTTPError):
    """409: a different frame was already recorded for this node and round, the round is not open yet,
    or the run has already started."""


class RoundClosedError(GradwireHTTPError):
    """410 ``round_closed``: the round was published before this submission arrived."""


class TooFarBehindError(GradwireHTTPError):
    """410 ``too_far_behind``: the server no longer keeps the diffs since that version; fetch the state."""


class RequestRejectedError(GradwireHTTPError):
    """400, 413 or 422: the server refused the request's content."""


class FrameRejectedError(RequestRejectedError):
    """A submitted frame was refused (bad bytes, too large, wrong sender/round/tensors, non-finite, norm)."""


def _error_class(status: int, error: str, *, frame_request: bool) -> type[GradwireHTTPError]:
    if status in (401, 403):
        return AuthError
    if status == 404:
        return NotFoundError
    if status == 409:
        return ConflictError
    if status == 410:
        return {
            Reason.ROUND_CLOSED.value: RoundClosedError,
            # An upload written to the object store after the round's deadline: the round closes without it.
            Reason.WRITTEN_AFTER_DEADLINE.value: RoundClosedError,
            Reason.TOO_FAR_BEHIND.value: TooFarBehindError,
        }.get(error, GradwireHTTPError)
    if status in (400, 413, 422):
        return FrameRejectedError if frame_request else RequestRejectedError
    return GradwireHTTPError


def http_error(response: httpx.Response, *, frame_request: bool = False) -> GradwireHTTPError:
    status = response.status_code
    error, detail = f"http_{status}", response.text[:500]
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        if isinstance(body.get("error"), str):
            error = body["error"]
        if "detail" in body:
            detail = body["detail"] if isinstance(body["detail"], str) else str(body["detail"])[:500]
    return _error_class(status, error, frame_request=frame_request)(status, error, detail)
