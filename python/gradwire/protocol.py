"""The REST protocol v1 of the aggregation server (docs/API.md), written once for both of its sides.

The client (:mod:`gradwire.client`) and the server (``gradwire_server``) import these names; neither
spells a header or an error reason of its own. The HTTP status each reason is answered with is the
server's business (one table in ``gradwire_server.http_errors``); the client reads the status from the
response and the reason from its JSON body ``{"error": reason, "detail": message}``.
"""

from __future__ import annotations

import enum

__all__ = [
    "API_PREFIX",
    "HASH_HEADER",
    "LATEST_VERSION_HEADER",
    "MAX_WAIT_S",
    "OCTET_STREAM",
    "Reason",
    "VERSION_HEADER",
]

#: Every route of API v1 lives under this prefix.
API_PREFIX = "/v1"
#: The run's version that a state or update response carries.
VERSION_HEADER = "X-Gradwire-Version"
#: ``gradwire.state.state_hash`` of the master weights at that version.
HASH_HEADER = "X-Gradwire-Weights-Hash"
#: The run's current version, beside ``X-Gradwire-Version`` in a downlink answer: when a page of versions
#: (``GET …/updates``) ends before it, the client asks again from where the page ended.
LATEST_VERSION_HEADER = "X-Gradwire-Latest-Version"
#: The media type of frames and safetensors bodies.
OCTET_STREAM = "application/octet-stream"
#: The server caps a long poll (``GET …/updates?wait=``) at this many seconds.
MAX_WAIT_S = 60.0


class Reason(str, enum.Enum):
    """The snake_case ``error`` of every refusal the server answers (docs/API.md lists when)."""

    # the request itself
    BAD_REQUEST = "bad_request"
    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HTTP_ERROR = "http_error"
    # who is asking
    MISSING_TOKEN = "missing_token"
    INVALID_TOKEN = "invalid_token"
    FORBIDDEN = "forbidden"
    # runs and their state
    UNKNOWN_RUN = "unknown_run"
    UNKNOWN_NODE = "unknown_node"
    RUN_PAUSED = "run_paused"
    RUN_FAILED = "run_failed"
    LIMIT_REACHED = "limit_reached"
    ALREADY_STARTED = "already_started"
    STATE_NOT_SET = "state_not_set"
    BAD_STATE = "bad_state"
    STATE_TOO_LARGE = "state_too_large"
    # versions and rounds
    VERSION_AHEAD = "version_ahead"
    TOO_FAR_BEHIND = "too_far_behind"
    ROUND_NOT_OPEN = "round_not_open"
    ROUND_CLOSED = "round_closed"
    CONFLICTING_SUBMISSION = "conflicting_submission"
    REPLAYED_UPDATE = "replayed_update"
    # the server's bounds (429: retry after the Retry-After seconds)
    UPLOAD_IN_PROGRESS = "upload_in_progress"
    BUSY = "busy"
    # the submitted frame
    FRAME_TOO_LARGE = "frame_too_large"
    BAD_FRAME = "bad_frame"
    NOT_A_BUNDLE = "not_a_bundle"
    SENDER_MISMATCH = "sender_mismatch"
    ROUND_MISMATCH = "round_mismatch"
    RUN_BINDING_MISMATCH = "run_binding_mismatch"
    RUN_BINDING_MISSING = "run_binding_missing"
    TENSOR_MISMATCH = "tensor_mismatch"
    NON_FINITE = "non_finite"
    NORM_TOO_LARGE = "norm_too_large"
    # uploads through the object store (docs/SERVER.md, "Object storage")
    NO_OBJECT_STORE = "no_object_store"
    UPLOAD_KEY_MISMATCH = "upload_key_mismatch"
    UPLOAD_NOT_FOUND = "upload_not_found"
    WRITTEN_AFTER_DEADLINE = "written_after_deadline"
    OBJECT_STORE_UNAVAILABLE = "object_store_unavailable"
    # the server's storage (5xx: nothing wrong with the request; retry later)
    STORAGE_UNAVAILABLE = "storage_unavailable"
    INSUFFICIENT_STORAGE = "insufficient_storage"

    def __str__(self) -> str:
        return self.value
