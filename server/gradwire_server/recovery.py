"""Recovering a run from the store: its committed state, and the acknowledged updates of its open round.

A run's committed state is its last checkpoint with the versions since replayed
(:meth:`Recovery._load_state`) by the same code that closed them (:mod:`.transition`): AdamW runs replay
each round from its logged submissions (:meth:`Recovery._logged_updates`) and check the frame they make
against the published one; DeMo and SparseLoCo runs apply the published frames. The result must give the
committed weights hash. Checkpoints go to disk every ``checkpoint_every`` versions and, for states up to
``checkpoint_every_version_below_bytes``, with every version (:mod:`.driver`).

At startup :meth:`Recovery.recover` builds each run's :class:`~.runtime.RunRuntime`: the state, the open
round's acknowledged updates (from their rows and frames), and the store pruned to what a replay needs. If
a round close fails before its commit, :meth:`Recovery.reload` puts the run back in step with the store,
which gives back exactly the committed version.
"""

from __future__ import annotations

import logging
import time

import torch

from gradwire import read_frame
from gradwire.binding import strip_binding
from gradwire.state import state_hash

from .aggregate import Update
from .config import RunConfig
from .memory import reserve
from .metrics import Metrics
from .replays import update_digest
from .runtime import RunRuntime
from .store import RunRecord, Store, SubmissionRecord
from .transition import RunState

__all__ = ["Recovery"]

# The round engine's one logger, whichever of its modules logs.
log = logging.getLogger("gradwire_server.rounds")


class Recovery:
    """Loads what the store committed for a run: at startup, and after a failed round close."""

    def __init__(self, store: Store, metrics: Metrics, device: torch.device):
        self.store = store
        self.metrics = metrics
        self.device = device

    def recover(self, run_id: str) -> RunRuntime:
        """The runtime of ``run_id`` as the store committed it, with the open round's acknowledged updates."""
        rec = self.store.get_run(run_id)
        assert rec is not None
        rt = RunRuntime(
            run_id=run_id,
            config=RunConfig.model_validate(rec.config),
            version=rec.version,
            weights_hash=rec.weights_hash,
            opened_at=rec.round_opened_at,
            status=rec.status,
            status_detail=rec.status_detail,
        )
        if not rec.has_state:
            return rt
        rt.state = self._load_state(rec, rt.config)
        rt.checkpoint = rt.dropped_to = rec.checkpoint_version
        self.store.prune(run_id, rec.version, rt.config.keep_versions, rt.checkpoint, rt.keep_submissions_from())
        rt.dropped_to = rt.keep_submissions_from()
        rt.store_checkpoint = self.store.store_checkpoint(run_id, rec.version)
        rt.pending = {(u.node_id, sub.round): u for sub, u in self._logged_updates(run_id, rec.version)}
        # The scores validators posted for the open round (committed as they came): its close still counts them.
        rt.round_scores = self.store.round_scores(run_id, rec.version, rec.version).get(rec.version, {})
        for (node_id, round_), u in sorted(rt.pending.items()):  # the open round's records, remembered again
            rt.recent.add(update_digest(u.frame.entries, u.norm), node_id, round_)
        self.metrics.set_version(run_id, rt.version)
        return rt

    def _logged_updates(self, run_id: str, target_round: int) -> list[tuple[SubmissionRecord, Update]]:
        """The acknowledged updates counted in ``target_round``, from their rows and frames, in the order
        a round aggregates them."""
        out = []
        for sub in self.store.submissions_for(run_id, target_round):
            raw = self.store.read_submission(sub)
            # Without its run binding, as validation recorded it (docs/FORMAT.md section 10).
            frame = strip_binding(read_frame(raw))
            out.append((sub, Update(frame, sub.weight, sub.norm, sub.node_id, raw, sub.sha256, round=sub.round)))
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
        if config.algorithm_spec.publication == "diff" and moments is None and c > 0:
            raise RuntimeError(f"run {run_id}: the moments of checkpoint {c} are missing")
        state = RunState.load(
            config,
            c,
            weights,
            moments,
            self.store.load_server_state(run_id, c),
            self.device,
            self.store.sketch_key(run_id),
        )
        reserve(state.close_memory_bytes())  # before the replays, which are closes too (.memory)
        if rec.version == c:
            return state
        t0 = time.perf_counter()
        diverged = []
        scored = self.store.version_weights(run_id, c + 1, rec.version)  # the validators' weights (.scores)
        for v in range(c, rec.version):
            published = self.store.diff_path(run_id, v + 1).read_bytes()
            logged = lambda v=v: [u for _, u in self._logged_updates(run_id, v)]  # noqa: E731
            if not state.replay(logged, published, scored.get(v + 1)):
                diverged.append(v + 1)
        if state.weights_hash() != rec.weights_hash:
            raise RuntimeError(
                f"run {run_id}: replaying versions {c + 1}..{rec.version} from checkpoint {c} "
                "does not give the committed weights hash"
            )
        if diverged:
            log.warning(
                "run %s: replaying versions %s made frames other than the published ones (another thread "
                "count or BLAS?): the weights are exact (the published frames applied), AdamW's moments "
                "and the downlink error buffer may differ in their last bits from the original run",
                run_id,
                diverged,
            )
        log.info(
            "run %s: replayed versions %d..%d from checkpoint %d in %.2f s",
            run_id,
            c + 1,
            rec.version,
            c,
            time.perf_counter() - t0,
        )
        return state

    def reload(self, rt: RunRuntime) -> None:
        """Put ``rt`` back in step with the store after a failed round close (its state may be half-stepped)."""
        rt.state = None
        rec = self.store.get_run(rt.run_id)
        assert rec is not None
        rt.state = self._load_state(rec, rt.config)
        if rec.version != rt.version:  # the commit went through after all
            rt.pending = {}
        rt.version, rt.weights_hash, rt.opened_at = rec.version, rec.weights_hash, rec.round_opened_at
        rt.checkpoint = rec.checkpoint_version
