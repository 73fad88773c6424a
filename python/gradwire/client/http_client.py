"""The HTTP client of the aggregation server (docs/API.md): one reused connection, retries, typed errors.

:class:`GradwireClient` mirrors every endpoint of REST API v1. Errors the server answers with a 4xx carry
its ``{"error", "detail"}`` body and surface as a :class:`~gradwire.client.GradwireHTTPError` subclass
chosen by status and reason (:mod:`.errors`).

Retries: connection errors, 429 and 5xx are retried with capped, jittered exponential back-off. A
request that may already have reached the server (a read timeout, a dropped connection, a 5xx) is
retried only where repeating it is harmless: reads, ``put_state`` and frame submission, which the
server makes idempotent (the same bytes for the same node and round answer ``duplicate=true``).
Creating runs and registering nodes are retried only when the request surely never arrived (the
connection could not be opened) or the server refused it outright (429, 503).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from ..errors import FrameError
from ..frame import SERVER_SENDER, Frame, Limits, frame_length, read_frame
from ..protocol import API_PREFIX, HASH_HEADER, LATEST_VERSION_HEADER, MAX_WAIT_S, OCTET_STREAM, VERSION_HEADER
from ..published import Published, read_published
from ..state import state_from_bytes, state_hash, state_to_bytes, unpack_state_dict
from .errors import OutOfSyncError, ProtocolError, connection_error, http_error

__all__ = ["CandidateBatch", "GradwireClient", "PublishedBatch", "UpdateBatch", "split_frames"]

_OCTET = {"Content-Type": OCTET_STREAM}


# ---------------------------------------------------------------------------------------------
# Downlink bodies


@dataclass
class UpdateBatch:
    """The answer to ``updates(since=v)``: the frames publishing versions v+1 … ``version``, in order."""

    frames: list[bytes]
    version: int
    weights_hash: str


@dataclass
class PublishedBatch:
    """The answer to ``published(since=v)``: versions v+1 … ``version`` of a DeMo or SparseLoCo run."""

    versions: list[Published]
    version: int
    weights_hash: str
    nbytes: int


@dataclass
class CandidateBatch:
    """The answer to ``candidates_since(round, since=k)``: the round's candidate frames after the first ``k``
    (in commit order), how many it holds (``total``: the next ``since``), and whether it waits for scores."""

    frames: list[bytes]
    total: int
    scoring: bool
    round: int


#: The headers of a candidates answer: how many candidates the round holds, and whether it waits for scores.
CANDIDATES_HEADER = "X-Gradwire-Candidates"
SCORING_HEADER = "X-Gradwire-Scoring"


def split_frames(body: bytes, *, limits: Limits | None = None) -> list[bytes]:
    """Cut concatenated frames apart at each header's ``total_len``; every frame is fully checked.

    Raises :class:`~gradwire.FrameError` for a body that is not a whole number of valid frames
    (truncated, trailing bytes, garbage, a bad CRC).
    """
    return [chunk for chunk, _ in _read_frames(body, limits)]


def _read_frames(body: bytes, limits: Limits | None) -> list[tuple[bytes, Frame]]:
    lim = limits or Limits()
    view = memoryview(body)
    frames: list[tuple[bytes, Frame]] = []
    offset = 0
    while offset < len(view):
        try:
            total_len = frame_length(view[offset:])
        except FrameError as exc:
            raise FrameError(f"frame {len(frames)} at byte {offset}: {exc}") from None
        chunk = bytes(view[offset : offset + total_len])
        frames.append((chunk, read_frame(chunk, limits=lim)))  # magic, version, structure and CRC
        offset += total_len
    return frames


def _header_int(response: httpx.Response, name: str) -> int:
    value = response.headers.get(name)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"response lacks a valid {name} header (got {value!r})") from None


def _header_str(response: httpx.Response, name: str) -> str:
    value = response.headers.get(name)
    if not value:
        raise ProtocolError(f"response lacks the {name} header")
    return value


# ---------------------------------------------------------------------------------------------
# The client

# Transport errors after which the request surely never reached the server.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: How long an idle pooled connection is reused: under the server's keep-alive (5 s, uvicorn's default, which
#: httpx's own default equals), so the client drops it first. At equal bounds an upload sent as the server
#: closes the connection fails with "server disconnected", and a POST is not retried.
KEEPALIVE_EXPIRY_S = 2.0


class GradwireClient:
    """A client of one gradwire server, authenticated by one bearer token (a node's or the admin's).

    ``timeout`` bounds each request (a long poll gets its ``wait`` on top); ``retries`` is how many times
    a failed attempt is repeated; ``backoff`` the first delay in seconds, doubled each time, jittered and
    capped at ``max_backoff``. ``transport`` is handed to :class:`httpx.Client` (e.g. a mounted
    ``httpx.HTTPTransport`` with custom socket options). Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        backoff: float = 0.25,
        max_backoff: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ):
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=self.timeout,
            transport=transport,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )
        self._jitter = random.Random()
        #: Body bytes sent and received through this client (requests that got an answer).
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- plumbing --------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GradwireClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        delay = min(self.max_backoff, self.backoff * (2**attempt))
        delay *= 0.5 + 0.5 * self._jitter.random()  # jitter: nodes that failed together retry apart
        if response is not None:
            # A 429/503 may say how long to stay away; honour it, within the cap.
            try:
                delay = max(delay, min(self.max_backoff, float(response.headers.get("Retry-After", ""))))
            except ValueError:
                pass
        return delay

    def _request(
        self,
        method: str,
        path: str,
        *,
        idempotent: bool,
        frame_request: bool = False,
        extra_timeout: float = 0.0,
        **kwargs: Any,
    ) -> httpx.Response:
        timeout = httpx.Timeout(self.timeout + extra_timeout, connect=self.timeout)
        sent = len(kwargs.get("content") or b"")
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                response = self._http.request(method, path, timeout=timeout, **kwargs)
            except httpx.TransportError as exc:
                if attempt >= self.retries or not (idempotent or isinstance(exc, _NOT_SENT)):
                    # One line, no chain: what failed, where, how often; the transport's error stays on .cause.
                    raise connection_error(
                        self.url, method, path, exc, attempts=attempt + 1, seconds=time.monotonic() - started
                    ) from None
                time.sleep(self._delay(attempt, None))
                attempt += 1
                continue
            self.bytes_sent += sent
            self.bytes_received += len(response.content)
            status = response.status_code
            retryable = status == 429 or status == 503 or (status >= 500 and idempotent)
            if retryable and attempt < self.retries:
                time.sleep(self._delay(attempt, response))
                attempt += 1
                continue
            if status >= 400:
                raise http_error(response, frame_request=frame_request)
            return response

    # -- service ---------------------------------------------------------------------------------

    def health(self) -> dict:
        """``GET /healthz``: ``{"status": "ok"}`` while the process is alive."""
        return self._request("GET", "/healthz", idempotent=True).json()

    def ready(self) -> bool:
        """``GET /readyz`` without retries: True once the store is open and recovery is done."""
        try:
            response = self._http.get("/readyz", timeout=self.timeout)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    def metrics(self) -> str:
        """``GET /metrics``: the Prometheus text exposition."""
        return self._request("GET", "/metrics", idempotent=True).text

    # -- runs (admin) ----------------------------------------------------------------------------

    def create_run(self, config: Mapping[str, Any] | None = None) -> str:
        """``POST /v1/runs`` with a RunConfig (every field optional); returns the new run id."""
        response = self._request("POST", f"{API_PREFIX}/runs", idempotent=False, json=dict(config or {}))
        return str(response.json()["run_id"])

    def put_state(self, run_id: str, state: Mapping[str, torch.Tensor]) -> dict:
        """``PUT /v1/runs/{run_id}/state``: the initial model; returns ``{"version": 0, "weights_hash"}``."""
        body = state_to_bytes(state)
        return self._request(
            "PUT", f"{API_PREFIX}/runs/{run_id}/state", idempotent=True, content=body, headers=_OCTET
        ).json()

    def register_node(self, run_id: str, name: str | None = None) -> tuple[int, str]:
        """``POST /v1/runs/{run_id}/nodes``; returns ``(node_id, token)`` — the token is shown only once."""
        body = self._request("POST", f"{API_PREFIX}/runs/{run_id}/nodes", idempotent=False, json={"name": name}).json()
        return int(body["node_id"]), str(body["token"])

    def register_validator(self, run_id: str, name: str | None = None) -> tuple[int, str]:
        """``POST /v1/runs/{run_id}/validators`` (admin); returns ``(validator_id, token)``, the token shown once."""
        body = self._request(
            "POST", f"{API_PREFIX}/runs/{run_id}/validators", idempotent=False, json={"name": name}
        ).json()
        return int(body["validator_id"]), str(body["token"])

    def candidates(self, run_id: str, round: int, wait: float = 0.0) -> list[bytes] | None:
        """``GET …/rounds/{round}/candidates`` (a validator's token): the round's candidate update frames once it
        waits for scores, in node-id order; ``None`` if it is not waiting yet after ``wait`` seconds."""
        response = self._request(
            "GET",
            f"{API_PREFIX}/runs/{run_id}/rounds/{round}/candidates",
            params={"wait": wait},
            idempotent=True,
            extra_timeout=wait,
        )
        return None if response.status_code == 204 else split_frames(response.content)

    def candidates_since(self, run_id: str, round: int, since: int = 0, wait: float = 0.0) -> CandidateBatch | None:
        """``GET …/rounds/{round}/candidates?since=`` (a validator's token): the round read as it fills. Answers
        as soon as the round holds a candidate after the first ``since`` (commit order), or waits for scores;
        a round not open yet is waited for too. ``None`` if nothing came within ``wait`` seconds. Pass the
        answer's ``total`` as the next ``since``; once ``scoring`` and nothing is left, score and post."""
        response = self._request(
            "GET",
            f"{API_PREFIX}/runs/{run_id}/rounds/{round}/candidates",
            params={"wait": wait, "since": int(since)},
            idempotent=True,
            extra_timeout=wait,
        )
        if response.status_code == 204:
            return None
        return CandidateBatch(
            frames=split_frames(response.content),
            total=_header_int(response, CANDIDATES_HEADER),
            scoring=_header_int(response, SCORING_HEADER) == 1,
            round=int(round),
        )

    def post_scores(self, run_id: str, round: int, scores: Mapping[int, float]) -> dict:
        """``POST …/rounds/{round}/scores`` (a validator's token): one score in [0, 1] per candidate, by node id."""
        body = {"scores": {str(int(n)): float(s) for n, s in scores.items()}}
        return self._request(
            "POST", f"{API_PREFIX}/runs/{run_id}/rounds/{round}/scores", idempotent=True, json=body
        ).json()

    def scores(self, run_id: str, first: int = 1, last: int | None = None) -> list[dict]:
        """``GET /v1/runs/{run_id}/scores`` (admin): each version's score weights and validators' scores."""
        params = {"first": first} | ({} if last is None else {"last": last})
        return self._request("GET", f"{API_PREFIX}/runs/{run_id}/scores", params=params, idempotent=True).json()

    def list_runs(self, limit: int | None = None, after: str | None = None) -> dict:
        """``GET /v1/runs`` (admin): ``{"runs": [status, …], "next": run_id | None}``, oldest first; pass
        ``next`` as ``after`` for the following page (``limit``: the server's default 100, at most 1000)."""
        params = {k: v for k, v in (("limit", limit), ("after", after)) if v is not None}
        return self._request("GET", f"{API_PREFIX}/runs", params=params, idempotent=True).json()

    def status(self, run_id: str) -> dict:
        """``GET /v1/runs/{run_id}``: version, open round, weights hash, status, submissions, config."""
        return self._request("GET", f"{API_PREFIX}/runs/{run_id}", idempotent=True).json()

    def pause_run(self, run_id: str) -> dict:
        """``POST /v1/runs/{run_id}/pause``: no round closes, updates refused; returns the run's status."""
        return self._request("POST", f"{API_PREFIX}/runs/{run_id}/pause", idempotent=True).json()

    def resume_run(self, run_id: str) -> dict:
        """``POST /v1/runs/{run_id}/resume``: a paused or failed run takes updates again; returns its status."""
        return self._request("POST", f"{API_PREFIX}/runs/{run_id}/resume", idempotent=True).json()

    def delete_run(self, run_id: str) -> None:
        """``DELETE /v1/runs/{run_id}``: the run, its nodes and its files."""
        self._request("DELETE", f"{API_PREFIX}/runs/{run_id}", idempotent=False)

    def nodes(self, run_id: str) -> list[dict]:
        """``GET /v1/runs/{run_id}/nodes``: ``[{"node_id", "name", "created_at", "token": "active" | "revoked"}]``."""
        return self._request("GET", f"{API_PREFIX}/runs/{run_id}/nodes", idempotent=True).json()

    def replace_token(self, run_id: str, node_id: int) -> str:
        """``POST /v1/runs/{run_id}/nodes/{node_id}/token``: a new token (shown once); the old one stops working."""
        body = self._request("POST", f"{API_PREFIX}/runs/{run_id}/nodes/{int(node_id)}/token", idempotent=False).json()
        return str(body["token"])

    def revoke_token(self, run_id: str, node_id: int) -> None:
        """``DELETE /v1/runs/{run_id}/nodes/{node_id}/token``: the node's token stops working."""
        self._request("DELETE", f"{API_PREFIX}/runs/{run_id}/nodes/{int(node_id)}/token", idempotent=True)

    def delete_node(self, run_id: str, node_id: int) -> None:
        """``DELETE /v1/runs/{run_id}/nodes/{node_id}``: the node goes; its id is never given again."""
        self._request("DELETE", f"{API_PREFIX}/runs/{run_id}/nodes/{int(node_id)}", idempotent=False)

    # -- rounds (node) ---------------------------------------------------------------------------

    def submit(self, run_id: str, round: int, frame: bytes) -> dict:
        """``POST`` a bundle frame to round ``round``; returns ``{"round", "node_id", "duplicate", "submitted"}``.

        The answer comes only once the server has durably recorded the frame. Resubmitting the same
        bytes is harmless (``duplicate=true``), which is why this call retries after any failure.
        """
        response = self._request(
            "POST",
            f"{API_PREFIX}/runs/{run_id}/rounds/{int(round)}/updates",
            idempotent=True,
            frame_request=True,
            content=bytes(frame),
            headers=_OCTET,
        )
        return response.json()

    # -- the object store (servers run with --object-store) -------------------------------------

    def upload_slot(self, run_id: str, round: int, nbytes: int, sha256: str) -> dict:
        """``POST …/rounds/{round}/slot``: a presigned PUT for this node's key of the round, bound to the
        frame's size and SHA-256 (hex): ``{"key", "url", "headers", "expires_at", "max_bytes"}``."""
        return self._request(
            "POST",
            f"{API_PREFIX}/runs/{run_id}/rounds/{int(round)}/slot",
            idempotent=True,
            json={"nbytes": int(nbytes), "sha256": sha256},
        ).json()

    def uploaded(self, run_id: str, round: int, key: str) -> dict:
        """``POST …/rounds/{round}/uploaded``: the frame is at ``key``; returns what :meth:`submit` returns,
        once the server has read and durably recorded it (the same key again is a duplicate: retried)."""
        return self._request(
            "POST",
            f"{API_PREFIX}/runs/{run_id}/rounds/{int(round)}/uploaded",
            idempotent=True,
            frame_request=True,
            json={"key": key},
        ).json()

    def objects(self, run_id: str, since: int | None = None, wait: float | None = None) -> dict:
        """``GET …/objects``: where the versions after ``since`` are in the object store (``None``: the
        store's checkpoint and the versions after it; also given when ``since`` is too far behind). The
        answer's pages are fetched in turn and joined: ``{"version", "latest", "weights_hash",
        "checkpoint", "versions"}`` up to the run's version."""
        params: dict[str, Any] = {} if since is None else {"since": int(since)}
        extra = 0.0
        if wait is not None and since is not None:
            params["wait"] = extra = min(float(wait), MAX_WAIT_S)
        path = f"{API_PREFIX}/runs/{run_id}/objects"
        manifest = self._request("GET", path, idempotent=True, params=params, extra_timeout=extra).json()
        while manifest["version"] < manifest["latest"]:
            page = self._request("GET", path, idempotent=True, params={"since": manifest["version"]}).json()
            if page["checkpoint"] is not None or page["version"] <= manifest["version"]:
                raise ProtocolError(f"a page of objects since {manifest['version']} did not continue the versions")
            manifest["versions"] += page["versions"]
            manifest.update(version=page["version"], latest=page["latest"], weights_hash=page["weights_hash"])
        return manifest

    def updates(
        self, run_id: str, since: int, wait: float | None = None, *, limits: Limits | None = None
    ) -> UpdateBatch:
        """``GET`` the downlink frames publishing versions ``since+1`` … current, each one checked.

        With ``wait`` the server holds the request up to that many seconds (≤ 60) for a version newer
        than ``since``. Raises :class:`TooFarBehindError` when those diffs are no longer kept,
        :class:`~gradwire.FrameError` for a body that is not valid frames and :class:`ProtocolError`
        when the frames do not produce versions ``since+1`` … current in order.
        """
        body, version, weights_hash = self._updates_body(run_id, since, wait)
        parsed = _read_frames(body, limits)
        frames = [chunk for chunk, _ in parsed]
        headers = [frame for _, frame in parsed]
        rounds = [h.round for h in headers]
        if rounds != list(range(int(since) + 1, version + 1)):
            raise ProtocolError(
                f"updates since {since} at version {version} should publish versions "
                f"{since + 1}..{version}, the frames publish {rounds[:8]}"
            )
        if any(h.sender != SERVER_SENDER or not h.bundle for h in headers):
            raise ProtocolError("a downlink frame is not a bundle frame from the server (sender 0xFFFFFFFF)")
        return UpdateBatch(frames=frames, version=version, weights_hash=weights_hash)

    def _updates_body(self, run_id: str, since: int, wait: float | None) -> tuple[bytes, int, str]:
        """The downlink bytes publishing ``since+1`` … the run's version, with that version and its weights
        hash. The server answers a long catch-up in pages (``X-Gradwire-Version`` where a page ends,
        ``X-Gradwire-Latest-Version`` the run's version then): the pages are fetched in turn, from where
        the last one ended, up to that version, and joined — the bytes one answer would have held."""
        params: dict[str, Any] = {"since": int(since)}
        extra = 0.0
        if wait is not None:
            wait = min(float(wait), MAX_WAIT_S)
            params["wait"] = wait
            extra = wait
        path = f"{API_PREFIX}/runs/{run_id}/updates"
        response = self._request("GET", path, idempotent=True, params=params, extra_timeout=extra)
        version = _header_int(response, VERSION_HEADER)
        weights_hash = _header_str(response, HASH_HEADER)
        latest = _header_int(response, LATEST_VERSION_HEADER) if LATEST_VERSION_HEADER in response.headers else version
        pages = [response.content]
        while version < latest:
            response = self._request("GET", path, idempotent=True, params={"since": version})
            reached = _header_int(response, VERSION_HEADER)
            if reached <= version or not response.content:
                raise ProtocolError(f"a page of updates since {version} ends at version {reached}: no progress")
            version, weights_hash = reached, _header_str(response, HASH_HEADER)
            pages.append(response.content)
        return b"".join(pages), version, weights_hash

    def published(
        self, run_id: str, since: int, *, wait: float | None = None, limits: Limits | None = None
    ) -> PublishedBatch:
        """``GET`` the versions ``since+1`` … current of a DeMo or SparseLoCo run (:mod:`gradwire.published`:
        each a weights header and the round's node frames), every frame checked.

        Raises like :meth:`updates`; :class:`ProtocolError` when the versions are not ``since+1`` … current.
        """
        body, version, weights_hash = self._updates_body(run_id, since, wait)
        versions = read_published(body, limits=limits)
        got = [p.version for p in versions]
        if got != list(range(int(since) + 1, version + 1)):
            raise ProtocolError(
                f"updates since {since} at version {version} should publish versions "
                f"{since + 1}..{version}, the body publishes {got[:8]}"
            )
        return PublishedBatch(versions=versions, version=version, weights_hash=weights_hash, nbytes=len(body))

    def algorithm_state(self, run_id: str) -> tuple[dict[str, Any], int, str]:
        """``GET`` the algorithm's node-relevant state (SparseLoCo's outer momentum): ``(state, version, hash)``."""
        response = self._request("GET", f"{API_PREFIX}/runs/{run_id}/state/algorithm", idempotent=True)
        try:
            state = unpack_state_dict(response.content)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc
        return state, _header_int(response, VERSION_HEADER), _header_str(response, HASH_HEADER)

    def state(self, run_id: str) -> tuple[dict[str, torch.Tensor], int, str]:
        """``GET`` the full fp32 state at the current version: ``(state, version, weights_hash)``.

        The state is checked against the hash header; :class:`OutOfSyncError` if they differ.
        """
        response = self._request("GET", f"{API_PREFIX}/runs/{run_id}/state", idempotent=True)
        version = _header_int(response, VERSION_HEADER)
        weights_hash = _header_str(response, HASH_HEADER)
        try:
            state = state_from_bytes(response.content)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc
        if state_hash(state) != weights_hash:
            raise OutOfSyncError(f"state at version {version} does not match its weights hash {weights_hash}")
        return state, version, weights_hash
