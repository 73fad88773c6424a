"""The round state machine of every run: accepting updates, closing rounds, publishing versions.

Round ``v`` is open while a run holds version ``v``. Acknowledged updates collect in memory (and on
disk, see :mod:`.store`); a run's driver task closes the round as soon as ``quorum`` distinct nodes
submitted, or at ``round_deadline_s`` after the round opened with at least ``min_updates`` (a straggler
never holds a round past its deadline; with fewer the round stays open until ``min_updates`` arrive).

Closing a round: aggregate (:mod:`.aggregate`) → AdamW on the fp32 master weights (:mod:`.optim`) →
``diff = target − master`` compressed by the downlink codec inside the run's one downlink
:class:`~gradwire.ErrorFeedback`, whose whole ``state_dict()`` (residuals and the codec's own state, e.g.
PowerSGD's warm-start factors) is carried from round to round and persisted with each version →
``master += decode_bundle(frame)`` with :func:`gradwire.state.apply_update`, the very operation nodes
run, so everyone applying the same frames holds bit-identical weights → durable publish, whose SQLite
commit makes version ``v + 1`` exist. Everything is computed on copies and adopted only after that
commit, so a failed publish leaves the run exactly as it was.

Concurrency: each run has one ``asyncio.Lock``; recording an update and closing a round both hold it,
so an update is either counted in the round being closed or refused as late — never acknowledged and
then lost. Heavy work runs in worker threads; the event loop only schedules.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from gradwire import ErrorFeedback, decode_bundle, read_frame
from gradwire.algorithms import exact_aggregate
from gradwire.frame import MAX_NAME_BYTES, SERVER_SENDER
from gradwire.published import apply_mean, write_published
from gradwire.state import apply_update, pack_state_dict, state_from_bytes, state_hash, state_to_bytes

from .aggregate import Update, aggregate, published_weights
from .config import RunConfig
from .errors import Reason, Rejected
from .metrics import Metrics
from .optim import AdamWState, adamw_step
from .settings import ServerSettings
from .store import Store, SubmissionRecord
from .validate import validate_update

__all__ = ["RoundEngine", "RunRuntime"]

log = logging.getLogger("gradwire_server.rounds")


@dataclass
class RunRuntime:
    """A run's live state. ``master``/``moments``/``server_state`` are replaced, never mutated, on publish."""

    run_id: str
    config: RunConfig
    version: int = 0
    weights_hash: Optional[str] = None
    opened_at: Optional[float] = None
    master: Optional[dict[str, torch.Tensor]] = None
    moments: Optional[AdamWState] = None
    server_state: dict[str, Any] = field(default_factory=dict)
    pending: dict[tuple[int, int], Update] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    published: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def spec(self) -> dict[str, tuple[int, ...]]:
        return {} if self.master is None else {n: tuple(t.shape) for n, t in self.master.items()}

    @property
    def dense_bytes(self) -> int:
        return 0 if self.master is None else sum(4 * t.numel() for t in self.master.values())

    def distinct_nodes(self) -> int:
        return len({node for node, _ in self.pending})

    def deadline(self) -> Optional[float]:
        return None if self.opened_at is None else self.opened_at + self.config.round_deadline_s


@dataclass
class _Published:
    version: int
    frame: bytes
    master: dict[str, torch.Tensor]
    moments: AdamWState
    server_state: dict[str, Any]
    weights_hash: str
    opened_at: float
    aggregate_s: float


class RoundEngine:
    """Every run's runtime, the per-run driver tasks, and the operations the routes call."""

    def __init__(self, store: Store, metrics: Metrics, settings: ServerSettings):
        self.store = store
        self.metrics = metrics
        self.settings = settings
        self.runs: dict[str, RunRuntime] = {}
        self._drivers: dict[str, asyncio.Task] = {}
        self._stopping = False

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Recover every run from the store and start its driver."""
        for rec in await asyncio.to_thread(self.store.list_runs):
            rt = await asyncio.to_thread(self._recover, rec.run_id)
            self.runs[rt.run_id] = rt
            self._start_driver(rt)
            log.info("recovered run %s at version %d with %d acknowledged update(s) in round %d",
                     rt.run_id, rt.version, len(rt.pending), rt.version)

    async def stop(self) -> None:
        """Stop the drivers after any round close in flight has finished (its commit is never cut)."""
        self._stopping = True
        for rt in self.runs.values():
            rt.wake.set()
        tasks = list(self._drivers.values())
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        for task in tasks:
            task.cancel()
        # Let submissions being recorded finish before the store closes.
        for rt in self.runs.values():
            try:
                await asyncio.wait_for(rt.lock.acquire(), timeout=30)
            except asyncio.TimeoutError:
                log.warning("run %s still busy at shutdown", rt.run_id)

    def _recover(self, run_id: str) -> RunRuntime:
        rec = self.store.get_run(run_id)
        assert rec is not None
        rt = RunRuntime(run_id=run_id, config=RunConfig.model_validate(rec.config), version=rec.version,
                        weights_hash=rec.weights_hash, opened_at=rec.round_opened_at)
        if not rec.has_state:
            return rt
        master = self.store.load_tensors(run_id, "weights", rec.version)
        if master is None:
            raise RuntimeError(f"run {run_id}: weights of committed version {rec.version} are missing")
        if state_hash(master) != rec.weights_hash:
            raise RuntimeError(f"run {run_id}: weights file of version {rec.version} does not match its hash")
        rt.master = dict(sorted(master.items()))
        moments = self.store.load_tensors(run_id, "moments", rec.version)
        rt.moments = (AdamWState.zeros_like(rt.master) if moments is None
                      else AdamWState.from_tensors(moments, step=rec.version))
        rt.server_state = self.store.load_server_state(run_id, rec.version)
        self.store.prune(run_id, rec.version, rt.config.keep_versions)
        for sub in self.store.submissions_for(run_id, rec.version):
            raw = self.store.read_submission(sub)
            frame = read_frame(raw)
            rt.pending[(sub.node_id, sub.round)] = Update(frame, sub.weight, sub.norm, sub.node_id, raw)
        self.metrics.version.labels(run=run_id).set(rt.version)
        return rt

    def _start_driver(self, rt: RunRuntime) -> None:
        self._drivers[rt.run_id] = asyncio.create_task(self._drive(rt), name=f"round-driver-{rt.run_id}")

    # -- runs and state ---------------------------------------------------------------------------

    def runtime(self, run_id: str) -> RunRuntime:
        try:
            return self.runs[run_id]
        except KeyError:
            raise Rejected(Reason.UNKNOWN_RUN, f"no run {run_id!r}") from None

    async def create_run(self, config: RunConfig) -> str:
        run_id = await asyncio.to_thread(self.store.create_run, config.model_dump(mode="json"))
        rt = RunRuntime(run_id=run_id, config=config)
        self.runs[run_id] = rt
        self._start_driver(rt)
        log.info("created run %s", run_id)
        return run_id

    async def set_state(self, run_id: str, body: bytes) -> dict:
        """Install the initial model (version 0) from safetensors bytes."""
        rt = self.runtime(run_id)
        async with rt.lock:
            if rt.version > 0 or rt.pending or await asyncio.to_thread(self.store.any_submission, run_id):
                raise Rejected(Reason.ALREADY_STARTED, "updates were already accepted; the initial state is fixed")
            master = await asyncio.to_thread(_parse_state, body)
            h = state_hash(master)
            opened = await asyncio.to_thread(self.store.set_initial_state, run_id, master, h)
            rt.master, rt.moments, rt.server_state = master, AdamWState.zeros_like(master), {}
            rt.weights_hash, rt.opened_at = h, opened
            self.metrics.version.labels(run=run_id).set(0)
        rt.wake.set()
        log.info("run %s: initial state of %d tensors, %d parameters", run_id, len(master),
                 sum(t.numel() for t in master.values()))
        return {"version": 0, "weights_hash": h}

    def status(self, run_id: str) -> dict:
        rt = self.runtime(run_id)
        deadline = rt.deadline()
        return {
            "run_id": run_id,
            "version": rt.version,
            "open_round": rt.version,
            "weights_hash": rt.weights_hash,
            "submitted": len(rt.pending),
            "quorum": rt.config.quorum,
            "nodes": self.store.node_count(run_id),
            "deadline_in_s": None if deadline is None else max(0.0, deadline - time.time()),
            "config": rt.config.model_dump(mode="json"),
        }

    def _require_state(self, rt: RunRuntime) -> dict[str, torch.Tensor]:
        if rt.master is None:
            raise Rejected(Reason.STATE_NOT_SET, "the run has no initial state yet (PUT /v1/runs/{run_id}/state)")
        return rt.master

    async def state_bytes(self, run_id: str) -> tuple[bytes, int, str]:
        rt = self.runtime(run_id)
        master = self._require_state(rt)
        version, h = rt.version, rt.weights_hash
        data = await asyncio.to_thread(state_to_bytes, master)
        return data, version, h

    async def algorithm_state_bytes(self, run_id: str) -> tuple[bytes, int, str]:
        """What a node needs beside the weights to apply the next versions as the server does (SparseLoCo's
        outer momentum; nothing for the other algorithms), packed, at the current version."""
        rt = self.runtime(run_id)
        self._require_state(rt)
        version, h = rt.version, rt.weights_hash
        public = {"outer": rt.server_state["outer"]} if "outer" in rt.server_state else {}
        data = await asyncio.to_thread(pack_state_dict, public)
        return data, version, h

    async def updates_since(self, run_id: str, since: int, wait: float) -> tuple[bytes, int, str]:
        """The diff frames publishing ``since+1 … current`` (long-polling up to ``wait`` seconds)."""
        rt = self.runtime(run_id)
        self._require_state(rt)
        if since > rt.version:
            raise Rejected(Reason.VERSION_AHEAD, f"version {since} is ahead of the run's {rt.version}")
        if since == rt.version and wait > 0:
            event = rt.published
            try:
                await asyncio.wait_for(event.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass
        version, h = rt.version, rt.weights_hash
        if since == version:
            return b"", version, h
        oldest = self.store.oldest_diff(run_id, version, rt.config.keep_versions)
        if since + 1 < oldest:
            raise Rejected(Reason.TOO_FAR_BEHIND, f"diffs before version {oldest} are no longer kept; fetch the full state")
        try:
            data = await asyncio.to_thread(self.store.read_diffs, run_id, since + 1, version)
        except FileNotFoundError:
            raise Rejected(Reason.TOO_FAR_BEHIND, "those diffs were just pruned; fetch the full state") from None
        return data, version, h

    # -- submissions ------------------------------------------------------------------------------

    def _existing(self, rt: RunRuntime, node_id: int, round: int, sha: str) -> Optional[dict]:
        """The 202 answer if these bytes were already recorded; 409 if other bytes were."""
        rec = self.store.get_submission(rt.run_id, node_id, round)
        if rec is None:
            return None
        if rec.sha256 != sha:
            raise Rejected(Reason.CONFLICTING_SUBMISSION, f"node {node_id} already submitted a different update for round {round}")
        return {"round": round, "node_id": node_id, "duplicate": True, "submitted": len(rt.pending)}

    def _weight_for(self, rt: RunRuntime, round: int) -> float:
        """1.0 for the open round; a staleness weight or a refusal for another one."""
        if round == rt.version:
            return 1.0
        if round > rt.version:
            raise Rejected(Reason.ROUND_NOT_OPEN, f"round {round} is not open; the open round is {rt.version}")
        if rt.config.late_policy == "staleness":
            # An update computed `s` versions ago counts with weight 1 / (1 + s) in the open round.
            return 1.0 / (1 + rt.version - round)
        raise Rejected(Reason.ROUND_CLOSED, f"round {round} is closed; the open round is {rt.version}")

    async def submit(self, run_id: str, node_id: int, round: int, body: bytes) -> dict:
        """Validate and durably record one update; the answer means it will be counted exactly once."""
        rt = self.runtime(run_id)
        self._require_state(rt)
        sha = hashlib.sha256(body).hexdigest()
        dup = self._existing(rt, node_id, round, sha)
        if dup is not None:
            return dup
        self._weight_for(rt, round)  # refuse late or early updates before parsing them
        spec = rt.spec
        t0 = time.perf_counter()
        frame, norm = await asyncio.to_thread(
            validate_update, body, spec, node_id=node_id, round=round,
            max_frame_bytes=rt.config.max_frame_bytes, max_update_norm=rt.config.max_update_norm)
        self.metrics.decode_seconds.observe(time.perf_counter() - t0)
        # Shielded: once recording has begun, a client that hangs up must not leave a durable record
        # that the open round does not count.
        answer = await asyncio.shield(asyncio.ensure_future(self._record(rt, node_id, round, sha, body, frame, norm)))
        if not answer["duplicate"]:
            self.metrics.updates_accepted.inc()
            self.metrics.compression_ratio.set(rt.dense_bytes / max(1, len(body)))
        return answer

    async def _record(self, rt, node_id, round, sha, body, frame, norm) -> dict:
        # The frame's file is written and fsynced outside the lock (its name carries the content hash, so
        # concurrent submissions never share a file); only the short SQLite commit is serialized.
        await asyncio.to_thread(self.store.write_submission, rt.run_id, round, node_id, sha, body)
        async with rt.lock:
            dup = self._existing(rt, node_id, round, sha)  # a concurrent identical request may have won
            if dup is not None:
                return dup
            weight = self._weight_for(rt, round)  # the round may have closed while we validated
            rec = SubmissionRecord(rt.run_id, node_id, round, rt.version, sha, len(body), weight, norm, time.time())
            await asyncio.to_thread(self.store.commit_submission, rec)
            rt.pending[(node_id, round)] = Update(frame, weight, norm, node_id, body)
            submitted = len(rt.pending)
        rt.wake.set()
        return {"round": round, "node_id": node_id, "duplicate": False, "submitted": submitted}

    # -- closing rounds ---------------------------------------------------------------------------

    def _ready(self, rt: RunRuntime, now: float) -> bool:
        if rt.master is None or not rt.pending:
            return False
        if rt.distinct_nodes() >= rt.config.quorum:
            return True
        deadline = rt.deadline()
        return deadline is not None and now >= deadline and len(rt.pending) >= rt.config.min_updates

    async def _drive(self, rt: RunRuntime) -> None:
        backoff = 0.0
        while not self._stopping:
            rt.wake.clear()
            now = time.time()
            if backoff == 0.0 and self._ready(rt, now):
                try:
                    await self.close_round(rt)
                except Exception:
                    log.exception("run %s: closing round %d failed; retrying", rt.run_id, rt.version)
                    backoff = 1.0
                continue
            deadline = rt.deadline()
            timeout = backoff or (None if deadline is None or deadline <= now else deadline - now)
            try:
                await asyncio.wait_for(rt.wake.wait(), timeout=timeout)
            except asyncio.TimeoutError:
                pass
            backoff = 0.0

    async def close_round(self, rt: RunRuntime) -> None:
        """Aggregate the open round, step, publish the next version (no-op if nothing is pending)."""
        async with rt.lock:
            if not rt.pending or rt.master is None:
                return
            # A fixed order (node id, then round) makes the aggregate independent of arrival order.
            updates = [rt.pending[k] for k in sorted(rt.pending)]
            t0 = time.perf_counter()
            pub = await asyncio.to_thread(self._publish, rt, updates)
            opened_before = rt.opened_at
            rt.master, rt.moments, rt.server_state = pub.master, pub.moments, pub.server_state
            rt.version, rt.weights_hash, rt.opened_at = pub.version, pub.weights_hash, pub.opened_at
            rt.pending = {}
            await asyncio.to_thread(self.store.prune, rt.run_id, rt.version, rt.config.keep_versions)
            event, rt.published = rt.published, asyncio.Event()
        event.set()
        m = self.metrics
        m.publish_seconds.observe(time.perf_counter() - t0)
        m.aggregate_seconds.observe(pub.aggregate_s)
        if opened_before is not None:
            m.round_duration.observe(max(0.0, pub.opened_at - opened_before))
        m.version.labels(run=rt.run_id).set(rt.version)
        log.info("run %s: published version %d from %d update(s), %d-byte diff frame, hash %s",
                 rt.run_id, rt.version, len(updates), len(pub.frame), rt.weights_hash)

    def _publish(self, rt: RunRuntime, updates: list[Update]) -> _Published:
        if rt.config.algorithm != "adamw":
            return self.average_and_publish(rt, updates)
        t0 = time.perf_counter()
        grads = self.aggregate_round(rt, updates)
        aggregate_s = time.perf_counter() - t0
        return self.step_and_publish(rt, grads, len(updates), aggregate_s)

    @staticmethod
    def aggregate_round(rt: RunRuntime, updates: list[Update]) -> dict[str, torch.Tensor]:
        """The round's aggregated gradient under the run's rule."""
        agg = rt.config.aggregation
        return aggregate(updates, sorted(rt.spec), agg.rule, agg.trim_fraction)

    def step_and_publish(self, rt: RunRuntime, grads: dict[str, torch.Tensor], n_updates: int,
                         aggregate_s: float = 0.0) -> _Published:
        """AdamW, downlink compression with error feedback, ``master += decode(frame)``, durable publish.

        Works on copies: ``rt`` is left untouched (the caller adopts the result after the commit).
        """
        cfg = rt.config
        master = rt.master
        assert master is not None and rt.moments is not None
        names = sorted(master)
        targets, moments = adamw_step(cfg.optimizer, master, grads, rt.moments)
        diff = {n: targets[n] - master[n] for n in names}
        # The downlink feedback continues from the last version's state (a copy: ``rt`` stays as it was
        # until the caller adopts the result after the commit).
        feedback = ErrorFeedback(cfg.downlink.build())
        feedback.load_state_dict(rt.server_state.get("downlink", {}))
        version = rt.version + 1
        frame = feedback.encode_bundle(diff, round=version, sender=SERVER_SENDER)
        new_master = {n: master[n].clone() for n in names}
        apply_update(new_master, decode_bundle(frame))
        h = state_hash(new_master)
        opened = time.time()
        server_state = {"downlink": feedback.state_dict()}
        self.store.publish(rt.run_id, version, frame, new_master, moments.to_tensors(), server_state, h,
                           n_updates, opened)
        return _Published(version, frame, new_master, moments, server_state, h, opened, aggregate_s)

    def average_and_publish(self, rt: RunRuntime, updates: list[Update]) -> _Published:
        """DeMo and SparseLoCo: the exact aggregate of the nodes' frames (weighted mean, or trimmed mean /
        median), applied to the master weights the way every node applies it, and published as those
        frames after their weights (and trim).

        Works on copies: ``rt`` is left untouched (the caller adopts the result after the commit).
        """
        cfg = rt.config
        master = rt.master
        assert master is not None
        t0 = time.perf_counter()
        weights, trim = published_weights(updates, cfg.aggregation.rule, cfg.aggregation.trim_fraction)
        mean = exact_aggregate([u.frame.entries for u in updates], weights, trim)
        aggregate_s = time.perf_counter() - t0
        new_master = {n: t.clone() for n, t in master.items()}
        server_state = apply_mean(cfg.algorithm, cfg.model_dump(mode="json"), new_master, mean, rt.server_state)
        version = rt.version + 1
        frame = write_published(version, [u.raw for u in updates], weights, trim)
        h = state_hash(new_master)
        opened = time.time()
        self.store.publish(rt.run_id, version, frame, new_master, {}, server_state, h, len(updates), opened)
        return _Published(version, frame, new_master, rt.moments, server_state, h, opened, aggregate_s)


def _parse_state(body: bytes) -> dict[str, torch.Tensor]:
    """Safetensors bytes → fp32 master weights, checked (never unpickled)."""
    try:
        state = state_from_bytes(body)
    except ValueError as exc:
        raise Rejected(Reason.BAD_STATE, str(exc)) from None
    if not state:
        raise Rejected(Reason.BAD_STATE, "the state holds no tensors")
    out = {}
    for name in sorted(state):
        t = state[name]
        if not name or len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise Rejected(Reason.BAD_STATE, f"tensor names must be 1 to {MAX_NAME_BYTES} bytes, got {name[:40]!r}")
        if not t.is_floating_point():
            raise Rejected(Reason.BAD_STATE, f"tensor {name!r} is {t.dtype}; only floating-point tensors train")
        t = t.to(torch.float32).contiguous()
        if not bool(torch.isfinite(t).all()):
            raise Rejected(Reason.BAD_STATE, f"tensor {name!r} holds NaN or infinite values")
        out[name] = t
    return out
