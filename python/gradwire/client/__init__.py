"""The client side of the aggregation server (docs/API.md).

- :mod:`.http_client`: :class:`GradwireClient`, one method per endpoint of REST API v1, with retries;
  the downlink bodies (:class:`UpdateBatch`, :class:`PublishedBatch`, :func:`split_frames`).
- :mod:`.errors`: a typed error per way a request fails (:class:`GradwireHTTPError` and its subclasses).
- :mod:`.node`: :class:`Node`, the per-step helper of a training loop, for every registered algorithm.
- :mod:`.validator`: :class:`Validator`, the per-round helper of a run's validator: scores each candidate update
  by the loss change it gives and posts the scores.
- :mod:`.admin_token`: :func:`read_admin_token`, ``GRADWIRE_ADMIN_TOKEN`` or the file the server generated.
- :mod:`.object_store`: :class:`StoreClient`, the PUTs and GETs through the presigned (or public) URLs an
  object-store server hands out: plain HTTP, no storage SDK, every object checked against its SHA-256.
"""

from __future__ import annotations

from .admin_token import AdminTokenError, read_admin_token
from .errors import (
    AuthError,
    ConflictError,
    FrameRejectedError,
    GradwireClientError,
    GradwireConnectionError,
    GradwireHTTPError,
    NotFoundError,
    ObjectStoreError,
    OutOfSyncError,
    ProtocolError,
    RequestRejectedError,
    RoundClosedError,
    TooFarBehindError,
)
from .http_client import GradwireClient, PublishedBatch, UpdateBatch, split_frames
from .node import Node
from .object_store import StoreClient
from .validator import Validator

__all__ = [
    "AdminTokenError",
    "AuthError",
    "ConflictError",
    "FrameRejectedError",
    "GradwireClient",
    "GradwireClientError",
    "GradwireConnectionError",
    "GradwireHTTPError",
    "Node",
    "NotFoundError",
    "ObjectStoreError",
    "OutOfSyncError",
    "ProtocolError",
    "PublishedBatch",
    "RequestRejectedError",
    "RoundClosedError",
    "StoreClient",
    "TooFarBehindError",
    "UpdateBatch",
    "Validator",
    "read_admin_token",
    "split_frames",
]
