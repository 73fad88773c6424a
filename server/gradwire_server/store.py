"""Durable state: SQLite for runs, nodes, versions and submission records; files for tensors and frames.

Layout under ``data_dir``::

    gradwire.sqlite3                       runs, nodes, versions, submissions (WAL, synchronous=FULL)
    runs/<run_id>/weights/v<version>.safetensors    fp32 master weights at checkpoint <version>
    runs/<run_id>/moments/v<version>.safetensors    AdamW exp_avg.* / exp_avg_sq.* after <version> steps
    runs/<run_id>/server_state/v<version>.safetensors  the algorithm's server-side state at <version>
                                                   (gradwire.state.pack_state_dict): AdamW runs keep their
                                                   downlink ErrorFeedback's state_dict() (residuals and codec
                                                   state), SparseLoCo runs the outer optimizer's momentum
    runs/<run_id>/diffs/v<version>.gwf              the frame that published <version>
    runs/<run_id>/submissions/r<round>-n<node>-<sha>.gwf  an acknowledged update

A **version** is its published frame plus one SQLite commit. A **checkpoint** is the full state (weights,
moments, server state) of one version, written every ``checkpoint_every`` versions (and at every version
for small states); ``runs.checkpoint_version`` names the last complete one. The state at the run's version
is the last checkpoint with the versions since replayed: from their published frames (DeMo, SparseLoCo),
and from the logged submissions of those rounds (AdamW, whose moments and downlink state follow from the
aggregated gradients). So the frames of every version after the checkpoint, and (AdamW) the submissions of
every round from the checkpoint on, are kept until the next checkpoint is recorded.

Every file is written atomically: a temporary file in the same directory, fsync, rename over the final
name, fsync of the directory. A submission is acknowledged only after its file is durable *and* its row
is committed; submissions arriving together share that directory fsync and that commit (group commit). Publishing a version writes its frame (and, at a checkpoint written with it, the state
files) first and then commits one SQLite transaction that moves the run's version: that commit is the
only point at which a version exists, so a crash at any moment leaves either the old version (whose files
were never touched) or the new one. A checkpoint written after its version's commit counts once a second
commit records it; until then the previous one serves.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from gradwire.state import pack_state_dict, unpack_state_dict

__all__ = ["NodeRecord", "RunRecord", "Store", "SubmissionRecord", "atomic_write"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id          TEXT PRIMARY KEY,
    config          TEXT NOT NULL,
    created_at      REAL NOT NULL,
    version         INTEGER NOT NULL DEFAULT 0,
    weights_hash    TEXT,
    has_state       INTEGER NOT NULL DEFAULT 0,
    round_opened_at REAL,
    checkpoint_version INTEGER NOT NULL DEFAULT 0,
    checkpoint_hash TEXT
);
CREATE TABLE IF NOT EXISTS nodes (
    run_id      TEXT NOT NULL REFERENCES runs(run_id),
    node_id     INTEGER NOT NULL,
    name        TEXT,
    token_hash  TEXT NOT NULL UNIQUE,
    created_at  REAL NOT NULL,
    PRIMARY KEY (run_id, node_id)
);
CREATE TABLE IF NOT EXISTS submissions (
    run_id       TEXT NOT NULL REFERENCES runs(run_id),
    node_id      INTEGER NOT NULL,
    round        INTEGER NOT NULL,
    target_round INTEGER NOT NULL,
    sha256       TEXT NOT NULL,
    nbytes       INTEGER NOT NULL,
    weight       REAL NOT NULL,
    norm         REAL NOT NULL,
    received_at  REAL NOT NULL,
    PRIMARY KEY (run_id, node_id, round)
);
CREATE INDEX IF NOT EXISTS submissions_target ON submissions (run_id, target_round);
CREATE TABLE IF NOT EXISTS versions (
    run_id        TEXT NOT NULL REFERENCES runs(run_id),
    version       INTEGER NOT NULL,
    weights_hash  TEXT NOT NULL,
    frame_bytes   INTEGER NOT NULL,
    updates       INTEGER NOT NULL,
    published_at  REAL NOT NULL,
    PRIMARY KEY (run_id, version)
);
"""

_VERSIONED = re.compile(r"^v(\d+)\.(safetensors|gwf)$")
_SUBMISSION = re.compile(r"^r(\d+)-n(\d+)-([0-9a-f]{32})\.gwf$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | memoryview, *, sync_dir: bool = True) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the complete new one.

    ``sync_dir=False`` leaves the directory's fsync (which makes the new name durable) to the caller, who
    may then make a whole group of files durable with one (:meth:`Store.commit_submissions`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if sync_dir:
        _fsync_dir(path.parent)


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    config: dict
    created_at: float
    version: int
    weights_hash: Optional[str]
    has_state: bool
    round_opened_at: Optional[float]
    #: The last version whose full state is on disk, and its weights hash.
    checkpoint_version: int = 0
    checkpoint_hash: Optional[str] = None


@dataclass(frozen=True)
class NodeRecord:
    run_id: str
    node_id: int
    name: Optional[str]


@dataclass(frozen=True)
class SubmissionRecord:
    run_id: str
    node_id: int
    round: int
    target_round: int
    sha256: str
    nbytes: int
    weight: float
    norm: float
    received_at: float


class Store:
    """SQLite plus files under ``data_dir``. Thread-safe: one connection behind a lock."""

    def __init__(self, data_dir: os.PathLike | str):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.data_dir / "gradwire.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before it returns, which a 202 promises.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        with self._lock:
            self._db.executescript(_SCHEMA)
            self._migrate()
            rows = self._db.execute("SELECT token_hash, run_id, node_id, name FROM nodes").fetchall()
        self._nodes_by_token: dict[str, NodeRecord] = {h: NodeRecord(*rest) for h, *rest in rows}

    def _migrate(self) -> None:
        """Stores written before checkpoints held the full state of every version: their checkpoint is
        their version."""
        cols = {row[1] for row in self._db.execute("PRAGMA table_info(runs)")}
        if "checkpoint_version" not in cols:
            self._tx([("ALTER TABLE runs ADD COLUMN checkpoint_version INTEGER NOT NULL DEFAULT 0", ()),
                      ("ALTER TABLE runs ADD COLUMN checkpoint_hash TEXT", ()),
                      ("UPDATE runs SET checkpoint_version = version, checkpoint_hash = weights_hash", ())])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- transactions -----------------------------------------------------------------------------

    def _tx(self, statements: Iterable[tuple], expect_one: bool = False) -> list[int]:
        """Run statements in one transaction; with ``expect_one`` each must change exactly one row."""
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                out = []
                for sql, args in statements:
                    n = cur.execute(sql, args).rowcount
                    if expect_one and n != 1:
                        raise RuntimeError(f"expected one row changed, got {n}: {sql.split()[0]} ...")
                    out.append(n)
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            return out

    def _one(self, sql: str, args: tuple = ()):
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple = ()):
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- paths ------------------------------------------------------------------------------------

    def run_dir(self, run_id: str) -> Path:
        return self.data_dir / "runs" / run_id

    def _versioned(self, run_id: str, kind: str, version: int) -> Path:
        ext = "gwf" if kind == "diffs" else "safetensors"
        return self.run_dir(run_id) / kind / f"v{version:09d}.{ext}"

    def submission_path(self, run_id: str, round: int, node_id: int, sha256: str) -> Path:
        # The content hash in the name: two different frames for one (node, round) racing each other
        # never share a file, so the one whose row is committed is the one on disk.
        return self.run_dir(run_id) / "submissions" / f"r{round:09d}-n{node_id}-{sha256[:32]}.gwf"

    def diff_path(self, run_id: str, version: int) -> Path:
        return self._versioned(run_id, "diffs", version)

    # -- runs -------------------------------------------------------------------------------------

    def create_run(self, config: dict) -> str:
        run_id = secrets.token_hex(8)
        self._tx([("INSERT INTO runs (run_id, config, created_at) VALUES (?, ?, ?)",
                   (run_id, json.dumps(config), time.time()))])
        return run_id

    _RUN_COLS = ("run_id, config, created_at, version, weights_hash, has_state, round_opened_at, "
                 "checkpoint_version, checkpoint_hash")

    @staticmethod
    def _run(row) -> RunRecord:
        return RunRecord(row[0], json.loads(row[1]), row[2], row[3], row[4], bool(row[5]), row[6], row[7], row[8])

    def get_run(self, run_id: str) -> Optional[RunRecord]:
        row = self._one(f"SELECT {self._RUN_COLS} FROM runs WHERE run_id = ?", (run_id,))
        return None if row is None else self._run(row)

    def list_runs(self) -> list[RunRecord]:
        rows = self._all(f"SELECT {self._RUN_COLS} FROM runs ORDER BY created_at")
        return [self._run(r) for r in rows]

    def set_initial_state(self, run_id: str, weights: Mapping[str, torch.Tensor], weights_hash: str) -> float:
        """Store version 0's weights (the first checkpoint); fails (returns nothing new) if any update was
        already recorded."""
        atomic_write(self._versioned(run_id, "weights", 0), st_save(dict(weights)))
        opened = time.time()
        self._tx([("UPDATE runs SET has_state = 1, weights_hash = ?, round_opened_at = ?, checkpoint_version = 0, "
                   "checkpoint_hash = ? WHERE run_id = ? AND version = 0", (weights_hash, opened, weights_hash, run_id))])
        return opened

    def any_submission(self, run_id: str) -> bool:
        return self._one("SELECT 1 FROM submissions WHERE run_id = ? LIMIT 1", (run_id,)) is not None

    # -- nodes ------------------------------------------------------------------------------------

    def add_node(self, run_id: str, name: Optional[str], token_hash: str) -> int:
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                (last,) = cur.execute("SELECT COALESCE(MAX(node_id), 0) FROM nodes WHERE run_id = ?",
                                      (run_id,)).fetchone()
                node_id = last + 1
                cur.execute("INSERT INTO nodes (run_id, node_id, name, token_hash, created_at) VALUES (?, ?, ?, ?, ?)",
                            (run_id, node_id, name, token_hash, time.time()))
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            self._nodes_by_token[token_hash] = NodeRecord(run_id, node_id, name)
        return node_id

    def node_by_token_hash(self, token_hash: str) -> Optional[NodeRecord]:
        """The node holding this token, from memory: every request authenticates, and on the event loop,
        where waiting for the store's lock behind a commit's fsync would stall every request. The map is
        loaded when the store opens and extended by :meth:`add_node` (one server owns a data directory;
        a node's row is never changed or deleted)."""
        return self._nodes_by_token.get(token_hash)

    def node_count(self, run_id: str) -> int:
        return self._one("SELECT COUNT(*) FROM nodes WHERE run_id = ?", (run_id,))[0]

    # -- submissions ------------------------------------------------------------------------------

    _SUB_COLS = "run_id, node_id, round, target_round, sha256, nbytes, weight, norm, received_at"

    def get_submission(self, run_id: str, node_id: int, round: int) -> Optional[SubmissionRecord]:
        row = self._one(f"SELECT {self._SUB_COLS} FROM submissions WHERE run_id = ? AND node_id = ? AND round = ?",
                        (run_id, node_id, round))
        return None if row is None else SubmissionRecord(*row)

    def write_submission(self, run_id: str, round: int, node_id: int, sha256: str, frame: bytes | memoryview) -> None:
        """Write an update's frame and fsync it (the first half of recording it; no row yet). Its name
        becomes durable in :meth:`commit_submissions`, with one directory fsync for a whole group."""
        atomic_write(self.submission_path(run_id, round, node_id, sha256), frame, sync_dir=False)

    def commit_submissions(self, recs: Sequence[SubmissionRecord]) -> None:
        """The second half, for a group of updates at once (group commit): one fsync of each directory
        their frames were written to, then all their rows in one transaction. Only after it may the server
        answer 202 to any of them; a crash before the commit leaves none of them recorded."""
        for directory in sorted({self.submission_path(r.run_id, r.round, r.node_id, r.sha256).parent for r in recs}):
            _fsync_dir(directory)
        self._tx([(f"INSERT INTO submissions ({self._SUB_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (rec.run_id, rec.node_id, rec.round, rec.target_round, rec.sha256, rec.nbytes, rec.weight,
                    rec.norm, rec.received_at)) for rec in recs])

    def submissions_for(self, run_id: str, target_round: int) -> list[SubmissionRecord]:
        """The updates counted in round ``target_round``, sorted by (node id, round): the order they are
        aggregated in."""
        rows = self._all(f"SELECT {self._SUB_COLS} FROM submissions WHERE run_id = ? AND target_round = ? "
                         "ORDER BY node_id, round", (run_id, target_round))
        return [SubmissionRecord(*r) for r in rows]

    def submissions_between(self, run_id: str, first: int, end: int) -> list[SubmissionRecord]:
        """The updates counted in rounds ``first ≤ target_round < end``."""
        rows = self._all(f"SELECT {self._SUB_COLS} FROM submissions WHERE run_id = ? AND target_round >= ? "
                         "AND target_round < ?", (run_id, first, end))
        return [SubmissionRecord(*r) for r in rows]

    def read_submission(self, rec: SubmissionRecord) -> bytes:
        return self.submission_path(rec.run_id, rec.round, rec.node_id, rec.sha256).read_bytes()

    def live_nodes(self, window: int) -> int:
        """Distinct nodes, over all runs, with an update counted in one of the last ``window`` rounds."""
        return self._one(
            "SELECT COUNT(*) FROM (SELECT DISTINCT s.run_id, s.node_id FROM submissions s "
            "JOIN runs r ON r.run_id = s.run_id WHERE s.target_round > r.version - ?)", (window,))[0]

    # -- versions ---------------------------------------------------------------------------------

    def publish(
        self,
        run_id: str,
        version: int,
        frame: bytes,
        weights_hash: str,
        updates: int,
        opened_at: float,
        checkpoint: bool = False,
    ) -> None:
        """Durably publish ``version`` (the frame that produces it), then commit.

        With ``checkpoint`` the state files of ``version`` were written first (:meth:`write_checkpoint`) and
        the same commit makes them the run's checkpoint. The SQLite transaction at the end is the commit
        point: before it, recovery ignores (and removes) the new files; after it, the new version is the run's.
        """
        atomic_write(self.diff_path(run_id, version), frame)
        set_checkpoint = ", checkpoint_version = ?, checkpoint_hash = ?" if checkpoint else ""
        args = (version, weights_hash) if checkpoint else ()
        self._tx([
            (f"UPDATE runs SET version = ?, weights_hash = ?, round_opened_at = ?{set_checkpoint} "
             "WHERE run_id = ? AND version = ?", (version, weights_hash, opened_at, *args, run_id, version - 1)),
            ("INSERT INTO versions (run_id, version, weights_hash, frame_bytes, updates, published_at) "
             "VALUES (?, ?, ?, ?, ?, ?)", (run_id, version, weights_hash, len(frame), updates, time.time())),
        ], expect_one=True)

    def write_checkpoint(
        self,
        run_id: str,
        version: int,
        weights: Mapping[str, torch.Tensor],
        moments: Mapping[str, torch.Tensor],
        server_state: Mapping[str, Any],
    ) -> None:
        """Write the full state of ``version`` (files only: it counts once a commit names it, through
        :meth:`publish` or :meth:`record_checkpoint`)."""
        atomic_write(self._versioned(run_id, "weights", version), st_save(dict(weights)))
        if moments:
            atomic_write(self._versioned(run_id, "moments", version), st_save(dict(moments), {"step": str(version)}))
        atomic_write(self._versioned(run_id, "server_state", version), pack_state_dict(server_state))

    def record_checkpoint(self, run_id: str, version: int, weights_hash: str) -> None:
        """Make the state files of the committed ``version`` (:meth:`write_checkpoint`) the run's checkpoint."""
        self._tx([("UPDATE runs SET checkpoint_version = ?, checkpoint_hash = ? "
                   "WHERE run_id = ? AND version >= ? AND checkpoint_version < ?",
                   (version, weights_hash, run_id, version, version))], expect_one=True)

    def load_tensors(self, run_id: str, kind: str, version: int) -> Optional[dict[str, torch.Tensor]]:
        """``kind`` in weights/moments; ``None`` if that file does not exist."""
        path = self._versioned(run_id, kind, version)
        if not path.exists():
            return None
        return dict(st_load(path.read_bytes()))

    def load_server_state(self, run_id: str, version: int) -> dict[str, Any]:
        """The algorithm's server-side state at ``version`` (``{}`` if none was kept).

        Stores written before this state was kept hold only the downlink residuals (``residual/``):
        those come back as ``{"downlink": {name: tensor}}``, a form ``ErrorFeedback.load_state_dict``
        also accepts.
        """
        path = self._versioned(run_id, "server_state", version)
        if path.exists():
            return unpack_state_dict(path.read_bytes())
        legacy = self._versioned(run_id, "residual", version)
        return {"downlink": dict(st_load(legacy.read_bytes()))} if legacy.exists() else {}

    def read_diffs(self, run_id: str, first: int, last: int) -> bytes:
        """The frames publishing versions ``first..last`` concatenated (each self-delimiting)."""
        return b"".join(self.diff_path(run_id, v).read_bytes() for v in range(first, last + 1))

    def version_hash(self, run_id: str, version: int) -> str:
        """The weights hash a published ``version`` of the run led to."""
        row = self._one("SELECT weights_hash FROM versions WHERE run_id = ? AND version = ?", (run_id, version))
        if row is None:
            raise KeyError(f"run {run_id} has no version {version}")
        return row[0]

    def oldest_diff(self, run_id: str, version: int, keep: int) -> int:
        """The oldest version whose diff is retained when the run is at ``version``."""
        return max(1, version - keep + 1)

    # -- housekeeping -----------------------------------------------------------------------------

    def prune(self, run_id: str, version: int, keep_versions: int, checkpoint: int, submissions_from: int) -> None:
        """Remove what the committed ``version`` and its ``checkpoint`` no longer need: other states,
        diffs before both the checkpoint's successor and ``keep_versions``, uncommitted newer files and
        leftover temporaries; and submission frames not counted in a round from ``submissions_from`` on
        (closed rounds no replay needs, files written before a crash that never got their row).

        For recovery, when nothing else writes: a submission being recorded has its file before its row.
        """
        self.prune_versions(run_id, version, keep_versions, checkpoint)
        folder = self.run_dir(run_id) / "submissions"
        if folder.is_dir():
            kept = {(r.round, r.node_id, r.sha256[:32])
                    for r in self.submissions_between(run_id, submissions_from, version + 1)}
            for path in folder.iterdir():
                m = _SUBMISSION.match(path.name)
                if m is None or (int(m.group(1)), int(m.group(2)), m.group(3)) not in kept:
                    path.unlink(missing_ok=True)

    def prune_versions(self, run_id: str, version: int, keep_versions: int, checkpoint: int) -> None:
        """The state files and diffs of :meth:`prune` (safe while submissions are being recorded; not
        while a checkpoint is being written)."""
        root = self.run_dir(run_id)
        oldest_diff = min(self.oldest_diff(run_id, version, keep_versions), checkpoint + 1)
        for kind in ("weights", "moments", "server_state", "residual", "diffs"):
            folder = root / kind
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
                    continue
                m = _VERSIONED.match(path.name)
                if m is None:
                    continue
                v = int(m.group(1))
                stale = v > version or (v < oldest_diff if kind == "diffs" else v != checkpoint)
                if stale:
                    path.unlink(missing_ok=True)

    def drop_submissions(self, run_id: str, first: int, end: int) -> None:
        """Delete the frames of the updates counted in rounds ``first ≤ target_round < end`` (by their rows,
        so a submission being recorded, whose row is not committed yet, is never touched)."""
        for rec in self.submissions_between(run_id, first, end):
            self.submission_path(rec.run_id, rec.round, rec.node_id, rec.sha256).unlink(missing_ok=True)
