"""Each run's driver task, and closing a round: aggregate, step, publish; then checkpoints and pruning.

A run's driver task closes the open round as soon as ``quorum`` distinct nodes submitted, or at
``round_deadline_s`` after the round opened with at least ``min_updates`` (a straggler never holds a round
past its deadline; with fewer the round stays open until ``min_updates`` arrive).

Closing a round (:mod:`.transition`, in place on the run's :class:`~.transition.RunState`): aggregate →
AdamW → ``diff = target − master`` compressed inside the run's one downlink
:class:`~gradwire.ErrorFeedback` → ``master += reconstruction`` (what every node decodes from the frame,
so everyone applying the same frames holds bit-identical weights) → durable publish: the frame, then the
SQLite commit that makes version ``v + 1`` exist. DeMo and SparseLoCo runs apply the exact mean of the
nodes' frames and publish those frames. If anything fails before the commit, the state (stepped in place)
is reloaded from the store (:meth:`.recovery.Recovery.reload`), which gives back exactly the committed
version.

Checkpoints: the full state goes to disk every ``checkpoint_every`` versions (in the driver, after the
version is published, so no round waits for it) and, for states up to
``checkpoint_every_version_below_bytes``, with every version. Closing a round holds the run's lock, as
recording an update does; heavy work runs in worker threads, the event loop only schedules.

A failed close is retried with exponential backoff (``close_retry_initial_s`` doubling up to
``close_retry_max_s``), with one log line when closes start failing or fail another way (a traceback only
for an error that is not the storage's) and one when a close succeeds again. A full or failing disk is
retried for as long as it lasts (space may come back); any other cause that repeats
``close_failures_before_failed`` times in a row marks the run ``failed``, with the cause, until the admin
resumes or deletes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .aggregate import Update
from .errors import StorageFailed
from .metrics import Metrics
from .object_store import ObjectStoreUnavailable
from .publishing import StorePublisher
from .runtime import RunRuntime
from .scores import score_weights, scores_complete
from .settings import ServerSettings
from .store import Store
from .transition import Timings

__all__ = ["Closed", "RoundDriver"]

# The round engine's one logger, whichever of its modules logs.
log = logging.getLogger("gradwire_server.rounds")

#: Rounds between two deletions of old update and version rows (Store.prune_rows).
ROW_PRUNE_EVERY = 64


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

    def parts(self) -> dict[str, float]:
        """Seconds of each part of the close (``gradwire_close_part_seconds``): the step's
        :class:`~.transition.Timings`, then the durable publish."""
        t = self.timings
        return {
            "aggregate": t.aggregate,
            "adamw": t.adamw,
            "encode": t.encode,
            "apply": t.apply,
            "hash": t.hash,
            "publish": self.publish_s,
        }


class RoundDriver:
    """Every run's driver task, and the round closes, checkpoints and pruning it runs."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        settings: ServerSettings,
        reload: Callable[[RunRuntime], None],
        publisher: StorePublisher | None = None,
    ):
        self.store = store
        #: Writes versions and checkpoints to the object store (None: the server has none).
        self.publisher = publisher
        self.metrics = metrics
        self.settings = settings
        #: Puts a run back in step with the store after a failed round close.
        self._reload = reload
        self._drivers: dict[str, asyncio.Task] = {}
        self._stopping = False

    def start(self, rt: RunRuntime) -> None:
        """Start ``rt``'s driver task."""
        self._drivers[rt.run_id] = asyncio.create_task(self._drive(rt), name=f"round-driver-{rt.run_id}")

    async def stop(self, runs: Iterable[RunRuntime]) -> None:
        """Stop the drivers after any round close in flight has finished (its commit is never cut)."""
        self._stopping = True
        for rt in runs:
            rt.wake.set()
        tasks = list(self._drivers.values())
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        for task in tasks:
            task.cancel()

    async def stop_run(self, rt: RunRuntime) -> None:
        """Stop ``rt``'s driver (marked ``deleted`` by the caller) after any round close in flight."""
        task = self._drivers.pop(rt.run_id, None)
        rt.wake.set()
        rt.tell_validators()  # their long polls answer 404 at once
        if task is not None:
            await asyncio.wait([task], timeout=60)
            task.cancel()

    def _ready(self, rt: RunRuntime, now: float) -> bool:
        if rt.state is None or not rt.pending or rt.status != "active" or rt.deleted:
            return False
        if rt.retry_at is not None and now < rt.retry_at:
            return False
        deadline = rt.deadline()
        ready = rt.distinct_nodes() >= rt.config.quorum or (
            deadline is not None and now >= deadline and len(rt.pending) >= rt.config.min_updates
        )
        if not ready or rt.config.validation is None:
            return ready
        # A run with validators: the ready round waits for their scores, until every validator scored every
        # candidate it held when it became ready, or its score deadline passed (then it closes with what it
        # got, or the structural rule). A candidate arriving later does not hold it: it weighs 0 unless a
        # validator scored it too before the close.
        if rt.scoring_since is None:
            rt.scoring_since = now
            rt.scoring_senders = frozenset(node for node, _ in rt.pending)
        validators = [v.validator_id for v in self.store.validators_of(rt.run_id)]
        return (
            not validators
            or scores_complete(rt.round_scores, validators, rt.scoring_senders)
            or now >= rt.score_deadline()
        )

    async def _drive(self, rt: RunRuntime) -> None:
        while not self._stopping and not rt.deleted:
            rt.wake.clear()
            now = time.time()
            ready = self._ready(rt, now)
            # Whatever woke the driver (an update committed, scores posted, a round closed, a deadline) may be
            # news to a validator's candidates long poll: it looks again at once.
            rt.tell_validators()
            if ready:
                try:
                    await self.close_round(rt)
                except Exception as exc:
                    await self._close_failed(rt, exc)
                else:
                    if rt.close_failures:
                        log.warning(
                            "run %s: round %d closed after %d failed attempt(s)",
                            rt.run_id,
                            rt.version - 1,
                            rt.close_failures,
                        )
                    rt.reset_retries()
                continue
            waits = [t - now for t in (rt.deadline(), rt.retry_at, rt.score_deadline()) if t is not None and t > now]
            try:
                await asyncio.wait_for(rt.wake.wait(), timeout=min(waits) if waits else None)
            except asyncio.TimeoutError:
                pass

    async def _close_failed(self, rt: RunRuntime, exc: Exception) -> None:
        """Count a failed close, log it if it is news, and schedule the retry or mark the run failed."""
        # A full or failing disk, or an object store that cannot be reached: retried for as long as it lasts.
        storage = isinstance(exc, (StorageFailed, ObjectStoreUnavailable))
        cause = exc.cause if storage else f"{type(exc).__name__}: {exc}"
        self.metrics.close_failures.labels(cause="storage" if storage else "error").inc()
        same = cause == rt.close_cause
        rt.close_failures += 1
        rt.close_same = rt.close_same + 1 if same else 1
        rt.close_cause = cause
        s = self.settings
        delay = min(s.close_retry_max_s, s.close_retry_initial_s * 2.0 ** min(rt.close_failures - 1, 60))
        rt.retry_at = time.time() + delay
        limit = s.close_failures_before_failed
        if not storage and limit and rt.close_same >= limit:
            rt.status = "failed"
            rt.status_detail = f"closing round {rt.version} failed {rt.close_same} times in a row: {cause}"
            log.error(
                "run %s marked failed: %s. Updates are refused (409 run_failed) until the admin resumes it "
                "(POST /v1/runs/%s/resume) or deletes it",
                rt.run_id,
                rt.status_detail,
                rt.run_id,
            )
            try:
                await asyncio.to_thread(self.store.set_run_status, rt.run_id, rt.status, rt.status_detail)
            except Exception as persist:  # the store logs a storage failure itself
                log.warning("run %s: its failed status is kept in memory only (%s)", rt.run_id, persist)
            return
        if same:
            log.debug(
                "run %s: closing round %d failed again (%d in a row): %s",
                rt.run_id,
                rt.version,
                rt.close_failures,
                cause,
            )
            return
        retry = f"retrying in {delay:g} s, then with backoff up to {s.close_retry_max_s:g} s" + (
            "" if storage else f"; the run is marked failed after {limit} such failures in a row" if limit else ""
        )
        # A traceback for a failure that is news and not the storage's (whose cause says it all).
        log.error(
            "run %s: closing round %d failed: %s; %s",
            rt.run_id,
            rt.version,
            cause,
            retry,
            exc_info=None if storage else exc,
        )

    async def close_round(self, rt: RunRuntime) -> Closed | None:
        """Aggregate the open round, step, publish the next version (``None`` if nothing is pending); then
        write a checkpoint if one is due."""
        async with rt.lock:
            if not rt.pending or rt.state is None:
                return None
            # In commit order: the order the round's running sum added them, and its replay reads them back.
            updates = list(rt.pending.values())
            t0 = time.perf_counter()
            try:
                closed = await asyncio.to_thread(self.close_and_publish, rt, updates)
            except BaseException:
                # The state was stepped in place up to wherever it failed: back to the committed version.
                before = rt.version
                await asyncio.to_thread(self._reload, rt)
                if rt.version != before:  # the commit went through after all: the next round scores afresh
                    rt.reset_scoring()
                raise
            opened_before = rt.opened_at
            rt.version, rt.weights_hash, rt.opened_at = closed.version, closed.weights_hash, closed.opened_at
            if closed.checkpoint:
                rt.checkpoint = closed.version
            rt.pending, rt.round_sum = {}, None
            rt.reset_scoring()
            rt.recent.forget_before(rt.version)
            self._observe(rt, closed, time.perf_counter() - t0, opened_before)
            # Readers waiting for the version are woken now (its metrics recorded first); pruning old rows,
            # files and store objects is housekeeping that no reader waits for (with an object store, its
            # deletes are round trips).
            event, rt.published = rt.published, asyncio.Event()
            event.set()
            await asyncio.to_thread(self._prune, rt)
        log.info(
            "run %s: published version %d from %d update(s), %d-byte frame, hash %s; closed in %.3f s (%s)",
            rt.run_id,
            rt.version,
            len(updates),
            len(closed.frame),
            rt.weights_hash,
            time.perf_counter() - t0,
            ", ".join(f"{part} {seconds:.3f}" for part, seconds in closed.parts().items()),
        )
        if rt.version - rt.checkpoint >= self.settings.checkpoint_every:
            await self.checkpoint(rt)
        if self.publisher is not None and rt.version - (rt.store_checkpoint or 0) >= self.settings.checkpoint_every:
            await self.store_checkpoint(rt)
        return closed

    def _observe(self, rt: RunRuntime, closed: Closed, seconds: float, opened_before: float | None) -> None:
        """A closed round's metrics: the close until its version is readable, its parts, the round's length."""
        m = self.metrics
        m.publish_seconds.observe(seconds)
        m.aggregate_seconds.observe(closed.timings.aggregate)
        for part, part_seconds in closed.parts().items():
            m.close_part_seconds.labels(part=part).observe(part_seconds)
        if opened_before is not None:
            m.round_duration.observe(max(0.0, closed.opened_at - opened_before))
        m.set_version(rt.run_id, rt.version)

    def close_and_publish(self, rt: RunRuntime, updates: list[Update]) -> Closed:
        """Step ``rt.state`` in place through round ``rt.version`` and durably publish the next version
        (with a checkpoint if the state is small). ``rt`` itself is left for the caller to update."""
        state = rt.state
        assert state is not None
        state.timings = Timings()
        weights = score_weights(rt.round_scores, [u.node_id for u in updates])
        frame = state.close(updates, score_weights=weights, round_sum=rt.round_sum)
        h = state.weights_hash()
        opened = time.time()
        t0 = time.perf_counter()
        inline = state.state_bytes() <= self.settings.checkpoint_every_version_below_bytes
        if inline:
            self.store.write_checkpoint(rt.run_id, state.version, *state.checkpoint())
        # With an object store the version's bytes go there first, under a key of their own hash; the row
        # naming that key is part of the version's one commit below.
        objects = () if self.publisher is None else (self.publisher.put_version(rt.run_id, state.version, frame),)
        self.store.publish(
            rt.run_id, state.version, frame, h, len(updates), opened, inline, objects, score_weights=weights
        )
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

    async def store_checkpoint(self, rt: RunRuntime) -> None:
        """Write the weights (and the algorithm's node state) of the current version to the object store and
        record them: where nodes that join or come back start from. After the version was published and
        outside the lock, like :meth:`checkpoint`. A store that cannot be reached is logged and tried
        again after the next round: nodes then start from the store's previous checkpoint."""
        state, publisher = rt.state, self.publisher
        if state is None or publisher is None:
            return
        version = rt.version
        try:
            await asyncio.to_thread(publisher.put_checkpoint, rt.run_id, version, state, rt.config)
        except ObjectStoreUnavailable as exc:
            log.warning(
                "run %s: the checkpoint of version %d is not in the object store yet: %s", rt.run_id, version, exc
            )
            return
        rt.store_checkpoint = version
        async with rt.lock:
            await asyncio.to_thread(self._prune, rt)

    def _prune(self, rt: RunRuntime) -> None:
        self.store.prune_versions(rt.run_id, rt.version, rt.config.keep_versions, rt.checkpoint)
        keep_from = rt.keep_submissions_from()
        if keep_from > rt.dropped_to:
            self.store.drop_submissions(rt.run_id, rt.dropped_to, keep_from)
            rt.dropped_to = keep_from
        # The rows go in batches (one small transaction every ROW_PRUNE_EVERY rounds, not one per round):
        # those of updates and versions older than both the retained diffs and what a replay needs. A
        # duplicate resubmission older than that is answered 410 round_closed, as a node that far behind
        # reloads the full state anyway.
        oldest = self.store.oldest_diff(rt.run_id, rt.version, rt.config.keep_versions)
        if self.publisher is not None and rt.store_checkpoint is not None:
            # The object store keeps its last checkpoint and every version since, and the last keep_versions.
            self.publisher.prune(rt.run_id, min(oldest, rt.store_checkpoint))
            oldest = min(oldest, rt.store_checkpoint + 1)
        rows_before = min(oldest, keep_from)
        if rows_before - rt.rows_pruned_to >= ROW_PRUNE_EVERY:
            try:
                self.store.prune_rows(rt.run_id, rows_before, oldest - 1)
                rt.rows_pruned_to = rows_before
            except StorageFailed as exc:  # housekeeping never fails a close; it is tried again next round
                log.warning("run %s: pruning old rows failed: %s", rt.run_id, exc)
