"""The round state machine of every run: accepting updates, closing rounds, publishing versions.

Round ``v`` is open while a run holds version ``v``. Acknowledged updates collect in memory (and on
disk, see :mod:`.store`); a run's driver task closes the round as soon as ``quorum`` distinct nodes
submitted, or at ``round_deadline_s`` after the round opened with at least ``min_updates`` (a straggler
never holds a round past its deadline; with fewer the round stays open until ``min_updates`` arrive).

:class:`RoundEngine` is what the routes call: it holds every run's :class:`~.runtime.RunRuntime`, answers
the reads (status, the state, the downlink), and composes one collaborator per concern, sharing the store
and the metrics:

- :class:`~.recovery.Recovery` (:mod:`.recovery`): a run's committed state from the store (the last
  checkpoint with the versions since replayed, the open round's logged updates), at startup and after a
  failed round close;
- :class:`~.submissions.Submissions` (:mod:`.submissions`): recording updates (staged in the validation
  pool, the duplicate and round checks, group commit);
- :class:`~.driver.RoundDriver` (:mod:`.driver`): each run's driver task, closing rounds (aggregate, step,
  durable publish), checkpoints and pruning.

Concurrency: each run has one ``asyncio.Lock``; recording an update and closing a round both hold it,
so an update is either counted in the round being closed or refused as late — never acknowledged and
then lost. Heavy work runs in worker threads; the event loop only schedules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gradwire.frame import MAX_NAME_BYTES
from gradwire.state import pack_state_dict, state_from_bytes, state_from_file, state_hash, state_to_bytes

from .aggregate import Update
from .config import RunConfig
from .downlink import CatchUpSlots, Page, open_page
from .driver import Closed, RoundDriver
from .errors import Reason, Rejected
from .memory import reserve
from .metrics import Metrics
from .object_store import ObjectStore
from .publishing import StorePublisher
from .recovery import Recovery
from .runtime import RunRuntime
from .settings import ServerSettings
from .store import RunRecord, Store
from .submissions import Submissions
from .transition import RunState

__all__ = ["RoundEngine", "RunRuntime"]

log = logging.getLogger("gradwire_server.rounds")


class RoundEngine:
    """Every run's runtime, the per-run driver tasks, and the operations the routes call."""

    def __init__(self, store: Store, metrics: Metrics, settings: ServerSettings, objects: ObjectStore | None = None):
        self.store = store
        self.metrics = metrics
        self.settings = settings
        self.device = settings.torch_device()
        self.runs: dict[str, RunRuntime] = {}
        #: The object-store data plane (None: frames and versions through this server's port).
        self.objects = objects
        self.publisher = None if objects is None else StorePublisher(objects, store)
        self._recovery = Recovery(store, metrics, self.device)
        self._submissions = Submissions(store, metrics, settings)
        self._driver = RoundDriver(store, metrics, settings, self._recovery.reload, self.publisher)
        self._catch_ups = CatchUpSlots(settings.max_catch_ups)
        #: Set when the server shuts down: long polls stop waiting.
        self.stopping = asyncio.Event()

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Recover every run from the store and start its driver."""
        for orphan in await asyncio.to_thread(self.store.remove_orphans):
            log.warning("removed the files of run %s, deleted before the server stopped", orphan)
        for rec in await asyncio.to_thread(self.store.list_runs):
            rt = await self._recover(rec)
            self.runs[rt.run_id] = rt
            if self.publisher is not None and rt.state is not None and rt.store_checkpoint is None:
                # A run from before this server had its object store: nodes start from a checkpoint there.
                await self._driver.store_checkpoint(rt)
            self._driver.start(rt)
            log.info(
                "recovered run %s at version %d with %d acknowledged update(s) in round %d",
                rt.run_id,
                rt.version,
                len(rt.pending),
                rt.version,
            )
            if rt.status != "active":
                log.warning("run %s is %s%s", rt.run_id, rt.status, f": {rt.status_detail}" if rt.status_detail else "")

    async def _recover(self, rec: RunRecord) -> RunRuntime:
        """``rec``'s runtime from the store; a run that cannot be recovered (a checkpoint that does not match
        its hash, a replay that fails) is marked failed, in memory, with the cause, and the others start:
        one broken run does not keep the server down. Resuming it tries again."""
        try:
            return await asyncio.to_thread(self._recovery.recover, rec.run_id)
        except Exception as exc:
            detail = f"recovering it failed: {type(exc).__name__}: {exc}"
            log.error(
                "run %s: %s; it is marked failed (resume it once the cause is fixed, or delete it)",
                rec.run_id,
                detail,
                exc_info=exc,
            )
            try:
                config = RunConfig.model_validate(rec.config)
            except ValueError:
                config = RunConfig()  # a config this server cannot read: the status still answers
            return RunRuntime(
                run_id=rec.run_id,
                config=config,
                version=rec.version,
                weights_hash=rec.weights_hash,
                opened_at=rec.round_opened_at,
                status="failed",
                status_detail=detail,
            )

    async def stop(self) -> None:
        """Stop the drivers after any round close in flight has finished (its commit is never cut)."""
        await self._driver.stop(self.runs.values())
        # Let submissions being recorded finish before the store closes.
        for rt in self.runs.values():
            try:
                await asyncio.wait_for(rt.lock.acquire(), timeout=30)
            except asyncio.TimeoutError:
                log.warning("run %s still busy at shutdown", rt.run_id)
        self._submissions.close()

    # -- runs and state ---------------------------------------------------------------------------

    def runtime(self, run_id: str) -> RunRuntime:
        try:
            return self.runs[run_id]
        except KeyError:
            raise Rejected(Reason.UNKNOWN_RUN, f"no run {run_id!r}") from None

    async def create_run(self, config: RunConfig) -> str:
        run_id = await asyncio.to_thread(self.store.create_run, config.model_dump(mode="json"), self.settings.max_runs)
        rt = RunRuntime(run_id=run_id, config=config)
        self.runs[run_id] = rt
        self._driver.start(rt)
        log.info("created run %s", run_id)
        for warning in config.warnings():
            log.warning("run %s: %s", run_id, warning)
        return run_id

    async def require_not_started(self, run_id: str) -> None:
        """409 ``already_started`` once the run accepted an update: its initial state is fixed."""
        rt = self.runtime(run_id)
        if rt.version > 0 or rt.pending or await asyncio.to_thread(self.store.any_submission, run_id):
            raise Rejected(Reason.ALREADY_STARTED, "updates were already accepted; the initial state is fixed")

    async def set_state(self, run_id: str, source: bytes | Path) -> dict:
        """Install the initial model (version 0) from safetensors bytes or a safetensors file."""
        rt = self.runtime(run_id)
        async with rt.lock:
            await self.require_not_started(run_id)
            master = await asyncio.to_thread(_parse_state, source)
            h = state_hash(master)
            if self.publisher is not None:
                # Version 0 in the object store first (nodes start there): a store that cannot be reached
                # refuses the state (503), nothing set.
                objs = await asyncio.to_thread(self.publisher.put_state, run_id, 0, master, None)
                await asyncio.to_thread(self.store.record_objects, objs)
                rt.store_checkpoint = 0
            opened = await asyncio.to_thread(self.store.set_initial_state, run_id, master, h)
            rt.state = RunState.load(rt.config, 0, master, None, {}, self.device, self.store.sketch_key(run_id))
            # The first close then finds its pages touched (.memory; nothing where malloc is not glibc's).
            await asyncio.to_thread(reserve, rt.state.close_memory_bytes())
            rt.weights_hash, rt.opened_at, rt.checkpoint, rt.dropped_to = h, opened, 0, 0
            self.metrics.set_version(run_id, 0)
        rt.wake.set()
        log.info(
            "run %s: initial state of %d tensors, %d parameters",
            run_id,
            len(master),
            sum(t.numel() for t in master.values()),
        )
        return {"version": 0, "weights_hash": h}

    def status(self, run_id: str) -> dict:
        rt = self.runtime(run_id)
        deadline = rt.deadline()
        return {
            "run_id": run_id,
            "version": rt.version,
            "open_round": rt.version,
            "weights_hash": rt.weights_hash,
            "status": rt.status,
            "status_detail": rt.status_detail,
            "submitted": len(rt.pending),
            "quorum": rt.config.quorum,
            "nodes": self.store.node_count(run_id),
            "deadline_in_s": None if deadline is None else max(0.0, deadline - time.time()),
            "config": rt.config.model_dump(mode="json"),
            "warnings": rt.config.warnings(),
            "object_store": self.objects is not None,
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
            public = rt.config.algorithm_spec.public_state(rt.state.algorithm_state)
            data = await asyncio.to_thread(pack_state_dict, public)
        return data, version, h

    async def updates_since(self, run_id: str, since: int, wait: float) -> Page:
        """The published versions from ``since+1`` on, as one open page of at most ``max_catch_up_bytes``
        (:mod:`.downlink`), long-polling up to ``wait`` seconds for a version newer than ``since`` (a
        shutdown ends the wait at once). An empty page when ``since`` is current."""
        rt = self.runtime(run_id)
        self._require_state(rt)
        if since > rt.version:
            raise Rejected(Reason.VERSION_AHEAD, f"version {since} is ahead of the run's {rt.version}")
        if since == rt.version and wait > 0 and not self.stopping.is_set():
            await _first_of((rt.published, self.stopping), timeout=wait)
        if rt.deleted:  # by the admin, while this request waited
            raise Rejected(Reason.UNKNOWN_RUN, f"run {run_id} was deleted")
        version, h = rt.version, rt.weights_hash
        if since == version:
            return Page(since + 1, since, version, h)
        oldest = self.store.oldest_diff(run_id, version, rt.config.keep_versions)
        if since + 1 < oldest:
            raise Rejected(
                Reason.TOO_FAR_BEHIND, f"diffs before version {oldest} are no longer kept; fetch the full state"
            )
        release = self._catch_ups.take() if since + 1 < version else None
        try:
            files, nbytes = await asyncio.to_thread(
                open_page, self.store, run_id, since + 1, version, self.settings.max_catch_up_bytes
            )
        except FileNotFoundError:
            if release is not None:
                release()
            raise Rejected(Reason.TOO_FAR_BEHIND, "those diffs were just pruned; fetch the full state") from None
        page = Page(since + 1, since + len(files), version, h, files, nbytes, release)
        if page.last != version:
            try:
                page.weights_hash = await asyncio.to_thread(self.store.version_hash, run_id, page.last)
            except BaseException:
                page.close()
                raise
        return page

    # -- the object store (docs/SERVER.md, "Object storage") ---------------------------------------

    def _require_objects(self) -> StorePublisher:
        if self.publisher is None:
            raise Rejected(
                Reason.NO_OBJECT_STORE,
                "this server has no object store (--object-store): submit frames to POST …/rounds/{round}/updates "
                "and read versions from GET …/updates",
            )
        return self.publisher

    async def objects_since(self, run_id: str, since: int | None, wait: float) -> dict:
        """The manifest of the versions after ``since`` in the object store (``None``: a node with no
        state, which starts from the store's checkpoint), long-polling up to ``wait`` seconds for a version
        newer than ``since`` as :meth:`updates_since` does."""
        publisher = self._require_objects()
        rt = self.runtime(run_id)
        self._require_state(rt)
        if since is not None:
            if since > rt.version:
                raise Rejected(Reason.VERSION_AHEAD, f"version {since} is ahead of the run's {rt.version}")
            if since == rt.version and wait > 0 and not self.stopping.is_set():
                await _first_of((rt.published, self.stopping), timeout=wait)
            if rt.deleted:
                raise Rejected(Reason.UNKNOWN_RUN, f"run {run_id} was deleted")
        version, h = rt.version, rt.weights_hash
        oldest = self.store.oldest_diff(run_id, version, rt.config.keep_versions)
        if rt.store_checkpoint is not None:
            oldest = min(oldest, rt.store_checkpoint + 1)
        return await asyncio.to_thread(publisher.manifest, run_id, since, version, h, oldest)

    async def upload_slot(self, run_id: str, node_id: int, round: int, nbytes: int, sha256: str) -> dict:
        """A presigned PUT for the one key of ``node_id`` in ``round``, bound to ``nbytes`` and ``sha256``
        (and ``If-None-Match: *``): checked as a submission's headers are (the run takes updates, the round
        is open, the size is under the run's cap)."""
        self._require_objects()
        rt = self.runtime(run_id)
        self.require_accepting(rt)
        self._require_state(rt)
        if nbytes > rt.config.max_frame_bytes:
            raise Rejected(
                Reason.FRAME_TOO_LARGE,
                f"a frame of {nbytes} bytes exceeds the limit of {rt.config.max_frame_bytes} bytes",
            )
        self._submissions.check_round(rt, node_id, round)
        key = self.objects.upload_key(run_id, round, node_id)
        url, headers, expires = self.objects.presign_put(key, nbytes, sha256)
        return {"key": key, "url": url, "headers": headers, "expires_at": expires, "max_bytes": nbytes}

    async def submit_uploaded(self, run_id: str, node_id: int, round: int, key: str) -> dict:
        """Record the frame node ``node_id`` wrote to its key of ``round``: the key is checked, the object's
        size (before a byte is read) and its store timestamp against the round's deadline, then it is read
        and recorded exactly as a submitted body is (:meth:`submit`)."""
        self._require_objects()
        rt = self.runtime(run_id)
        self.require_accepting(rt)
        self._require_state(rt)
        objects = self.objects
        expected = objects.upload_key(run_id, round, node_id)
        if key != expected:
            raise Rejected(
                Reason.UPLOAD_KEY_MISMATCH,
                f"node {node_id}'s upload for round {round} is {expected!r}, not {key!r}: a node tells only the "
                "key of its own slot",
            )
        what = f"reading node {node_id}'s upload for round {round} of run {run_id}"
        info = await asyncio.to_thread(objects.head, key, what)
        if info is None:
            raise Rejected(
                Reason.UPLOAD_NOT_FOUND, f"no object at {key!r} in {objects.url}: PUT the frame to the slot's URL first"
            )
        cap = rt.config.max_frame_bytes
        if info.nbytes > cap:
            raise Rejected(
                Reason.FRAME_TOO_LARGE, f"the object {key!r} is {info.nbytes} bytes, over the limit of {cap} bytes"
            )
        deadline = rt.deadline()
        if (
            round == rt.version
            and deadline is not None
            and info.last_modified > deadline
            and len(rt.pending) >= rt.config.min_updates
        ):
            # The round was due to close at its deadline: by the store's own clock this write came after it.
            raise Rejected(
                Reason.WRITTEN_AFTER_DEADLINE,
                f"the object {key!r} was written at {info.last_modified:.0f} (the store's Last-Modified), after "
                f"round {round}'s deadline {deadline:.3f}; the round closes without it",
            )

        def fetch() -> bytes:
            data = objects.get(key, cap, what)
            if data is None:
                raise Rejected(Reason.UPLOAD_NOT_FOUND, f"the object {key!r} disappeared before it was read")
            return data

        async with self.upload(run_id, node_id, round, info.nbytes):
            return await self.submit(run_id, node_id, round, fetch)

    def release_waiters(self) -> None:
        """Shutdown began: every long poll answers now (and none starts waiting)."""
        self.stopping.set()

    # -- the admin's hold on runs: pause, resume, delete ------------------------------------------

    def require_accepting(self, rt: RunRuntime) -> None:
        """409 ``run_paused`` / ``run_failed`` unless the run takes updates (a check cheap enough to make
        before a body is read)."""
        if rt.status == "paused":
            raise Rejected(
                Reason.RUN_PAUSED, f"run {rt.run_id} is paused by the admin; updates are refused until it is resumed"
            )
        if rt.status == "failed":
            raise Rejected(
                Reason.RUN_FAILED,
                f"run {rt.run_id} failed ({rt.status_detail}); updates are refused until the admin resumes it",
            )

    async def set_status(self, run_id: str, status: str) -> dict:
        """Pause (``paused``: no round closes, updates refused, reads go on) or resume (``active``: a failed
        run's round close is tried again at once) a run; persisted, so a restart keeps it."""
        assert status in ("active", "paused")
        rt = self.runtime(run_id)
        if (
            rt.state is None
            and status == "active"
            and (rec := await asyncio.to_thread(self.store.get_run, run_id)).has_state
        ):
            # Its recovery failed at startup: try it again (its driver waits on the old runtime).
            fresh = await self._recover(rec)
            if fresh.state is None:
                raise Rejected(Reason.RUN_FAILED, f"run {run_id} still cannot be recovered: {fresh.status_detail}")
            rt.deleted = True  # the stale runtime's driver ends
            await self._driver.stop_run(rt)
            rt = self.runs[run_id] = fresh
            self._driver.start(rt)
        async with rt.lock:  # after a round close in flight
            before, detail = rt.status, rt.status_detail
            await asyncio.to_thread(self.store.set_run_status, run_id, status, None)
            rt.status, rt.status_detail = status, None
            rt.reset_retries()
        rt.wake.set()
        if before != status:
            log.warning(
                "run %s: %s by the admin (was %s%s)",
                run_id,
                "resumed" if status == "active" else "paused",
                before,
                f": {detail}" if detail else "",
            )
        return self.status(run_id)

    async def delete_run(self, run_id: str) -> None:
        """Remove a run, its nodes (their tokens stop working) and its files; requests waiting on it end."""
        rt = self.runtime(run_id)
        rt.deleted = True
        await self._driver.stop_run(rt)
        async with rt.lock:
            try:
                await asyncio.to_thread(self.store.delete_run, run_id)
            except BaseException:
                rt.deleted = False
                self._driver.start(rt)
                raise
            self.runs.pop(run_id, None)
        rt.published.set()
        self.metrics.forget_run(run_id)
        log.warning("run %s deleted by the admin at version %d", run_id, rt.version)

    def wake_all(self) -> None:
        """The storage writes again: every run whose close waits for a retry tries at once."""
        for rt in self.runs.values():
            if rt.retry_at is not None:
                rt.retry_at = None
                rt.wake.set()

    def statuses(self) -> list[str]:
        return [rt.status for rt in self.runs.values()]

    def failed_runs(self) -> dict[str, str | None]:
        """Each failed run's id and cause."""
        return {rt.run_id: rt.status_detail for rt in self.runs.values() if rt.status == "failed"}

    # -- submissions and closing rounds (see .submissions and .driver) ----------------------------

    def upload(self, run_id: str, node_id: int, round: int, declared: int | None):
        """The checks of an update that need no body, and the node's one upload slot while its body is read
        and recorded (:meth:`.submissions.Submissions.upload`): ``async with engine.upload(…): …``."""
        rt = self.runtime(run_id)
        self.require_accepting(rt)
        self._require_state(rt)
        return self._submissions.upload(rt, node_id, round, declared)

    async def submit(self, run_id: str, node_id: int, round: int, body: bytes | Callable[[], bytes]) -> dict:
        """Validate and durably record one update; the answer means it will be counted exactly once."""
        rt = self.runtime(run_id)
        self.require_accepting(rt)
        self._require_state(rt)
        return await self._submissions.submit(rt, node_id, round, body)

    async def close_round(self, rt: RunRuntime) -> Closed | None:
        """Aggregate the open round, step, publish the next version (``None`` if nothing is pending); then
        write a checkpoint if one is due (:meth:`.driver.RoundDriver.close_round`)."""
        return await self._driver.close_round(rt)

    def close_and_publish(self, rt: RunRuntime, updates: list[Update]) -> Closed:
        """Step ``rt.state`` in place through round ``rt.version`` and durably publish the next version
        (:meth:`.driver.RoundDriver.close_and_publish`). ``rt`` itself is left for the caller to update."""
        return self._driver.close_and_publish(rt, updates)

    async def checkpoint(self, rt: RunRuntime) -> None:
        """Write the full state of the current version and record it (:meth:`.driver.RoundDriver.checkpoint`)."""
        await self._driver.checkpoint(rt)


async def _first_of(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Wait until any of ``events`` is set, or ``timeout`` seconds."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def _parse_state(source: bytes | Path) -> dict[str, torch.Tensor]:
    """Safetensors bytes or file → fp32 master weights, checked (never unpickled)."""
    try:
        state = (
            state_from_bytes(source) if isinstance(source, (bytes, bytearray, memoryview)) else state_from_file(source)
        )
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
        # A copy the server owns: a file's tensors are copy-on-write pages of its mapping, which would
        # keep the unlinked upload on disk for the run's life and fault page by page in the first close.
        t = t.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
        if not bool(torch.isfinite(t).all()):
            raise Rejected(Reason.BAD_STATE, f"tensor {name!r} holds NaN or infinite values")
        out[name] = t
    return out
