"""Recording updates: staging in the validation pool, the duplicate and round checks, group commit.

Each update is hashed, validated and written (fsynced) in one worker thread of its own, in a pool of one
thread per core by default (:meth:`Submissions._stage`); updates then commit in groups
(:meth:`Submissions._commit_groups`): the ones that arrive while a commit is in flight share the next
one, so a burst of submissions costs one directory fsync and one SQLite commit per group, not per update.

Concurrency: the commit holds the run's ``asyncio.Lock``, as closing a round does, and checks the update
again there (the round may have closed, a concurrent request may have recorded the same node and round),
so an update is either counted in the round being closed or refused as late — never acknowledged and
then lost. Each answer comes only after the commit that holds its row.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from gradwire.model_record import run_spec

from .aggregate import Update
from .errors import Reason, Rejected, StorageFailed
from .metrics import Metrics
from .prepare import parsed_while, sketches_of
from .replays import update_digest
from .runtime import RunRuntime, _Staged
from .settings import ServerSettings
from .store import Store, SubmissionRecord
from .validate import validate_update

__all__ = ["Submissions"]

# The round engine's one logger, whichever of its modules logs.
log = logging.getLogger("gradwire_server.rounds")


class Submissions:
    """Every run's submissions: validated in a pool of threads, then recorded by group commits."""

    def __init__(self, store: Store, metrics: Metrics, settings: ServerSettings):
        self.store = store
        self.metrics = metrics
        # Submissions are validated in a pool of their own, one thread per core by default: validation
        # is mostly Python and NumPy holding the GIL, and more threads than cores only make the event
        # loop wait longer for the GIL.
        self._validators = ThreadPoolExecutor(
            max_workers=settings.validate_threads or os.cpu_count() or 1, thread_name_prefix="gradwire-validate"
        )

    def close(self) -> None:
        """Stop the validation pool (at shutdown; queued validations are cancelled)."""
        self._validators.shutdown(wait=False, cancel_futures=True)

    def _existing(self, rt: RunRuntime, node_id: int, round: int, sha: str) -> dict | None:
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
            raise Rejected(
                Reason.CONFLICTING_SUBMISSION, f"node {node_id} already submitted a different update for round {round}"
            )
        return {"round": round, "node_id": node_id, "duplicate": True, "submitted": len(rt.pending), "sha256": sha}

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

    def check_round(self, rt: RunRuntime, node_id: int, round: int) -> None:
        """The round checks of :meth:`upload` that need nothing of the store: another upload of the node in
        progress (429), the round open (409 ``round_not_open``, 410 ``round_closed``) unless this node's
        update of it is already recorded (then its slot leads to the same key, and a tell to a duplicate)."""
        if node_id in rt.uploading:
            raise Rejected(
                Reason.UPLOAD_IN_PROGRESS,
                f"node {node_id} is already uploading an update; retry when it is answered",
                headers={"Retry-After": "1"},
            )
        if (node_id, round) not in rt.pending:
            self._weight_for(rt, round)

    @contextlib.asynccontextmanager
    async def upload(self, rt: RunRuntime, node_id: int, round: int, declared: int | None):
        """Hold the node's one upload slot while its body is read and recorded, after the checks that need
        no body: the round (409 ``round_not_open``, 410 ``round_closed``), an update already recorded for
        this node and round with another size (409 ``conflicting_submission``; the same size needs the
        bytes: a duplicate is answered 202), another upload of the node in progress (429
        ``upload_in_progress``). ``declared``: the Content-Length, if any. Everything is checked again
        with the body, under the run's lock."""
        if node_id in rt.uploading:
            raise Rejected(
                Reason.UPLOAD_IN_PROGRESS,
                f"node {node_id} is already uploading an update; retry when it is answered",
                headers={"Retry-After": "1"},
            )
        recorded = rt.pending.get((node_id, round))
        size = len(recorded.raw) if recorded is not None and recorded.raw else None
        if recorded is None and round < rt.version:
            rec = await asyncio.to_thread(self.store.get_submission, rt.run_id, node_id, round)
            size = None if rec is None else rec.nbytes
        if size is None:
            self._weight_for(rt, round)  # no update of this node and round yet: is the round open?
        elif declared is not None and declared != size:
            raise Rejected(
                Reason.CONFLICTING_SUBMISSION, f"node {node_id} already submitted a different update for round {round}"
            )
        rt.uploading.add(node_id)
        try:
            yield
        finally:
            rt.uploading.discard(node_id)

    async def submit(self, rt: RunRuntime, node_id: int, round: int, body: bytes | Callable[[], bytes]) -> dict:
        """Validate and durably record one update of ``rt`` (a run with a state); the answer means it will
        be counted exactly once. ``body``: the frame, or a function that fetches it (from the object store),
        called in the validation pool with the rest of the update's own work."""
        # Read on the event loop: a failed round close reloads the state in a worker thread.
        spec = rt.spec
        record = run_spec(rt.master).record_name if rt.config.model_record else None
        staged = await asyncio.get_running_loop().run_in_executor(
            self._validators, functools.partial(self._stage, rt, spec, record, node_id, round, body)
        )
        if isinstance(staged, dict):
            return staged
        # Shielded: once recording has begun, a client that hangs up must not leave a durable record
        # that the open round does not count.
        answer = await asyncio.shield(self._commit_with_group(rt, staged))
        if not answer["duplicate"]:
            self.metrics.updates_accepted.inc()
            self.metrics.compression_ratio.set(rt.dense_bytes / max(1, len(staged.body)))
        return answer

    def _stage(
        self, rt: RunRuntime, spec, record: str | None, node_id: int, round: int, body: bytes | Callable[[], bytes]
    ) -> _Staged | dict:
        """In a worker thread, everything one update needs before its commit: the frame fetched (from the
        object store, where ``body`` is a function), the content hash, the early refusals (a duplicate is
        answered here, before any parsing), full validation, and the frame's file written and fsynced.
        What it reads of ``rt`` is checked again under the lock at the commit."""
        if callable(body):
            body = body()
        sha = hashlib.sha256(body).hexdigest()
        dup = self._existing(rt, node_id, round, sha)
        if dup is not None:
            return dup
        self._weight_for(rt, round)  # refuse late or early updates before parsing them
        t0 = time.perf_counter()
        (frame, norm), parsed = parsed_while(
            lambda: validate_update(
                body,
                spec,
                node_id=node_id,
                round=round,
                max_frame_bytes=rt.config.max_frame_bytes,
                max_update_norm=rt.config.max_update_norm,
                model_record=record,
                run_id=rt.run_id,
                require_binding=rt.config.require_run_binding,
            )
        )
        digest = update_digest(frame.entries, norm)
        rt.recent.check(digest, node_id, round)  # another node's or round's records: refused before the write
        sketch = history = None
        if rt.state is not None:
            rule = rt.state.rule
            sketch, history = sketches_of(frame, parsed, rule.sketch_key, rule.senders is not None)
        self.metrics.decode_seconds.observe(time.perf_counter() - t0)
        # The name carries the content hash, so concurrent submissions never share a file.
        self.store.write_submission(rt.run_id, round, node_id, sha, body)
        return _Staged(
            node_id, round, sha, body, frame, norm, digest=digest, parsed=parsed, sketch=sketch, history_sketch=history
        )

    async def _commit_with_group(self, rt: RunRuntime, staged: _Staged) -> dict:
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

    async def _commit_group(self, rt: RunRuntime, group: list[_Staged]) -> None:
        """Under the run's lock: the checks again (the round may have closed, a concurrent request may have
        recorded the same node and round), then one commit for every update still accepted."""
        accepted: dict[tuple[int, int], _Staged] = {}
        duplicates: list[_Staged] = []
        in_group: dict[bytes, tuple[int, int]] = {}  # digests this group takes
        now = time.time()
        for s in group:
            try:
                first = accepted.get((s.node_id, s.round))
                if first is not None:
                    if first.sha != s.sha:
                        raise Rejected(
                            Reason.CONFLICTING_SUBMISSION,
                            f"node {s.node_id} already submitted a different update for round {s.round}",
                        )
                    duplicates.append(s)
                    continue
                dup = self._existing(rt, s.node_id, s.round, s.sha)
                if dup is not None:
                    s.answer.set_result(dup)
                    continue
                s.weight = self._weight_for(rt, s.round)
                rt.recent.check(s.digest, s.node_id, s.round)
                first_here = in_group.get(s.digest) if s.digest is not None else None
                if first_here is not None and first_here[1] != s.round:
                    raise Rejected(
                        Reason.REPLAYED_UPDATE,
                        f"node {s.node_id}'s update for round {s.round} repeats the records node "
                        f"{first_here[0]} sent for round {first_here[1]}: an update is taken once",
                    )
            except Rejected as exc:
                s.answer.set_exception(exc)
                continue
            accepted[(s.node_id, s.round)] = s
            if s.digest is not None:
                in_group[s.digest] = (s.node_id, s.round)
        recs = [
            SubmissionRecord(rt.run_id, s.node_id, s.round, rt.version, s.sha, len(s.body), s.weight, s.norm, now)
            for s in accepted.values()
        ]
        if recs:
            self.metrics.commit_group_size.observe(len(recs))
            try:
                if rt.deleted:
                    raise Rejected(Reason.UNKNOWN_RUN, f"run {rt.run_id} was deleted")
                await asyncio.to_thread(self.store.commit_submissions, recs)
            except BaseException as exc:
                # None of the group is recorded (one transaction): each request gets the error (507/503 for
                # the storage, which logs that itself; else a 500; the client may retry), and the next group
                # is committed as usual.
                if not isinstance(exc, Rejected):
                    log.exception("run %s: committing %d update(s) failed", rt.run_id, len(recs))
                if isinstance(exc, StorageFailed):
                    # Their frames have no row and never will: on a full disk their space is wanted now.
                    await asyncio.to_thread(self.store.discard_submissions, recs)
                for s in [*accepted.values(), *duplicates]:
                    s.answer.set_exception(exc if isinstance(exc, Exception) else RuntimeError("commit interrupted"))
                if not isinstance(exc, Exception):
                    raise
                return
        added = []
        for s in accepted.values():
            update = rt.pending[(s.node_id, s.round)] = s.update()
            added.append(update)
            rt.recent.add(s.digest, s.node_id, s.round)
        submitted = len(rt.pending)
        for s in accepted.values():
            s.answer.set_result(
                {"round": s.round, "node_id": s.node_id, "duplicate": False, "submitted": submitted, "sha256": s.sha}
            )
        for s in duplicates:
            s.answer.set_result(
                {"round": s.round, "node_id": s.node_id, "duplicate": True, "submitted": submitted, "sha256": s.sha}
            )
        # Answered; still under the run's lock, so the round's close finds them summed (.round_sum).
        await asyncio.to_thread(self._add_to_round_sum, rt, added)

    @staticmethod
    def _add_to_round_sum(rt: RunRuntime, added: list[Update]) -> None:
        """Add the updates just committed to the open round's running sum, in their commit order (a sum that
        fails is dropped: the close builds one from the round's updates)."""
        if rt.state is None:
            return
        if rt.round_sum is None and len(rt.pending) == len(added):
            rt.round_sum = rt.state.new_round_sum()
        rs = rt.round_sum
        if rs is None or rs.spent or len(rs.updates) + len(added) != len(rt.pending):
            rt.round_sum = None
            return
        try:
            for update in added:
                rs.add(update)
        except Exception:
            log.exception("run %s: the open round's running sum failed; its close sums the round itself", rt.run_id)
            rt.round_sum = None
