"""Bearer tokens: one admin token, and one token per node and per validator, stored only as its SHA-256 hash.

The admin token is compared by its hash too (in constant time, ``hmac.compare_digest``): the server keeps
no token in the clear. A node's token is found by its hash in a map; a token is 32 random bytes, so what
a lookup's timing could reveal (bits of a SHA-256 of it) is no help in guessing one. A revoked or deleted
node's token has no entry: it is answered 401 ``invalid_token`` like any unknown token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from fastapi import Request

from .errors import Reason, Rejected

__all__ = ["Principal", "admin", "authenticate", "bearer_token", "hash_token", "new_token", "principal"]


def new_token() -> str:
    """32 random bytes, URL-safe base64: a node's token, shown once at registration."""
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: the admin, node ``node_id`` of run ``run_id``, or validator ``validator_id`` of it
    (docs/SERVER.md, "Validators"): a validator reads what a node reads and scores, and submits nothing."""

    admin: bool
    run_id: str | None = None
    node_id: int | None = None
    validator_id: int | None = None

    def require_validator(self, run_id: str) -> int:
        """A validator of ``run_id``; returns its validator id (403 for a node's token or the admin's)."""
        if self.validator_id is None:
            raise Rejected(Reason.FORBIDDEN, "this endpoint needs a validator token of the run")
        if self.run_id != run_id:
            raise Rejected(Reason.FORBIDDEN, "this token belongs to a validator of another run")
        return self.validator_id

    def require_admin(self) -> None:
        if not self.admin:
            raise Rejected(Reason.FORBIDDEN, "this endpoint needs the admin token")

    def require_member(self, run_id: str) -> None:
        """The admin, or a node of ``run_id``."""
        if not self.admin and self.run_id != run_id:
            raise Rejected(Reason.FORBIDDEN, "this token belongs to a node of another run")

    def require_node(self, run_id: str) -> int:
        """A node of ``run_id``; returns its node id."""
        if self.admin:
            raise Rejected(Reason.FORBIDDEN, "updates are submitted with a node token, not the admin token")
        if self.validator_id is not None:
            raise Rejected(Reason.FORBIDDEN, "updates are submitted with a node token, not a validator's")
        if self.run_id != run_id:
            raise Rejected(Reason.FORBIDDEN, "this token belongs to a node of another run")
        assert self.node_id is not None
        return self.node_id


def _bearer(request: Request) -> str:
    return bearer_token(request.headers.get("authorization"))


def bearer_token(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header (401 ``missing_token`` when absent or malformed)."""
    if not header:
        raise Rejected(
            Reason.MISSING_TOKEN, "send 'Authorization: Bearer <token>'", headers={"WWW-Authenticate": "Bearer"}
        )
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Rejected(
            Reason.MISSING_TOKEN,
            "the Authorization header must be 'Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return token.strip()


async def principal(request: Request) -> Principal:
    """FastAPI dependency: authenticate the bearer token (401 ``missing_token`` / ``invalid_token``)."""
    return authenticate(request.app.state.server, _bearer(request))


def authenticate(server, token: str) -> Principal:
    """Who ``token`` is: the admin, a node or a validator of the server's store (401 ``invalid_token`` when neither)."""
    token_hash = hash_token(token)
    if hmac.compare_digest(token_hash, server.admin_token_hash):
        return Principal(admin=True)
    node = server.store.node_by_token_hash(token_hash)
    if node is None:
        validator = server.store.validator_by_token_hash(token_hash)
        if validator is not None:
            return Principal(admin=False, run_id=validator.run_id, validator_id=validator.validator_id)
        raise Rejected(Reason.INVALID_TOKEN, "unknown bearer token", headers={"WWW-Authenticate": "Bearer"})
    return Principal(admin=False, run_id=node.run_id, node_id=node.node_id)


async def admin(request: Request) -> Principal:
    """FastAPI dependency of the admin endpoints: the token (401), the run of the path if it has one (404),
    then the admin (403) — docs/API.md's order — all before the request's body and parameters are
    validated, so a node's token gets 403 whatever it sent."""
    who = await principal(request)
    run_id = request.path_params.get("run_id")
    if run_id is not None:
        request.app.state.server.engine.runtime(run_id)
    who.require_admin()
    return who
