"""The client of the aggregation server (docs/API.md): one reused HTTP connection, retries, typed errors.

:class:`GradwireClient` mirrors every endpoint of REST API v1. Errors the server answers with a 4xx carry
its ``{"error", "detail"}`` body and surface as a :class:`GradwireHTTPError` subclass chosen by status
and reason, so a training loop can tell "round closed, catch up" from "your frame is bad".

Retries: connection errors, 429 and 5xx are retried with capped, jittered exponential back-off. A
request that may already have reached the server (a read timeout, a dropped connection, a 5xx) is
retried only where repeating it is harmless: reads, ``put_state`` and frame submission, which the
server makes idempotent (the same bytes for the same node and round answer ``duplicate=true``).
Creating runs and registering nodes are retried only when the request surely never arrived (the
connection could not be opened) or the server refused it outright (429, 503).

:class:`Node` is the per-step helper a training loop calls: compress the local gradients with error
feedback, submit them, wait for the round to publish, apply the published update frames to the local
replica (or load the full state when too far behind), and check the weights hash against the server's.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import httpx
import torch

from .codecs.base import Codec
from .errors import FrameError
from .algorithms import DeMoState, SparseLoCoState
from .feedback import ErrorFeedback
from .frame import SERVER_SENDER, Frame, Limits, decode_bundle, frame_length, read_frame, write_frame
from .model_record import ModelSpec, expand_model_mean, model_record_codec, run_spec
from .published import Published, apply_mean, read_published
from .protocol import API_PREFIX, HASH_HEADER, MAX_WAIT_S, OCTET_STREAM, VERSION_HEADER, Reason
from .state import apply_update, state_from_bytes, state_hash, state_to_bytes, unpack_state_dict

__all__ = [
    "AuthError",
    "ConflictError",
    "FrameRejectedError",
    "GradwireClient",
    "GradwireClientError",
    "GradwireConnectionError",
    "GradwireHTTPError",
    "Node",
    "NotFoundError",
    "OutOfSyncError",
    "ProtocolError",
    "PublishedBatch",
    "RequestRejectedError",
    "RoundClosedError",
    "TooFarBehindError",
    "UpdateBatch",
    "split_frames",
]

_OCTET = {"Content-Type": OCTET_STREAM}


# ---------------------------------------------------------------------------------------------
# Errors


class GradwireClientError(RuntimeError):
    """Base of every error this module raises (besides :class:`~gradwire.FrameError` for bad frames)."""


class GradwireConnectionError(GradwireClientError):
    """The server could not be reached (or kept failing) after every retry."""


class ProtocolError(GradwireClientError):
    """The server's answer breaks the API contract (a missing header, downlink frames that do not chain)."""


class OutOfSyncError(GradwireClientError):
    """The local replica's weights hash differs from the server's at the same version."""


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
        return {Reason.ROUND_CLOSED.value: RoundClosedError,
                Reason.TOO_FAR_BEHIND.value: TooFarBehindError}.get(error, GradwireHTTPError)
    if status in (400, 413, 422):
        return FrameRejectedError if frame_request else RequestRejectedError
    return GradwireHTTPError


def _http_error(response: httpx.Response, *, frame_request: bool = False) -> GradwireHTTPError:
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


def split_frames(body: bytes, *, limits: Optional[Limits] = None) -> list[bytes]:
    """Cut concatenated frames apart at each header's ``total_len``; every frame is fully checked.

    Raises :class:`~gradwire.FrameError` for a body that is not a whole number of valid frames
    (truncated, trailing bytes, garbage, a bad CRC).
    """
    return [chunk for chunk, _ in _read_frames(body, limits)]


def _read_frames(body: bytes, limits: Optional[Limits]) -> list[tuple[bytes, Frame]]:
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
        token: Optional[str] = None,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        backoff: float = 0.25,
        max_backoff: float = 10.0,
        transport: Optional[httpx.BaseTransport] = None,
    ):
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout, transport=transport)
        self._jitter = random.Random()
        #: Body bytes sent and received through this client (requests that got an answer).
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- plumbing --------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "GradwireClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _delay(self, attempt: int, response: Optional[httpx.Response]) -> float:
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
        while True:
            try:
                response = self._http.request(method, path, timeout=timeout, **kwargs)
            except httpx.TransportError as exc:
                if attempt >= self.retries or not (idempotent or isinstance(exc, _NOT_SENT)):
                    raise GradwireConnectionError(
                        f"{method} {self.url}{path}: {type(exc).__name__}: {exc} (after {attempt + 1} attempts)"
                    ) from exc
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
                raise _http_error(response, frame_request=frame_request)
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

    def create_run(self, config: Optional[Mapping[str, Any]] = None) -> str:
        """``POST /v1/runs`` with a RunConfig (every field optional); returns the new run id."""
        response = self._request("POST", f"{API_PREFIX}/runs", idempotent=False, json=dict(config or {}))
        return str(response.json()["run_id"])

    def put_state(self, run_id: str, state: Mapping[str, torch.Tensor]) -> dict:
        """``PUT /v1/runs/{run_id}/state``: the initial model; returns ``{"version": 0, "weights_hash"}``."""
        body = state_to_bytes(state)
        return self._request(
            "PUT", f"{API_PREFIX}/runs/{run_id}/state", idempotent=True, content=body, headers=_OCTET
        ).json()

    def register_node(self, run_id: str, name: Optional[str] = None) -> tuple[int, str]:
        """``POST /v1/runs/{run_id}/nodes``; returns ``(node_id, token)`` — the token is shown only once."""
        body = self._request("POST", f"{API_PREFIX}/runs/{run_id}/nodes", idempotent=False, json={"name": name}).json()
        return int(body["node_id"]), str(body["token"])

    def status(self, run_id: str) -> dict:
        """``GET /v1/runs/{run_id}``: version, open round, weights hash, submissions, config."""
        return self._request("GET", f"{API_PREFIX}/runs/{run_id}", idempotent=True).json()

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

    def updates(
        self, run_id: str, since: int, wait: Optional[float] = None, *, limits: Optional[Limits] = None
    ) -> UpdateBatch:
        """``GET`` the downlink frames publishing versions ``since+1`` … current, each one checked.

        With ``wait`` the server holds the request up to that many seconds (≤ 60) for a version newer
        than ``since``. Raises :class:`TooFarBehindError` when those diffs are no longer kept,
        :class:`~gradwire.FrameError` for a body that is not valid frames and :class:`ProtocolError`
        when the frames do not produce versions ``since+1`` … current in order.
        """
        response = self._updates_response(run_id, since, wait)
        version = _header_int(response, VERSION_HEADER)
        weights_hash = _header_str(response, HASH_HEADER)
        parsed = _read_frames(response.content, limits)
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

    def _updates_response(self, run_id: str, since: int, wait: Optional[float]) -> httpx.Response:
        params: dict[str, Any] = {"since": int(since)}
        extra = 0.0
        if wait is not None:
            wait = min(float(wait), MAX_WAIT_S)
            params["wait"] = wait
            extra = wait
        return self._request("GET", f"{API_PREFIX}/runs/{run_id}/updates", idempotent=True, params=params,
                             extra_timeout=extra)

    def published(
        self, run_id: str, since: int, *, wait: Optional[float] = None, limits: Optional[Limits] = None
    ) -> PublishedBatch:
        """``GET`` the versions ``since+1`` … current of a DeMo or SparseLoCo run (:mod:`gradwire.published`:
        each a weights header and the round's node frames), every frame checked.

        Raises like :meth:`updates`; :class:`ProtocolError` when the versions are not ``since+1`` … current.
        """
        response = self._updates_response(run_id, since, wait)
        version = _header_int(response, VERSION_HEADER)
        weights_hash = _header_str(response, HASH_HEADER)
        versions = read_published(response.content, limits=limits)
        got = [p.version for p in versions]
        if got != list(range(int(since) + 1, version + 1)):
            raise ProtocolError(f"updates since {since} at version {version} should publish versions "
                                f"{since + 1}..{version}, the body publishes {got[:8]}")
        return PublishedBatch(versions=versions, version=version, weights_hash=weights_hash,
                              nbytes=len(response.content))

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


# ---------------------------------------------------------------------------------------------
# The node helper


class Node:
    """One training node's side of a run: ``node.step()`` once per training step.

    ``model`` is a module (its named parameters, which must be float32, are the replica and are
    updated in place) or a mapping of named float32 tensors. The replica must have exactly the names
    and shapes of the run's state. The server applies the optimizer; the node only sends gradients and
    applies the published diffs, so no local optimizer steps.

    What happens to a gradient whose round closed before it arrived (410 ``round_closed``), or that
    finds a different frame already recorded for this node and round (409 ``conflicting_submission``,
    as after a restart): its contribution goes back into the error-feedback residual — as if the codec
    had dropped all of it — and is sent with the next step's gradient; the node then catches up to the
    next version as usual. :attr:`rounds_missed` counts these steps.

    Published diffs are decoded on ``decode_device`` (default the CPU, where the server decodes them)
    and then added on the replica's device: the decoders' float rounding may differ between devices,
    while the fp32 add is exact everywhere, so this keeps the replica bit-identical to the server.
    """

    def __init__(
        self,
        client: GradwireClient,
        run_id: str,
        model: Union[torch.nn.Module, Mapping[str, torch.Tensor]],
        codec: Codec,
        node_id: int,
        *,
        wait: float = 30.0,
        step_timeout: Optional[float] = 600.0,
        decode_device: Union[str, torch.device] = "cpu",
    ):
        self.client = client
        self.run_id = run_id
        self.node_id = int(node_id)
        self.module = model if isinstance(model, torch.nn.Module) else None
        if self.module is not None:
            # .data: the replica is advanced in place, outside autograd.
            self.params = {name: p.data for name, p in self.module.named_parameters()}
        else:
            self.params = dict(model)
        for name, t in self.params.items():
            if t.dtype != torch.float32:
                raise ValueError(f"replica tensor {name!r} is {t.dtype}; the server's master weights are float32")
        self.codec = codec
        self.feedback = ErrorFeedback(codec)
        #: The run's configuration (JSON, read at the first :meth:`sync`) and its algorithm.
        self.config: Optional[dict[str, Any]] = None
        self.algorithm: Optional[str] = None
        #: The run's model spec when it takes whole-model records (``model_record``), else None.
        self.model_spec: Optional[ModelSpec] = None
        self.demo: Optional[DeMoState] = None
        self.sparseloco: Optional[SparseLoCoState] = None
        #: SparseLoCo: the weights of the last synced version (the replica between syncs is local).
        self.anchor: Optional[dict[str, torch.Tensor]] = None
        self.inner: Optional[torch.optim.Optimizer] = None
        self.local_steps = 0
        self._algorithm_state: dict[str, Any] = {}
        self.wait = float(wait)
        self.step_timeout = step_timeout
        self.decode_device = torch.device(decode_device)
        #: The version the replica holds (None before the first :meth:`sync`).
        self.version: Optional[int] = None
        self.weights_hash: Optional[str] = None
        #: Uplink bytes (submitted frames) and downlink bytes (update frames and states) so far.
        self.bytes_sent = 0
        self.bytes_received = 0
        #: Steps whose gradient did not count (see above); full-state loads (joins and catch-ups).
        self.rounds_missed = 0
        self.state_loads = 0

    # -- replica ---------------------------------------------------------------------------------

    def _configure(self) -> None:
        """Read the run's algorithm and set up its node side (once)."""
        self.config = self.client.status(self.run_id)["config"]
        self.algorithm = self.config.get("algorithm", "adamw")
        # Runs with model_record take the whole model as one record (docs/FORMAT.md section 9).
        self.model_spec = run_spec(self.params) if self.config.get("model_record") else None
        codec = self.codec if self.model_spec is None else model_record_codec(self.codec)
        if self.algorithm == "demo":
            self.demo = DeMoState(codec, beta=float(self.config["demo"]["beta"]))
        elif self.algorithm == "sparseloco":
            sl = self.config["sparseloco"]
            if self.module is None:
                raise ValueError("a SparseLoCo node takes local optimizer steps: give it the module, not tensors")
            self.sparseloco = SparseLoCoState(codec, error_decay=float(sl["error_decay"]))
            inner = sl["inner"]
            self.inner = torch.optim.AdamW(self.module.parameters(), lr=float(inner["lr"]),
                                           betas=tuple(inner["betas"]), eps=float(inner["eps"]),
                                           weight_decay=float(inner["weight_decay"]))

    def sync(self) -> int:
        """Load the server's full state into the replica (at start, or when too far behind)."""
        if self.config is None:
            self._configure()
        for _ in range(5):
            version = self._load_state()
            if self.algorithm != "sparseloco":
                return version
            # The outer momentum must be that of the same version as the weights.
            state, at, _ = self.client.algorithm_state(self.run_id)
            if at == version:
                self._algorithm_state = state
                self.anchor = {n: t.detach().clone() for n, t in self.params.items()}
                return version
        raise ProtocolError(f"node {self.node_id}: the run kept publishing while its state was fetched")

    def _load_state(self) -> int:
        state, version, weights_hash = self.client.state(self.run_id)
        if set(state) != set(self.params):
            raise ValueError(
                f"the run's state names {sorted(set(state) ^ set(self.params))[:5]} differently from the replica"
            )
        with torch.no_grad():
            for name, dst in self.params.items():
                src = state[name]
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"run state {name!r} has shape {tuple(src.shape)}, the replica {tuple(dst.shape)}")
                dst.copy_(src)
        self.bytes_received += sum(t.numel() * t.element_size() for t in state.values())
        self.version, self.weights_hash = version, weights_hash
        self.state_loads += 1
        return version

    def catch_up(self, wait: Optional[float] = None) -> int:
        """Apply every update published since the replica's version (long-polling up to ``wait`` s for one).

        Falls back to the full state when the server no longer keeps those diffs. Verifies the weights
        hash afterwards; raises :class:`OutOfSyncError` if it differs from the server's.
        """
        if self.version is None:
            return self.sync()
        if self.algorithm != "adamw":
            return self._catch_up_published(wait)
        try:
            batch = self.client.updates(self.run_id, self.version, wait=wait)
        except TooFarBehindError:
            return self.sync()
        for frame in batch.frames:
            self.bytes_received += len(frame)
            update = decode_bundle(frame, device=self.decode_device)
            with torch.no_grad():
                apply_update(self.params, update)
            self.version += 1  # frames publish version+1, version+2, … (checked by updates())
        if batch.frames:
            local = state_hash(self.params)
            if local != batch.weights_hash:
                raise OutOfSyncError(
                    f"node {self.node_id} at version {batch.version}: weights hash {local}, server {batch.weights_hash}"
                )
        self.version, self.weights_hash = batch.version, batch.weights_hash
        return self.version

    def _catch_up_published(self, wait: Optional[float]) -> int:
        # DeMo applies each version's mean to the replica; SparseLoCo to the anchor, which then becomes
        # the replica (the local steps since the last sync are replaced by the synced weights).
        try:
            batch = self.client.published(self.run_id, self.version, wait=wait)
        except TooFarBehindError:
            return self.sync()
        self.bytes_received += batch.nbytes
        target = self.params if self.algorithm == "demo" else self.anchor
        for published in batch.versions:
            mean = published.mean(device=self.decode_device)
            if self.model_spec is not None:
                mean = dict(expand_model_mean(mean, self.model_spec))
            mean = {n: t.to(target[n].device) for n, t in mean.items()}
            with torch.no_grad():
                self._algorithm_state = apply_mean(self.algorithm, self.config, target, mean, self._algorithm_state)
            self.version += 1
        if batch.versions:
            if self.algorithm == "sparseloco":
                with torch.no_grad():
                    for n, p in self.params.items():
                        p.copy_(self.anchor[n])
            local = state_hash(target)
            if local != batch.weights_hash:
                raise OutOfSyncError(
                    f"node {self.node_id} at version {batch.version}: weights hash {local}, server {batch.weights_hash}"
                )
        self.version, self.weights_hash = batch.version, batch.weights_hash
        return self.version

    # -- one training step -----------------------------------------------------------------------

    def gradients(self) -> dict[str, torch.Tensor]:
        """The module's ``p.grad`` by name (zeros for parameters that got no gradient)."""
        if self.module is None:
            raise ValueError("this node was given tensors, not a module: pass the gradients to step()")
        return {
            name: (p.grad if p.grad is not None else torch.zeros_like(p))
            for name, p in self.module.named_parameters()
        }

    def step(self, grads: Optional[Mapping[str, torch.Tensor]] = None) -> int:
        """Send this step's gradients and advance the replica to the next published version.

        ``grads`` defaults to the module's ``p.grad``; they must have been computed on the weights of
        :attr:`version`. Returns the new version.
        """
        if self.version is None:
            self.sync()
        if self.algorithm == "sparseloco":
            return self._local_step(grads)
        grads = self.gradients() if grads is None else grads
        if set(grads) != set(self.params):
            raise ValueError(f"gradients name {sorted(set(grads) ^ set(self.params))[:5]} differently from the replica")
        round_ = int(self.version)
        ordered = {name: grads[name] for name in sorted(grads)}
        if self.algorithm == "demo":
            if self.model_spec is not None:
                ordered = {self.model_spec.record_name: self.model_spec.flatten(ordered)}
            records = self.demo.compress(ordered, float(self.config["demo"]["lr"]))
            frame = write_frame(records, round=round_, sender=self.node_id, bundle=True)
            return self._submit_and_advance(round_, frame, self.demo)
        frame = self.feedback.encode_bundle(ordered, round=round_, sender=self.node_id)
        return self._submit_and_advance(round_, frame, self.feedback)

    def _local_step(self, grads: Optional[Mapping[str, torch.Tensor]]) -> int:
        """SparseLoCo: one inner optimizer step; every ``sync_every``-th, send the pseudo-gradient and sync."""
        if grads is not None:
            params = dict(self.module.named_parameters())
            for name, g in grads.items():
                params[name].grad = g
        self.inner.step()
        self.local_steps += 1
        if self.local_steps % int(self.config["sparseloco"]["sync_every"]):
            return self.version
        round_ = int(self.version)
        if self.model_spec is None:
            records = self.sparseloco.compress(self.anchor, self.params)
        else:
            spec = self.model_spec
            records = self.sparseloco.compress({spec.record_name: spec.flatten(self.anchor)},
                                               {spec.record_name: spec.flatten(self.params)})
        frame = write_frame(records, round=round_, sender=self.node_id, bundle=True)
        return self._submit_and_advance(round_, frame, self.sparseloco)

    def _submit_and_advance(self, round_: int, frame: bytes, sender) -> int:
        """Submit ``frame`` for ``round_`` and wait until that round is published and applied.

        A frame that does not count goes back where its contents came from — ``sender.take_back``: the
        error-feedback residuals, DeMo's momenta or SparseLoCo's error buffers — as if nothing had been sent.
        """
        try:
            self.client.submit(self.run_id, round_, frame)
        except (RoundClosedError, ConflictError) as exc:
            # round_closed: the round was published without us. conflicting_submission: this node
            # already has a different frame recorded for the round (a restarted process); that one
            # counts. Either way this gradient did not, and the round still publishes: wait for it.
            if isinstance(exc, ConflictError) and exc.error != Reason.CONFLICTING_SUBMISSION.value:
                raise
            self.rounds_missed += 1
            sender.take_back(decode_bundle(frame))
        self.bytes_sent += len(frame)
        deadline = None if self.step_timeout is None else time.monotonic() + self.step_timeout
        while self.version <= round_:
            left = self.wait if deadline is None else min(self.wait, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"node {self.node_id}: round {round_} was not published within {self.step_timeout} s")
            self.catch_up(wait=left)
        return self.version

    def __repr__(self) -> str:
        return f"Node(run={self.run_id!r}, node_id={self.node_id}, version={self.version})"

