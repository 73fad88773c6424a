"""The round state machine of every run: accepting updates, closing rounds, publishing versions.

Round ``v`` is open while a run holds version ``v``. Acknowledged updates collect in memory (and on
disk, see :mod:`.store`); a run's driver task closes the round as soon as ``quorum`` distinct nodes
submitted, or at ``round_deadline_s`` after the round opened with at least ``min_updates`` (a straggler
never holds a round past its deadline; with fewer the round stays open until ``min_updates`` arrive).

Closing a round (:mod:`.transition`, in place on the run's :class:`~.transition.RunState`): aggregate →
AdamW → ``diff = target − master`` compressed inside the run's one downlink
:class:`~gradwire.ErrorFeedback` → ``master += reconstruction`` (what every node decodes from the frame,
so everyone applying the same frames holds bit-identical weights) → durable publish: the frame, then the
SQLite commit that makes version ``v + 1`` exist. DeMo and SparseLoCo runs apply the exact mean of the
nodes' frames and publish those frames. If anything fails before the commit, the state (stepped in place)
is reloaded from the store, which gives back exactly the committed version.

Checkpoints: the full state goes to disk every ``checkpoint_every`` versions (in the driver, after the
version is published, so no round waits for it) and, for states up to
``checkpoint_every_version_below_bytes``, with every version. Recovery loads the last checkpoint and replays
the versions since (:meth:`RoundEngine._load_state`) with the same code that closed them.

Concurrency: each run has one ``asyncio.Lock``; recording an update and closing a round both hold it,
so an update is either counted in the round being closed or refused as late — never acknowledged and
then lost. Heavy work runs in worker threads; the event loop only schedules. Each update is hashed,
validated and written (fsynced) in one worker thread of its own; updates then commit in groups
(:meth:`RoundEngine._commit_groups`): the ones that arrive while a commit is in flight share the next
one, so a burst of submissions costs one directory fsync and one SQLite commit per group, not per update.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from gradwire import read_frame
from gradwire.frame import MAX_NAME_BYTES, Frame
from gradwire.model_record import run_spec
from gradwire.state import pack_state_dict, state_from_bytes, state_hash, state_to_bytes

from .aggregate import Update
from .config import RunConfig
from .errors import Reason, Rejected
from .metrics import Metrics
from .settings import ServerSettings
from .store import RunRecord, Store, SubmissionRecord
from .transition import RunState, Timings
from .validate import validate_update

__all__ = ["RoundEngine", "RunRuntime"]

log = logging.getLogger("gradwire_server.rounds")


@dataclass
class RunRuntime:
    """A run's live state. ``state`` is stepped in place by the driver alone (under ``lock``)."""

    run_id: str
    config: RunConfig
    version: int = 0
    weights_hash: Optional[str] = None
    opened_at: Optional[float] = None
    state: Optional[RunState] = None
    #: The last checkpoint recorded in the store, and the target round below which submission frames
    #: were deleted.
    checkpoint: int = 0
    dropped_to: int = 0
    pending: dict[tuple[int, int], Update] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    published: asyncio.Event = field(default_factory=asyncio.Event)
    #: Updates validated and written, waiting for the next group commit, and the task committing them.
    staged: list["_Staged"] = field(default_factory=list)
    committer: Optional[asyncio.Task] = None

    @property
    def master(self) -> Optional[dict[str, torch.Tensor]]:
        return None if self.state is None else self.state.master

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

    def keep_submissions_from(self) -> int:
        """AdamW replays rounds from the checkpoint on from their submissions; the others need only the
        open round's."""
        return self.checkpoint if self.config.algorithm == "adamw" else self.version


@dataclass
class _Staged:
    """An update validated and written to disk, waiting for its group commit (and ``answer``)."""

    node_id: int
    round: int
    sha: str
    body: bytes
    frame: Frame
    norm: float
    weight: float = 1.0
    answer: Optional[asyncio.Future] = None


@dataclass
class Closed:
    """What closing a round published, and what it cost."""

    version: int
    frame: bytes
    weights_hash: str
    opened_at: float
    checkpoint: bool
    timings: Timings
    publish_s: float


class RoundEngine:
    """Every run's runtime, the per-run driver tasks, and the operations the routes call."""

    def __init__(self, store: Store, metrics: Metrics, settings: ServerSettings):
        self.store = store
        self.metrics = metrics
        self.settings = settings
        self.device = settings.torch_device()
        self.runs: dict[str, RunRuntime] = {}
        self._drivers: dict[str, asyncio.Task] = {}
        self._stopping = False
        # Submissions are validated in a pool of their own, one thread per core by default: validation
        # is mostly Python and NumPy holding the GIL, and more threads than cores only make the event
        # loop wait longer for the GIL.
        self._validators = ThreadPoolExecutor(max_workers=settings.validate_threads or os.cpu_count() or 1,
                                              thread_name_prefix="gradwire-validate")

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
        self._validators.shutdown(wait=False, cancel_futures=True)

    def _recover(self, run_id: str) -> RunRuntime:
        rec = self.store.get_run(run_id)
        assert rec is not None
        rt = RunRuntime(run_id=run_id, config=RunConfig.model_validate(rec.config), version=rec.version,
                        weights_hash=rec.weights_hash, opened_at=rec.round_opened_at)
        if not rec.has_state:
            return rt
        rt.state = self._load_state(rec, rt.config)
        rt.checkpoint = rt.dropped_to = rec.checkpoint_version
        self.store.prune(run_id, rec.version, rt.config.keep_versions, rt.checkpoint, rt.keep_submissions_from())
        rt.dropped_to = rt.keep_submissions_from()
        rt.pending = {(u.node_id, sub.round): u for sub, u in self._logged_updates(run_id, rec.version)}
        self.metrics.version.labels(run=run_id).set(rt.version)
        return rt

    def _logged_updates(self, run_id: str, target_round: int) -> list[tuple[SubmissionRecord, Update]]:
        """The acknowledged updates counted in ``target_round``, from their rows and frames, in the order
        a round aggregates them."""
        out = []
        for sub in self.store.submissions_for(run_id, target_round):
            raw = self.store.read_submission(sub)
            out.append((sub, Update(read_frame(raw), sub.weight, sub.norm, sub.node_id, raw, sub.sha256)))
        return out

    def _load_state(self, rec: RunRecord, config: RunConfig) -> RunState:
        """The committed state of a run: its last checkpoint, with the versions since replayed."""
        run_id, c = rec.run_id, rec.checkpoint_version
        weights = self.store.load_tensors(run_id, "weights", c)
        if weights is None:
            raise RuntimeError(f"run {run_id}: the weights of checkpoint {c} are missing")
        if state_hash(weights) != rec.checkpoint_hash:
            raise RuntimeError(f"run {run_id}: the weights file of checkpoint {c} does not match its hash")
        moments = self.store.load_tensors(run_id, "moments", c)
        if config.algorithm == "adamw" and moments is None and c > 0:
            raise RuntimeError(f"run {run_id}: the moments of checkpoint {c} are missing")
        state = RunState.load(config, c, weights, moments, self.store.load_server_state(run_id, c), self.device)
        if rec.version == c:
            return state
        t0 = time.perf_counter()
        diverged = []
        for v in range(c, rec.version):
            published = self.store.diff_path(run_id, v + 1).read_bytes()
            if config.algorithm == "adamw":
                if not state.replay_adamw([u for _, u in self._logged_updates(run_id, v)], published):
                    diverged.append(v + 1)
            else:
                state.replay_average(published)
        if state.weights_hash() != rec.weights_hash:
            raise RuntimeError(f"run {run_id}: replaying versions {c + 1}..{rec.version} from checkpoint {c} "
                               "does not give the committed weights hash")
        if diverged:
            log.warning("run %s: replaying versions %s made frames other than the published ones (another thread "
                        "count or BLAS?): the weights are exact (the published frames applied), AdamW's moments "
                        "and the downlink residuals may differ in their last bits from the original run",
                        run_id, diverged)
        log.info("run %s: replayed versions %d..%d from checkpoint %d in %.2f s", run_id, c + 1, rec.version, c,
                 time.perf_counter() - t0)
        return state

    def _reload(self, rt: RunRuntime) -> None:
        """Put ``rt`` back in step with the store after a failed round close (its state may be half-stepped)."""
        rt.state = None
        rec = self.store.get_run(rt.run_id)
        assert rec is not None
        rt.state = self._load_state(rec, rt.config)
        if rec.version != rt.version:  # the commit went through after all
            rt.pending = {}
        rt.version, rt.weights_hash, rt.opened_at = rec.version, rec.weights_hash, rec.round_opened_at
        rt.checkpoint = rec.checkpoint_version

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
            rt.state = RunState.load(rt.config, 0, master, None, {}, self.device)
            rt.weights_hash, rt.opened_at, rt.checkpoint, rt.dropped_to = h, opened, 0, 0
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
        """The master weights at the current version, from memory (only checkpoints are on disk). Under the
        run's lock: a round close steps them in place."""
        rt = self.runtime(run_id)
        self._require_state(rt)
        async with rt.lock:
            master = self._require_state(rt)
            version, h = rt.version, rt.weights_hash
            data = await asyncio.to_thread(state_to_bytes, master)
        return data, version, h

    async def algorithm_state_bytes(self, run_id: str) -> tuple[bytes, int, str]:
        """What a node needs beside the weights to apply the next versions as the server does (SparseLoCo's
        outer momentum; nothing for the other algorithms), packed, at the current version."""
        rt = self.runtime(run_id)
        self._require_state(rt)
        async with rt.lock:
            self._require_state(rt)
            version, h = rt.version, rt.weights_hash
            kept = rt.state.algorithm_state
            public = {"outer": kept["outer"]} if "outer" in kept else {}
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
        """The 202 answer if these bytes were already recorded; 409 if other bytes were.

        The open round's updates are all in ``rt.pending`` (an update for round ``r`` counts in round
        ``r`` or, if stale, a later one), so only an earlier round's needs the store.
        """
        update = rt.pending.get((node_id, round))
        if update is not None:
            recorded = update.sha256
        elif round < rt.version:
            rec = self.store.get_submission(rt.run_id, node_id, round)
            if rec is None:
                return None
            recorded = rec.sha256
        else:
            return None
        if recorded != sha:
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
        # Read on the event loop: a failed round close reloads the state in a worker thread.
        spec = rt.spec
        record = run_spec(rt.master).record_name if rt.config.model_record else None
        staged = await asyncio.get_running_loop().run_in_executor(
            self._validators, functools.partial(self._stage, rt, spec, record, node_id, round, body))
        if isinstance(staged, dict):
            return staged
        # Shielded: once recording has begun, a client that hangs up must not leave a durable record
        # that the open round does not count.
        answer = await asyncio.shield(self._commit_with_group(rt, staged))
        if not answer["duplicate"]:
            self.metrics.updates_accepted.inc()
            self.metrics.compression_ratio.set(rt.dense_bytes / max(1, len(body)))
        return answer

    def _stage(self, rt: RunRuntime, spec, record: Optional[str], node_id: int, round: int,
               body: bytes) -> "_Staged | dict":
        """In a worker thread, everything one update needs before its commit: the content hash, the early
        refusals (a duplicate is answered here, before any parsing), full validation, and the frame's
        file written and fsynced. What it reads of ``rt`` is checked again under the lock at the commit."""
        sha = hashlib.sha256(body).hexdigest()
        dup = self._existing(rt, node_id, round, sha)
        if dup is not None:
            return dup
        self._weight_for(rt, round)  # refuse late or early updates before parsing them
        t0 = time.perf_counter()
        frame, norm = validate_update(body, spec, node_id=node_id, round=round,
                                      max_frame_bytes=rt.config.max_frame_bytes,
                                      max_update_norm=rt.config.max_update_norm, model_record=record)
        self.metrics.decode_seconds.observe(time.perf_counter() - t0)
        # The name carries the content hash, so concurrent submissions never share a file.
        self.store.write_submission(rt.run_id, round, node_id, sha, body)
        return _Staged(node_id, round, sha, body, frame, norm)

    async def _commit_with_group(self, rt: RunRuntime, staged: "_Staged") -> dict:
        """Queue ``staged`` for the run's next group commit and wait for its answer. Updates that arrive
        while a commit is in flight wait for it and then share the next one: one directory fsync and one
        SQLite transaction for the group, each 202 still only after the commit that holds its row."""
        staged.answer = asyncio.get_running_loop().create_future()
        rt.staged.append(staged)
        if rt.committer is None or rt.committer.done():
            rt.committer = asyncio.create_task(self._commit_groups(rt), name=f"group-commit-{rt.run_id}")
        return await staged.answer

    async def _commit_groups(self, rt: RunRuntime) -> None:
        while rt.staged:
            async with rt.lock:
                # Taken under the lock: whatever arrived while a round close or the last commit held it
                # joins this group.
                group, rt.staged = rt.staged, []
                await self._commit_group(rt, group)
            rt.wake.set()

    async def _commit_group(self, rt: RunRuntime, group: list["_Staged"]) -> None:
        """Under the run's lock: the checks again (the round may have closed, a concurrent request may have
        recorded the same node and round), then one commit for every update still accepted."""
        accepted: dict[tuple[int, int], _Staged] = {}
        duplicates: list[_Staged] = []
        now = time.time()
        for s in group:
            try:
                first = accepted.get((s.node_id, s.round))
                if first is not None:
                    if first.sha != s.sha:
                        raise Rejected(Reason.CONFLICTING_SUBMISSION,
                                       f"node {s.node_id} already submitted a different update for round {s.round}")
                    duplicates.append(s)
                    continue
                dup = self._existing(rt, s.node_id, s.round, s.sha)
                if dup is not None:
                    s.answer.set_result(dup)
                    continue
                s.weight = self._weight_for(rt, s.round)
            except Rejected as exc:
                s.answer.set_exception(exc)
                continue
            accepted[(s.node_id, s.round)] = s
        recs = [SubmissionRecord(rt.run_id, s.node_id, s.round, rt.version, s.sha, len(s.body), s.weight, s.norm, now)
                for s in accepted.values()]
        if recs:
            self.metrics.commit_group_size.observe(len(recs))
            try:
                await asyncio.to_thread(self.store.commit_submissions, recs)
            except BaseException as exc:
                # None of the group is recorded (one transaction): each request gets the error (a 500; the
                # client may retry), and the next group is committed as usual.
                log.exception("run %s: committing %d update(s) failed", rt.run_id, len(recs))
                for s in [*accepted.values(), *duplicates]:
                    s.answer.set_exception(exc if isinstance(exc, Exception) else RuntimeError("commit interrupted"))
                if not isinstance(exc, Exception):
                    raise
                return
        for s in accepted.values():
            rt.pending[(s.node_id, s.round)] = Update(s.frame, s.weight, s.norm, s.node_id, s.body, s.sha)
        submitted = len(rt.pending)
        for s in accepted.values():
            s.answer.set_result({"round": s.round, "node_id": s.node_id, "duplicate": False, "submitted": submitted})
        for s in duplicates:
            s.answer.set_result({"round": s.round, "node_id": s.node_id, "duplicate": True, "submitted": submitted})

    # -- closing rounds ---------------------------------------------------------------------------

    def _ready(self, rt: RunRuntime, now: float) -> bool:
        if rt.state is None or not rt.pending:
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

    async def close_round(self, rt: RunRuntime) -> Optional[Closed]:
        """Aggregate the open round, step, publish the next version (``None`` if nothing is pending); then
        write a checkpoint if one is due."""
        async with rt.lock:
            if not rt.pending or rt.state is None:
                return None
            # A fixed order (node id, then round) makes the aggregate independent of arrival order.
            updates = [rt.pending[k] for k in sorted(rt.pending)]
            t0 = time.perf_counter()
            try:
                closed = await asyncio.to_thread(self.close_and_publish, rt, updates)
            except BaseException:
                # The state was stepped in place up to wherever it failed: back to the committed version.
                await asyncio.to_thread(self._reload, rt)
                raise
            opened_before = rt.opened_at
            rt.version, rt.weights_hash, rt.opened_at = closed.version, closed.weights_hash, closed.opened_at
            if closed.checkpoint:
                rt.checkpoint = closed.version
            rt.pending = {}
            await asyncio.to_thread(self._prune, rt)
            event, rt.published = rt.published, asyncio.Event()
        event.set()
        m = self.metrics
        m.publish_seconds.observe(time.perf_counter() - t0)
        m.aggregate_seconds.observe(closed.timings.aggregate)
        if opened_before is not None:
            m.round_duration.observe(max(0.0, closed.opened_at - opened_before))
        m.version.labels(run=rt.run_id).set(rt.version)
        log.info("run %s: published version %d from %d update(s), %d-byte frame, hash %s",
                 rt.run_id, rt.version, len(updates), len(closed.frame), rt.weights_hash)
        if rt.version - rt.checkpoint >= self.settings.checkpoint_every:
            await self.checkpoint(rt)
        return closed

    def close_and_publish(self, rt: RunRuntime, updates: list[Update]) -> Closed:
        """Step ``rt.state`` in place through round ``rt.version`` and durably publish the next version
        (with a checkpoint if the state is small). ``rt`` itself is left for the caller to update."""
        state = rt.state
        assert state is not None
        state.timings = Timings()
        frame = state.close_adamw(updates) if rt.config.algorithm == "adamw" else state.close_average(updates)
        h = state.weights_hash()
        opened = time.time()
        t0 = time.perf_counter()
        inline = state.state_bytes() <= self.settings.checkpoint_every_version_below_bytes
        if inline:
            self.store.write_checkpoint(rt.run_id, state.version, *state.checkpoint())
        self.store.publish(rt.run_id, state.version, frame, h, len(updates), opened, checkpoint=inline)
        return Closed(state.version, frame, h, opened, inline, state.timings, time.perf_counter() - t0)

    async def checkpoint(self, rt: RunRuntime) -> None:
        """Write the full state of the current version and record it. Runs in the driver, after the version
        was published and outside the lock (submissions go on meanwhile); nothing else steps the state
        until it returns."""
        state = rt.state
        if state is None or rt.checkpoint == rt.version:
            return
        version, h = rt.version, rt.weights_hash
        assert state.version == version and h is not None
        t0 = time.perf_counter()
        await asyncio.to_thread(self.store.write_checkpoint, rt.run_id, version, *state.checkpoint())
        async with rt.lock:
            await asyncio.to_thread(self.store.record_checkpoint, rt.run_id, version, h)
            rt.checkpoint = version
            await asyncio.to_thread(self._prune, rt)
        log.info("run %s: checkpoint of version %d written in %.2f s", rt.run_id, version, time.perf_counter() - t0)

    def _prune(self, rt: RunRuntime) -> None:
        self.store.prune_versions(rt.run_id, rt.version, rt.config.keep_versions, rt.checkpoint)
        keep_from = rt.keep_submissions_from()
        if keep_from > rt.dropped_to:
            self.store.drop_submissions(rt.run_id, rt.dropped_to, keep_from)
            rt.dropped_to = keep_from


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
