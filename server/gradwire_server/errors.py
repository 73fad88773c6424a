"""``Rejected``: the server's one domain error — a request refused for a reason of the REST protocol.

The round engine, validation, authentication and the routes raise it with a
:class:`gradwire.protocol.Reason` and a human ``detail``; none of them knows HTTP. The status each reason
is answered with lives in one place, :mod:`.http_errors`.
"""

from __future__ import annotations

from typing import Optional

from gradwire.protocol import Reason

__all__ = ["Reason", "Rejected"]


class Rejected(Exception):
    """A refused request: a protocol ``reason``, a human ``detail``, and response headers if any."""

    def __init__(self, reason: Reason, detail: str, headers: Optional[dict[str, str]] = None):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = Reason(reason)
        self.detail = detail
        self.headers = headers
