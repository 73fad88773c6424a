"""A run's live state in the server (:class:`RunRuntime`), and an update staged for its next group commit.

Every part of the round engine (:mod:`.rounds`) works on it: :mod:`.recovery` builds it from the store,
:mod:`.submissions` adds acknowledged updates to it, :mod:`.driver` closes its rounds. Its ``lock`` is the
one lock of the run: recording an update and closing a round both hold it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from gradwire.frame import Frame

from .aggregate import Update
from .config import RunConfig
from .replays import RecentRecords
from .round_sum import RoundSum
from .transition import RunState

__all__ = ["RunRuntime"]


@dataclass
class RunRuntime:
    """A run's live state. ``state`` is stepped in place by the driver alone (under ``lock``)."""

    run_id: str
    config: RunConfig
    version: int = 0
    weights_hash: str | None = None
    opened_at: float | None = None
    state: RunState | None = None
    #: The last checkpoint recorded in the store, and the target round below which submission frames
    #: were deleted.
    checkpoint: int = 0
    dropped_to: int = 0
    #: The last version whose weights are in the object store (``None``: no store, or none yet).
    store_checkpoint: int | None = None
    #: Rows of updates and versions before this round were deleted (Store.prune_rows), in steps of ROW_PRUNE_EVERY.
    rows_pruned_to: int = 0
    pending: dict[tuple[int, int], Update] = field(default_factory=dict)
    #: The open round's running sum of ``pending`` in commit order (:mod:`.round_sum`): added to as each
    #: update is committed, so the close does not start it; ``None``: none kept (the close builds one).
    round_sum: RoundSum | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    published: asyncio.Event = field(default_factory=asyncio.Event)
    #: Updates validated and written, waiting for the next group commit, and the task committing them.
    staged: list[_Staged] = field(default_factory=list)
    committer: asyncio.Task | None = None
    #: Nodes whose update body is being received or recorded now: one upload per node at a time.
    uploading: set[int] = field(default_factory=set)
    #: The digests of the records taken in the last rounds: a replayed or copied update is refused.
    recent: RecentRecords = field(default_factory=RecentRecords)
    #: ``active``; ``paused`` by the admin (no round closes, updates refused); ``failed``: its round close
    #: failed ``close_failures_before_failed`` times the same way (``status_detail`` says how), until the
    #: admin resumes it. ``deleted`` once the admin deleted it (whoever still holds it lets go).
    status: str = "active"
    status_detail: str | None = None
    deleted: bool = False
    #: The driver's retry state: failed round closes in a row, how many of the last ones failed the same
    #: way (``close_cause``), and when to try again (``None``: as soon as the round is ready).
    close_failures: int = 0
    close_same: int = 0
    close_cause: str | None = None
    retry_at: float | None = None
    #: Runs with validators (``config.validation``): when the open round became ready and began waiting for
    #: its scores (``None``: not yet), the senders it held then (the candidates whose scores it waits for:
    #: one arriving later does not hold the round), and the scores posted for it,
    #: ``{validator_id: {node_id: score}}``.
    scoring_since: float | None = None
    scoring_senders: frozenset[int] = frozenset()
    round_scores: dict[int, dict[int, float]] = field(default_factory=dict)
    #: Set (and replaced by a fresh one) by the driver whenever the open round may have changed for its
    #: validators: an update committed, the round began waiting for scores, a round closed. A candidates
    #: long poll waits on it instead of polling.
    round_news: asyncio.Event = field(default_factory=asyncio.Event)

    def tell_validators(self) -> None:
        """Wake every candidates long poll of the run (they look again)."""
        event, self.round_news = self.round_news, asyncio.Event()
        event.set()

    def reset_scoring(self) -> None:
        """The open round waits for no scores any more (it closed): the next one starts afresh."""
        self.scoring_since, self.scoring_senders, self.round_scores = None, frozenset(), {}

    def reset_retries(self) -> None:
        """Forget failed closes: the next one is tried as soon as the round is ready."""
        self.close_failures = self.close_same = 0
        self.close_cause = self.retry_at = None

    @property
    def master(self) -> dict[str, torch.Tensor] | None:
        return None if self.state is None else self.state.master

    @property
    def spec(self) -> dict[str, tuple[int, ...]]:
        return {} if self.master is None else {n: tuple(t.shape) for n, t in self.master.items()}

    @property
    def dense_bytes(self) -> int:
        return 0 if self.master is None else sum(4 * t.numel() for t in self.master.values())

    def distinct_nodes(self) -> int:
        return len({node for node, _ in self.pending})

    def deadline(self) -> float | None:
        return None if self.opened_at is None else self.opened_at + self.config.round_deadline_s

    def score_deadline(self) -> float | None:
        """When the open round stops waiting for scores (``None``: it is not waiting)."""
        if self.config.validation is None or self.scoring_since is None:
            return None
        return self.scoring_since + self.config.validation.score_deadline_s

    def keep_submissions_from(self) -> int:
        """Runs whose replay re-runs the server's own encoding (AdamW's diff, a re-encoded aggregate) keep
        the submissions from the checkpoint on; the others need only the open round's."""
        return self.checkpoint if self.config.replays_from_submissions else self.version


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
    answer: asyncio.Future | None = None
    #: :func:`.replays.update_digest` of its records (``None`` for an all-zero update, which is exempt).
    digest: bytes | None = None
    #: What validation parsed of its records, kept for the round's close (:mod:`.prepare`).
    parsed: dict = field(default_factory=dict, repr=False)
    #: ``(key, sketch)`` of its records for the direction check (:mod:`gradwire.sketch`; ``None``: none).
    sketch: tuple | None = field(default=None, repr=False)
    #: Its sketch for the sender histories (:func:`gradwire.sender_history.history_sketch`; ``None``: none).
    history_sketch: object = field(default=None, repr=False)

    def update(self) -> Update:
        """The acknowledged update the open round keeps of it."""
        return Update(
            self.frame,
            self.weight,
            self.norm,
            self.node_id,
            self.body,
            self.sha,
            self.parsed,
            self.digest,
            self.sketch,
            self.round,
            self.history_sketch,
        )
