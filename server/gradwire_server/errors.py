"""``ApiError``: a 4xx the server answers as ``{"error": reason, "detail": message}``."""

from __future__ import annotations

__all__ = ["ApiError"]


class ApiError(Exception):
    """A rejected request: HTTP ``status``, a snake_case ``reason`` and a human ``detail``."""

    def __init__(self, status: int, reason: str, detail: str, headers: dict[str, str] | None = None):
        super().__init__(f"{status} {reason}: {detail}")
        self.status = status
        self.reason = reason
        self.detail = detail
        self.headers = headers
