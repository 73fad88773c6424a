"""``Rejected``: the server's one domain error — a request refused for a reason of the REST protocol.

The round engine, validation, authentication and the routes raise it with a
:class:`gradwire.protocol.Reason` and a human ``detail``; none of them knows HTTP. The status each reason
is answered with lives in one place, :mod:`.http_errors`.
"""

from __future__ import annotations

from gradwire.protocol import Reason

__all__ = ["Reason", "Rejected", "STORAGE_RETRY_AFTER_S", "StorageFailed"]


class Rejected(Exception):
    """A refused request: a protocol ``reason``, a human ``detail``, and response headers if any."""

    def __init__(self, reason: Reason, detail: str, headers: dict[str, str] | None = None):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = Reason(reason)
        self.detail = detail
        self.headers = headers


#: Seconds a client is asked to wait (``Retry-After``) before trying a write again on failing storage.
STORAGE_RETRY_AFTER_S = 10


class StorageFailed(Rejected):
    """A write the store could not make: the disk is full (``full``: 507 ``insufficient_storage``: no space,
    a quota, SQLite's page limit) or failing (503 ``storage_unavailable``: an I/O error, a read-only file
    system). ``what`` names the write, ``cause`` is the operating system's or SQLite's own words."""

    def __init__(self, full: bool, what: str, cause: str):
        reason = Reason.INSUFFICIENT_STORAGE if full else Reason.STORAGE_UNAVAILABLE
        state = "full" if full else "failing"
        super().__init__(
            reason,
            f"{what}: the server's storage is {state} ({cause}); nothing was recorded, retry later",
            headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)},
        )
        self.full = full
        self.what = what
        self.cause = cause
