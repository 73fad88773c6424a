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
is committed; submissions arriving together share that directory fsync and that commit (group commit). Publishing a
version writes its frame (and, at a checkpoint written with it, the state
files) first and then commits one SQLite transaction that moves the run's version: that commit is the
only point at which a version exists, so a crash at any moment leaves either the old version (whose files
were never touched) or the new one. A checkpoint written after its version's commit counts once a second
commit records it; until then the previous one serves.

**A full or failing disk.** Every write is made inside :meth:`Store._writing`: an ``OSError`` or SQLite
error that says the storage is full (ENOSPC, EDQUOT, EFBIG, ``SQLITE_FULL``) or failing (EIO, EROFS,
``SQLITE_IOERR``, ``SQLITE_READONLY``, ``SQLITE_CANTOPEN``) becomes :class:`~.errors.StorageFailed` (507
or 503, nothing recorded), and the store remembers the cause (``write_failure``) until a write of a file
and a commit together succeeds (:meth:`Store.probe`, a publish): the cause is logged once when writes
start failing or fail differently, and once when they work again.
A transaction SQLite already rolled back by itself (it does on ``SQLITE_FULL``) is not rolled back a
second time, which would raise "cannot rollback - no transaction is active" in place of the real cause.

**Runs and nodes are removed** by the admin: a deleted run's rows go in one transaction, then its
directory (a directory without a row, left by a crash in between, is removed at the next start); a
deleted node keeps its row (its id is never given again: frames name their sender by it) without a
token. Tokens are kept only as SHA-256 hashes (a token is 32 random bytes: its hash reveals nothing
usable), in SQLite and in memory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from gradwire.state import pack_state_dict, unpack_state_dict

from .dirlock import DataDirLock
from .errors import Reason, Rejected, StorageFailed

__all__ = [
    "NodeRecord",
    "RunRecord",
    "ValidatorRecord",
    "Store",
    "StoredObject",
    "SubmissionRecord",
    "atomic_write",
    "storage_failure",
]

log = logging.getLogger("gradwire_server.store")

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
    checkpoint_hash TEXT,
    status          TEXT NOT NULL DEFAULT 'active',
    status_detail   TEXT
);
CREATE TABLE IF NOT EXISTS nodes (
    run_id      TEXT NOT NULL REFERENCES runs(run_id),
    node_id     INTEGER NOT NULL,
    name        TEXT,
    token_hash  TEXT UNIQUE,
    created_at  REAL NOT NULL,
    revoked_at  REAL,
    deleted_at  REAL,
    PRIMARY KEY (run_id, node_id)
);
CREATE TABLE IF NOT EXISTS write_probe (
    id   INTEGER PRIMARY KEY,
    pad  BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS server_secret (
    id  INTEGER PRIMARY KEY CHECK (id = 0),
    key BLOB NOT NULL
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
CREATE TABLE IF NOT EXISTS stored_objects (
    run_id   TEXT NOT NULL REFERENCES runs(run_id),
    version  INTEGER NOT NULL,
    kind     TEXT NOT NULL,
    key      TEXT NOT NULL,
    nbytes   INTEGER NOT NULL,
    sha256   TEXT NOT NULL,
    PRIMARY KEY (run_id, version, kind)
);
CREATE TABLE IF NOT EXISTS validators (
    run_id      TEXT NOT NULL REFERENCES runs(run_id),
    validator_id INTEGER NOT NULL,
    name        TEXT,
    token_hash  TEXT UNIQUE,
    created_at  REAL NOT NULL,
    PRIMARY KEY (run_id, validator_id)
);
CREATE TABLE IF NOT EXISTS round_scores (
    run_id       TEXT NOT NULL REFERENCES runs(run_id),
    round        INTEGER NOT NULL,
    validator_id INTEGER NOT NULL,
    node_id      INTEGER NOT NULL,
    score        REAL NOT NULL,
    PRIMARY KEY (run_id, round, validator_id, node_id)
);
CREATE TABLE IF NOT EXISTS version_weights (
    run_id   TEXT NOT NULL REFERENCES runs(run_id),
    version  INTEGER NOT NULL,
    node_id  INTEGER NOT NULL,
    weight   REAL NOT NULL,
    PRIMARY KEY (run_id, version, node_id)
);
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

#: errno values that mean "no room": the disk, a quota, a file size limit.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: errno values of storage that fails otherwise.
_FAILING_ERRNOS = frozenset({errno.EIO, errno.EROFS})
#: SQLite's primary result codes (the low byte of an extended code).
_SQLITE_FULL = 13
_SQLITE_FAILING = frozenset({8, 10, 14})  # SQLITE_READONLY, SQLITE_IOERR, SQLITE_CANTOPEN
#: The readiness probe writes (and fsyncs) this many bytes: room for at least a small write.
_PROBE_BYTES = 64 << 10


def storage_failure(exc: BaseException) -> bool | None:
    """``True`` if ``exc`` says the storage is full, ``False`` if it says the storage fails otherwise,
    ``None`` if it is not about the storage at all (a bug, a missing file)."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is None:
            return None
        if code & 0xFF == _SQLITE_FULL:
            return True
        return False if code & 0xFF in _SQLITE_FAILING else None
    if isinstance(exc, OSError):
        if exc.errno in _FULL_ERRNOS:
            return True
        if exc.errno in _FAILING_ERRNOS:
            return False
    return None


def _cause(exc: BaseException) -> str:
    """The failure in the operating system's or SQLite's words, without a file name: the same failure
    reads the same on every file, so a change of cause is a real change."""
    if isinstance(exc, sqlite3.Error):
        return f"{exc} ({getattr(exc, 'sqlite_errorname', 'SQLITE_ERROR')})"
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{exc.strerror or os.strerror(exc.errno)} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return str(exc)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _tree_bytes(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            total += _size(Path(folder) / name)
    return total


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
    weights_hash: str | None
    has_state: bool
    round_opened_at: float | None
    #: The last version whose full state is on disk, and its weights hash.
    checkpoint_version: int = 0
    checkpoint_hash: str | None = None
    #: ``active``, ``paused`` (by the admin) or ``failed`` (its round close kept failing), and why.
    status: str = "active"
    status_detail: str | None = None


@dataclass(frozen=True)
class NodeRecord:
    run_id: str
    node_id: int
    name: str | None
    created_at: float = 0.0
    #: When its token was revoked (``None``: the token works).
    revoked_at: float | None = None


@dataclass(frozen=True)
class ValidatorRecord:
    run_id: str
    validator_id: int
    name: str | None
    created_at: float = 0.0


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


@dataclass(frozen=True)
class StoredObject:
    """An object the server wrote to its object store (docs/SERVER.md, "Object storage"): ``kind``
    ``version`` (the bytes that publish ``version``), ``weights`` or ``algorithm`` (a checkpoint's weights,
    and the algorithm's node state, at ``version``). Its row is committed with what it belongs to (a
    version's in the version's own commit): only keys a commit names are ever handed to nodes."""

    run_id: str
    version: int
    kind: str
    key: str
    nbytes: int
    sha256: str


class Store:
    """SQLite plus files under ``data_dir``. Thread-safe: one connection behind a lock.

    ``max_stored_bytes``: a cap on the bytes of the runs' files and the database together (``None``: no
    cap); a write that would pass it is refused with 409 ``limit_reached``.
    """

    def __init__(self, data_dir: os.PathLike | str, max_stored_bytes: int | None = None):
        self.data_dir = Path(data_dir)
        # One server per directory (dirlock): a second store on a held directory raises DataDirLocked.
        self._dir_lock = DataDirLock(self.data_dir).acquire()
        self.max_stored_bytes = max_stored_bytes
        self._lock = threading.RLock()
        self._db_path = self.data_dir / "gradwire.sqlite3"
        self._db = sqlite3.connect(self._db_path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before it returns, which a 202 promises.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        #: The cause while writes fail (``None`` while they work): set by every write, and the probe.
        self.write_failure: str | None = None
        self._failure_lock = threading.Lock()
        with self._lock:
            self._db.executescript(_SCHEMA)
            self._migrate()
            # The server's own secret, made once per data directory (Store.sketch_key).
            self._db.execute("INSERT OR IGNORE INTO server_secret (id, key) VALUES (0, ?)", (os.urandom(32),))
            self._secret = bytes(self._db.execute("SELECT key FROM server_secret WHERE id = 0").fetchone()[0])
            rows = self._db.execute(
                "SELECT token_hash, run_id, node_id, name, created_at FROM nodes WHERE token_hash IS NOT NULL"
            ).fetchall()
        self._nodes_by_token: dict[str, NodeRecord] = {h: NodeRecord(*rest) for h, *rest in rows}
        self._token_of: dict[tuple[str, int], str] = {(n.run_id, n.node_id): h for h, n in self._nodes_by_token.items()}
        # Validators' tokens, from memory like the nodes' (validator_by_token_hash).
        vrows = self._all("SELECT token_hash, run_id, validator_id, name, created_at FROM validators")
        self._validators_by_token: dict[str, ValidatorRecord] = {h: ValidatorRecord(*rest) for h, *rest in vrows}
        # The runs' files, counted once here and then kept up to date by every write and removal.
        self._file_bytes = _tree_bytes(self.data_dir / "runs")
        self._bytes_lock = threading.Lock()

    def _migrate(self) -> None:
        """Bring a store written by an older server to this schema (in place, once)."""
        cols = {row[1] for row in self._db.execute("PRAGMA table_info(runs)")}
        if "checkpoint_version" not in cols:
            # Stores written before checkpoints held the full state of every version: their checkpoint is
            # their version.
            self._tx(
                [
                    ("ALTER TABLE runs ADD COLUMN checkpoint_version INTEGER NOT NULL DEFAULT 0", ()),
                    ("ALTER TABLE runs ADD COLUMN checkpoint_hash TEXT", ()),
                    ("UPDATE runs SET checkpoint_version = version, checkpoint_hash = weights_hash", ()),
                ]
            )
        if "status" not in cols:
            self._tx(
                [
                    ("ALTER TABLE runs ADD COLUMN status TEXT NOT NULL DEFAULT 'active'", ()),
                    ("ALTER TABLE runs ADD COLUMN status_detail TEXT", ()),
                ]
            )
        node_cols = {row[1] for row in self._db.execute("PRAGMA table_info(nodes)")}
        if "revoked_at" not in node_cols:
            # Revocation clears a node's token hash: the column loses NOT NULL, which SQLite changes only by
            # copying the table (the hashes are copied as they are: node tokens were always stored hashed).
            self._tx(
                [
                    (
                        "CREATE TABLE nodes_v2 (run_id TEXT NOT NULL REFERENCES runs(run_id), "
                        "node_id INTEGER NOT NULL, name TEXT, token_hash TEXT UNIQUE, created_at REAL NOT NULL, "
                        "revoked_at REAL, deleted_at REAL, PRIMARY KEY (run_id, node_id))",
                        (),
                    ),
                    (
                        "INSERT INTO nodes_v2 (run_id, node_id, name, token_hash, created_at) "
                        "SELECT run_id, node_id, name, token_hash, created_at FROM nodes",
                        (),
                    ),
                    ("DROP TABLE nodes", ()),
                    ("ALTER TABLE nodes_v2 RENAME TO nodes", ()),
                ]
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._dir_lock.release()

    # -- transactions and the storage's health ----------------------------------------------------

    def _transaction(self, body):
        """``body(cursor)`` in one transaction, committed if it returns, rolled back if it raises."""
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                out = body(cur)
                cur.execute("COMMIT")
            except BaseException:
                # SQLite rolls back by itself on some errors (SQLITE_FULL among them): a second ROLLBACK
                # would raise "no transaction is active" and hide the real cause.
                if self._db.in_transaction:
                    try:
                        cur.execute("ROLLBACK")
                    except sqlite3.Error as exc:
                        log.debug("rollback after a failed transaction also failed: %s", exc)
                raise
            return out

    def _tx(self, statements: Iterable[tuple], expect_one: bool = False) -> list[int]:
        """Run statements in one transaction; with ``expect_one`` each must change exactly one row."""
        statements = list(statements)

        def body(cur) -> list[int]:
            out = []
            for sql, args in statements:
                n = cur.execute(sql, args).rowcount
                if expect_one and n != 1:
                    raise RuntimeError(f"expected one row changed, got {n}: {sql.split()[0]} ...")
                out.append(n)
            return out

        return self._transaction(body)

    @contextlib.contextmanager
    def _writing(self, what: str, *, clears: bool = False):
        """Around every write: a full or failing storage becomes :class:`StorageFailed` (and is remembered);
        other errors pass unchanged. Only a write of both a file and a SQLite commit (``clears``: the probe,
        a publish, an initial state) clears a remembered failure when it succeeds: on a full disk a small
        commit may still fit in SQLite's free pages, or a small file in the last free blocks, and readiness
        must not flap with each."""
        try:
            yield
        except (OSError, sqlite3.Error) as exc:
            full = storage_failure(exc)
            if full is None:
                raise
            cause = _cause(exc)
            self._set_write_failure(cause, what)
            raise StorageFailed(full, what, cause) from exc
        if clears:
            self._set_write_failure(None, what)

    def writing(self, what: str):
        """:meth:`_writing` for a write made outside the store (a request body spooled into a run's folder)."""
        return self._writing(what)

    def _set_write_failure(self, cause: str | None, what: str) -> None:
        """One log line when writes start failing, fail another way, or work again; none otherwise."""
        with self._failure_lock:
            before, self.write_failure = self.write_failure, cause
        if cause is not None and before is None:
            log.error(
                "storage cannot write: %s (first seen writing %s); writes are answered 507/503 and /readyz "
                "is 503 until one succeeds",
                cause,
                what,
            )
        elif cause is not None and cause != before:
            log.error("storage still cannot write, now: %s (writing %s)", cause, what)
        elif cause is None and before is not None:
            log.warning("storage writes again (%s succeeded) after: %s", what, before)

    def probe(self) -> bool:
        """Whether the storage takes a small write now: a fsynced file of 64 KiB, and a SQLite commit that
        needs new pages (a row of 16 KiB, deleted in the same transaction) (the readiness check while writes
        fail). A success clears ``write_failure``."""
        try:
            with self._writing("the write probe", clears=True):
                path = self.data_dir / ".write-probe"
                try:
                    atomic_write(path, bytes(_PROBE_BYTES), sync_dir=False)
                finally:
                    path.unlink(missing_ok=True)
                self._tx(
                    [
                        ("INSERT INTO write_probe (pad) VALUES (zeroblob(?))", (16 << 10,)),
                        ("DELETE FROM write_probe", ()),
                    ]
                )
        except StorageFailed:
            return False
        return True

    # -- stored bytes -----------------------------------------------------------------------------

    def _write(self, path: Path, data: bytes | memoryview, *, sync_dir: bool = True) -> None:
        """:func:`atomic_write`, counted in the stored bytes."""
        old = _size(path)
        atomic_write(path, data, sync_dir=sync_dir)
        with self._bytes_lock:
            self._file_bytes += memoryview(data).nbytes - old

    def _remove(self, path: Path) -> None:
        size = _size(path)
        path.unlink(missing_ok=True)
        with self._bytes_lock:
            self._file_bytes -= size

    def stored_bytes(self) -> int:
        """The runs' files and the database (with its write-ahead log) on disk, in bytes."""
        db = sum(_size(self._db_path.with_name(self._db_path.name + suffix)) for suffix in ("", "-wal", "-shm"))
        return max(0, self._file_bytes) + db

    def check_room(self, nbytes: int, what: str) -> None:
        """Refuse (409 ``limit_reached``) a write of ``nbytes`` that would pass ``max_stored_bytes``."""
        cap = self.max_stored_bytes
        if cap is None:
            return
        stored = self.stored_bytes()
        if stored + nbytes > cap:
            raise Rejected(
                Reason.LIMIT_REACHED,
                f"{what} ({nbytes} bytes) would take the stored bytes from {stored} past the cap "
                f"max_stored_bytes={cap}: delete runs, or raise GRADWIRE_MAX_STORED_BYTES",
            )

    def sketch_key(self, run_id: str) -> bytes:
        """The key of ``run_id``'s direction-check sketches (:mod:`gradwire.sketch`): derived from this data
        directory's secret, which no node sees, so the same after every restart."""
        return hashlib.blake2b(run_id.encode(), key=self._secret, digest_size=16, person=b"gw-sketch").digest()

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

    def create_run(self, config: dict, max_runs: int | None = None) -> str:
        """A new run's row; 409 ``limit_reached`` when ``max_runs`` runs exist already."""
        self.check_room(0, "a new run")
        run_id = secrets.token_hex(8)

        def insert(cur) -> None:
            if max_runs is not None:
                (count,) = cur.execute("SELECT COUNT(*) FROM runs").fetchone()
                if count >= max_runs:
                    raise Rejected(
                        Reason.LIMIT_REACHED,
                        f"the server holds {count} runs, its cap max_runs={max_runs}: "
                        "delete a run, or raise GRADWIRE_MAX_RUNS",
                    )
            cur.execute(
                "INSERT INTO runs (run_id, config, created_at) VALUES (?, ?, ?)",
                (run_id, json.dumps(config), time.time()),
            )

        with self._writing("creating a run"):
            self._transaction(insert)
        return run_id

    _RUN_COLS = (
        "run_id, config, created_at, version, weights_hash, has_state, round_opened_at, "
        "checkpoint_version, checkpoint_hash, status, status_detail"
    )

    @staticmethod
    def _run(row) -> RunRecord:
        return RunRecord(
            row[0], json.loads(row[1]), row[2], row[3], row[4], bool(row[5]), row[6], row[7], row[8], row[9], row[10]
        )

    def get_run(self, run_id: str) -> RunRecord | None:
        row = self._one(f"SELECT {self._RUN_COLS} FROM runs WHERE run_id = ?", (run_id,))
        return None if row is None else self._run(row)

    def list_runs(self) -> list[RunRecord]:
        rows = self._all(f"SELECT {self._RUN_COLS} FROM runs ORDER BY created_at")
        return [self._run(r) for r in rows]

    def set_run_status(self, run_id: str, status: str, detail: str | None) -> None:
        """Record a run as ``active``, ``paused`` or ``failed`` (with why), so a restart keeps it so."""
        with self._writing(f"marking run {run_id} {status}"):
            self._tx([("UPDATE runs SET status = ?, status_detail = ? WHERE run_id = ?", (status, detail, run_id))])

    def delete_run(self, run_id: str) -> None:
        """Remove a run: its rows in one transaction (its nodes' tokens stop working with it), then its files."""
        with self._writing(f"deleting run {run_id}"):
            self._tx(
                [
                    (f"DELETE FROM {table} WHERE run_id = ?", (run_id,))
                    for table in (
                        "submissions",
                        "versions",
                        "stored_objects",
                        "nodes",
                        "validators",
                        "round_scores",
                        "version_weights",
                        "runs",
                    )
                ]
            )
        with self._lock:
            for key in [k for k in self._token_of if k[0] == run_id]:
                self._nodes_by_token.pop(self._token_of.pop(key), None)
            for h in [h for h, v in self._validators_by_token.items() if v.run_id == run_id]:
                del self._validators_by_token[h]
        self._remove_tree(self.run_dir(run_id))

    def remove_orphans(self) -> list[str]:
        """Remove run directories without a row (a crash between a deletion's commit and its files); returns
        their run ids."""
        root = self.data_dir / "runs"
        if not root.is_dir():
            return []
        known = {r[0] for r in self._all("SELECT run_id FROM runs")}
        orphans = [d.name for d in root.iterdir() if d.is_dir() and d.name not in known]
        for run_id in orphans:
            self._remove_tree(root / run_id)
        return orphans

    def _remove_tree(self, path: Path) -> None:
        size = _tree_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        with self._bytes_lock:
            self._file_bytes -= size - _tree_bytes(path)

    def set_initial_state(self, run_id: str, weights: Mapping[str, torch.Tensor], weights_hash: str) -> float:
        """Store version 0's weights (the first checkpoint); fails (returns nothing new) if any update was
        already recorded."""
        data = st_save(dict(weights))
        self.check_room(len(data), "the initial state")
        with self._writing(f"the initial state of run {run_id}", clears=True):
            self._write(self._versioned(run_id, "weights", 0), data)
            opened = time.time()
            self._tx(
                [
                    (
                        "UPDATE runs SET has_state = 1, weights_hash = ?, round_opened_at = ?, checkpoint_version = 0, "
                        "checkpoint_hash = ? WHERE run_id = ? AND version = 0",
                        (weights_hash, opened, weights_hash, run_id),
                    )
                ]
            )
        return opened

    def any_submission(self, run_id: str) -> bool:
        return self._one("SELECT 1 FROM submissions WHERE run_id = ? LIMIT 1", (run_id,)) is not None

    # -- nodes ------------------------------------------------------------------------------------

    def add_node(self, run_id: str, name: str | None, token_hash: str, max_nodes: int | None = None) -> int:
        """Register a node (the next id of the run: ids of deleted nodes are never given again); 409
        ``limit_reached`` when the run has ``max_nodes`` nodes already."""
        self.check_room(0, "a new node")
        now = time.time()

        def insert(cur) -> int:
            (last, live) = cur.execute(
                "SELECT COALESCE(MAX(node_id), 0), COUNT(*) - COUNT(deleted_at) FROM nodes WHERE run_id = ?", (run_id,)
            ).fetchone()
            if max_nodes is not None and live >= max_nodes:
                raise Rejected(
                    Reason.LIMIT_REACHED,
                    f"run {run_id} has {live} nodes, the cap max_nodes_per_run="
                    f"{max_nodes}: delete a node, or raise GRADWIRE_MAX_NODES_PER_RUN",
                )
            cur.execute(
                "INSERT INTO nodes (run_id, node_id, name, token_hash, created_at) VALUES (?, ?, ?, ?, ?)",
                (run_id, last + 1, name, token_hash, now),
            )
            return last + 1

        with self._lock:
            with self._writing(f"registering a node of run {run_id}"):
                node_id = self._transaction(insert)
            self._nodes_by_token[token_hash] = NodeRecord(run_id, node_id, name, now)
            self._token_of[(run_id, node_id)] = token_hash
        return node_id

    def node_by_token_hash(self, token_hash: str) -> NodeRecord | None:
        """The node holding this token, from memory: every request authenticates, and on the event loop,
        where waiting for the store's lock behind a commit's fsync would stall every request. The map is
        loaded when the store opens and changed with the rows (:meth:`add_node`, :meth:`set_node_token`,
        :meth:`delete_node`, :meth:`delete_run`): one server owns a data directory."""
        return self._nodes_by_token.get(token_hash)

    def set_node_token(self, run_id: str, node_id: int, token_hash: str | None) -> bool:
        """Give a node a new token (``token_hash``) or none (revoked): its old token stops working at once.
        ``False`` if the run has no such node (or it was deleted)."""
        revoked = time.time() if token_hash is None else None
        with self._lock:
            with self._writing(f"the token of node {node_id} of run {run_id}"):
                (n,) = self._tx(
                    [
                        (
                            "UPDATE nodes SET token_hash = ?, revoked_at = ? WHERE run_id = ? AND node_id = ? "
                            "AND deleted_at IS NULL",
                            (token_hash, revoked, run_id, node_id),
                        )
                    ]
                )
            if n != 1:
                return False
            old = self._token_of.pop((run_id, node_id), None)
            node = self._nodes_by_token.pop(old, None) if old is not None else None
            if token_hash is not None:
                name = (
                    node.name
                    if node is not None
                    else self._one("SELECT name FROM nodes WHERE run_id = ? AND node_id = ?", (run_id, node_id))[0]
                )
                self._nodes_by_token[token_hash] = NodeRecord(run_id, node_id, name)
                self._token_of[(run_id, node_id)] = token_hash
        return True

    def delete_node(self, run_id: str, node_id: int) -> bool:
        """Remove a node: no token, not counted or listed; its row stays so its id is never given again, and
        the updates it had acknowledged stay counted. ``False`` if there is no such node."""
        with self._lock:
            with self._writing(f"deleting node {node_id} of run {run_id}"):
                (n,) = self._tx(
                    [
                        (
                            "UPDATE nodes SET token_hash = NULL, deleted_at = ? WHERE run_id = ? AND node_id = ? "
                            "AND deleted_at IS NULL",
                            (time.time(), run_id, node_id),
                        )
                    ]
                )
            old = self._token_of.pop((run_id, node_id), None)
            if old is not None:
                self._nodes_by_token.pop(old, None)
        return n == 1

    def list_nodes(self, run_id: str) -> list[NodeRecord]:
        """The run's nodes (deleted ones left out), by id."""
        rows = self._all(
            "SELECT run_id, node_id, name, created_at, revoked_at FROM nodes WHERE run_id = ? "
            "AND deleted_at IS NULL ORDER BY node_id",
            (run_id,),
        )
        return [NodeRecord(*r) for r in rows]

    def node_count(self, run_id: str) -> int:
        return self._one("SELECT COUNT(*) FROM nodes WHERE run_id = ? AND deleted_at IS NULL", (run_id,))[0]

    # -- validators and their scores (docs/SERVER.md, "Validators") --------------------------------

    def add_validator(self, run_id: str, name: str | None, token_hash: str) -> int:
        """Register a validator of ``run_id`` (the next id of the run's validators)."""
        self.check_room(0, "a new validator")
        now = time.time()

        def insert(cur) -> int:
            (last,) = cur.execute(
                "SELECT COALESCE(MAX(validator_id), 0) FROM validators WHERE run_id = ?", (run_id,)
            ).fetchone()
            cur.execute(
                "INSERT INTO validators (run_id, validator_id, name, token_hash, created_at) VALUES (?, ?, ?, ?, ?)",
                (run_id, last + 1, name, token_hash, now),
            )
            return last + 1

        with self._lock:
            with self._writing(f"registering a validator of run {run_id}"):
                validator_id = self._transaction(insert)
            self._validators_by_token[token_hash] = ValidatorRecord(run_id, validator_id, name, now)
        return validator_id

    def validator_by_token_hash(self, token_hash: str) -> ValidatorRecord | None:
        """The validator holding this token, from memory (as :meth:`node_by_token_hash`)."""
        return self._validators_by_token.get(token_hash)

    def validators_of(self, run_id: str) -> list[ValidatorRecord]:
        """The run's validators, by id, from memory."""
        return sorted(
            (v for v in self._validators_by_token.values() if v.run_id == run_id), key=lambda v: v.validator_id
        )

    def record_scores(self, run_id: str, round: int, validator_id: int, scores: Mapping[int, float]) -> None:
        """Commit one validator's scores of round ``round`` (replacing any it posted before for it)."""
        with self._writing(f"recording the scores of validator {validator_id} for round {round} of run {run_id}"):
            self._tx(
                [
                    (
                        "DELETE FROM round_scores WHERE run_id = ? AND round = ? AND validator_id = ?",
                        (run_id, round, validator_id),
                    ),
                    *(
                        (
                            "INSERT INTO round_scores (run_id, round, validator_id, node_id, score) "
                            "VALUES (?, ?, ?, ?, ?)",
                            (run_id, round, validator_id, node_id, score),
                        )
                        for node_id, score in sorted(scores.items())
                    ),
                ]
            )

    def round_scores(self, run_id: str, first: int, last: int) -> dict[int, dict[int, dict[int, float]]]:
        """``{round: {validator_id: {node_id: score}}}`` for rounds ``first … last``."""
        out: dict[int, dict[int, dict[int, float]]] = {}
        for rnd, vid, node, score in self._all(
            "SELECT round, validator_id, node_id, score FROM round_scores WHERE run_id = ? AND round BETWEEN ? AND ? "
            "ORDER BY round, validator_id, node_id",
            (run_id, first, last),
        ):
            out.setdefault(rnd, {}).setdefault(vid, {})[node] = score
        return out

    def version_weights(self, run_id: str, first: int, last: int) -> dict[int, dict[int, float]]:
        """``{version: {node_id: weight}}``: the score weights of the scored rounds that published versions
        ``first … last`` (a version without an entry closed with the structural rule)."""
        out: dict[int, dict[int, float]] = {}
        for version, node, weight in self._all(
            "SELECT version, node_id, weight FROM version_weights WHERE run_id = ? AND version BETWEEN ? AND ? "
            "ORDER BY version, node_id",
            (run_id, first, last),
        ):
            out.setdefault(version, {})[node] = weight
        return out

    # -- submissions ------------------------------------------------------------------------------

    _SUB_COLS = "run_id, node_id, round, target_round, sha256, nbytes, weight, norm, received_at"

    def get_submission(self, run_id: str, node_id: int, round: int) -> SubmissionRecord | None:
        row = self._one(
            f"SELECT {self._SUB_COLS} FROM submissions WHERE run_id = ? AND node_id = ? AND round = ?",
            (run_id, node_id, round),
        )
        return None if row is None else SubmissionRecord(*row)

    def write_submission(self, run_id: str, round: int, node_id: int, sha256: str, frame: bytes | memoryview) -> None:
        """Write an update's frame and fsync it (the first half of recording it; no row yet). Its name
        becomes durable in :meth:`commit_submissions`, with one directory fsync for a whole group."""
        self.check_room(memoryview(frame).nbytes, "an update")
        with self._writing(f"an update of run {run_id}"):
            self._write(self.submission_path(run_id, round, node_id, sha256), frame, sync_dir=False)

    def commit_submissions(self, recs: Sequence[SubmissionRecord]) -> None:
        """The second half, for a group of updates at once (group commit): one fsync of each directory
        their frames were written to, then all their rows in one transaction. Only after it may the server
        answer 202 to any of them; a crash before the commit leaves none of them recorded."""
        with self._writing("recording updates"):
            for directory in sorted(
                {self.submission_path(r.run_id, r.round, r.node_id, r.sha256).parent for r in recs}
            ):
                _fsync_dir(directory)
            self._tx(
                [
                    (
                        f"INSERT INTO submissions ({self._SUB_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            rec.run_id,
                            rec.node_id,
                            rec.round,
                            rec.target_round,
                            rec.sha256,
                            rec.nbytes,
                            rec.weight,
                            rec.norm,
                            rec.received_at,
                        ),
                    )
                    for rec in recs
                ]
            )

    def discard_submissions(self, recs: Sequence[SubmissionRecord]) -> None:
        """Remove the frames of updates whose commit failed (they have no row; a restart would prune them)."""
        for rec in recs:
            self._remove(self.submission_path(rec.run_id, rec.round, rec.node_id, rec.sha256))

    def submissions_for(self, run_id: str, target_round: int) -> list[SubmissionRecord]:
        """The updates counted in round ``target_round``, in the order they were committed (their rows'):
        the order the round's close summed them in (``gradwire_server.round_sum``)."""
        rows = self._all(
            f"SELECT {self._SUB_COLS} FROM submissions WHERE run_id = ? AND target_round = ? ORDER BY rowid",
            (run_id, target_round),
        )
        return [SubmissionRecord(*r) for r in rows]

    def submissions_between(self, run_id: str, first: int, end: int) -> list[SubmissionRecord]:
        """The updates counted in rounds ``first ≤ target_round < end``."""
        rows = self._all(
            f"SELECT {self._SUB_COLS} FROM submissions WHERE run_id = ? AND target_round >= ? AND target_round < ?",
            (run_id, first, end),
        )
        return [SubmissionRecord(*r) for r in rows]

    def read_submission(self, rec: SubmissionRecord) -> bytes:
        return self.submission_path(rec.run_id, rec.round, rec.node_id, rec.sha256).read_bytes()

    def live_nodes(self, window: int) -> int:
        """Distinct nodes, over all runs, with an update counted in one of the last ``window`` rounds."""
        return self._one(
            "SELECT COUNT(*) FROM (SELECT DISTINCT s.run_id, s.node_id FROM submissions s "
            "JOIN runs r ON r.run_id = s.run_id WHERE s.target_round > r.version - ?)",
            (window,),
        )[0]

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
        objects: Sequence[StoredObject] = (),
        score_weights: Mapping[int, float] | None = None,
    ) -> None:
        """Durably publish ``version`` (the frame that produces it), then commit.

        ``objects``: what was written to the object store for this version (already there); their rows are
        part of the same commit. ``score_weights``: the validators' weight of each node in a scored round
        (:mod:`.scores`), committed with the version, so a restart replays the round with them.

        With ``checkpoint`` the state files of ``version`` were written first (:meth:`write_checkpoint`) and
        the same commit makes them the run's checkpoint. The SQLite transaction at the end is the commit
        point: before it, recovery ignores (and removes) the new files; after it, the new version is the run's.
        """
        set_checkpoint = ", checkpoint_version = ?, checkpoint_hash = ?" if checkpoint else ""
        args = (version, weights_hash) if checkpoint else ()
        with self._writing(f"publishing version {version} of run {run_id}", clears=True):
            self._write(self.diff_path(run_id, version), frame)
            self._tx(
                [
                    (
                        f"UPDATE runs SET version = ?, weights_hash = ?, round_opened_at = ?{set_checkpoint} "
                        "WHERE run_id = ? AND version = ?",
                        (version, weights_hash, opened_at, *args, run_id, version - 1),
                    ),
                    (
                        "INSERT INTO versions (run_id, version, weights_hash, frame_bytes, updates, published_at) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (run_id, version, weights_hash, len(frame), updates, time.time()),
                    ),
                    *(self._object_row(o) for o in objects),
                    *(
                        (
                            "INSERT INTO version_weights (run_id, version, node_id, weight) VALUES (?, ?, ?, ?)",
                            (run_id, version, node_id, weight),
                        )
                        for node_id, weight in sorted((score_weights or {}).items())
                    ),
                ],
                expect_one=True,
            )

    # -- the object store's rows ------------------------------------------------------------------

    @staticmethod
    def _object_row(o: StoredObject) -> tuple:
        return (
            "INSERT OR REPLACE INTO stored_objects (run_id, version, kind, key, nbytes, sha256) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (o.run_id, o.version, o.kind, o.key, o.nbytes, o.sha256),
        )

    def record_objects(self, objects: Sequence[StoredObject]) -> None:
        """Commit the rows of objects written to the object store (a checkpoint's)."""
        with self._writing("recording objects written to the object store"):
            self._tx([self._object_row(o) for o in objects])

    def stored_objects(self, run_id: str, kind: str, first: int, last: int) -> list[StoredObject]:
        """The run's committed objects of ``kind`` for versions ``first..last``, by version."""
        rows = self._all(
            "SELECT run_id, version, kind, key, nbytes, sha256 FROM stored_objects WHERE run_id = ? AND kind = ? "
            "AND version >= ? AND version <= ? ORDER BY version",
            (run_id, kind, first, last),
        )
        return [StoredObject(*r) for r in rows]

    def store_checkpoint(self, run_id: str, at_most: int) -> int | None:
        """The last version ≤ ``at_most`` whose weights are in the object store, or ``None``."""
        row = self._one(
            "SELECT MAX(version) FROM stored_objects WHERE run_id = ? AND kind = 'weights' AND version <= ?",
            (run_id, at_most),
        )
        return None if row is None or row[0] is None else int(row[0])

    def prune_objects(self, run_id: str, before: int) -> list[str]:
        """Delete the rows of the run's objects of versions before ``before`` (the caller keeps the versions
        since its store checkpoint); returns their keys, for the caller to delete from the bucket."""
        rows = self._all("SELECT key FROM stored_objects WHERE run_id = ? AND version < ?", (run_id, before))
        if rows:
            with self._writing(f"pruning object rows of run {run_id}"):
                self._tx([("DELETE FROM stored_objects WHERE run_id = ? AND version < ?", (run_id, before))])
        return [r[0] for r in rows]

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
        with self._writing(f"the checkpoint of version {version} of run {run_id}"):
            self._write(self._versioned(run_id, "weights", version), st_save(dict(weights)))
            if moments:
                self._write(self._versioned(run_id, "moments", version), st_save(dict(moments), {"step": str(version)}))
            self._write(self._versioned(run_id, "server_state", version), pack_state_dict(server_state))

    def record_checkpoint(self, run_id: str, version: int, weights_hash: str) -> None:
        """Make the state files of the committed ``version`` (:meth:`write_checkpoint`) the run's checkpoint."""
        with self._writing(f"recording the checkpoint of version {version} of run {run_id}"):
            self._tx(
                [
                    (
                        "UPDATE runs SET checkpoint_version = ?, checkpoint_hash = ? "
                        "WHERE run_id = ? AND version >= ? AND checkpoint_version < ?",
                        (version, weights_hash, run_id, version, version),
                    )
                ],
                expect_one=True,
            )

    def load_tensors(self, run_id: str, kind: str, version: int) -> dict[str, torch.Tensor] | None:
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

    def version_hashes(self, run_id: str, first: int, last: int) -> dict[int, str]:
        """``{version: weights hash}`` of the run's published versions ``first..last`` still recorded."""
        rows = self._all(
            "SELECT version, weights_hash FROM versions WHERE run_id = ? AND version >= ? AND version <= ?",
            (run_id, first, last),
        )
        return {int(v): h for v, h in rows}

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
            kept = {
                (r.round, r.node_id, r.sha256[:32])
                for r in self.submissions_between(run_id, submissions_from, version + 1)
            }
            for path in folder.iterdir():
                m = _SUBMISSION.match(path.name)
                if m is None or (int(m.group(1)), int(m.group(2)), m.group(3)) not in kept:
                    self._remove(path)

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
                    self._remove(path)
                    continue
                m = _VERSIONED.match(path.name)
                if m is None:
                    continue
                v = int(m.group(1))
                stale = v > version or (v < oldest_diff if kind == "diffs" else v != checkpoint)
                if stale:
                    self._remove(path)

    def prune_rows(self, run_id: str, rounds_before: int, versions_before: int) -> None:
        """Delete the rows of updates counted in rounds before ``rounds_before`` and of versions before
        ``versions_before``: without this the database grows by a row per update and per version for as
        long as the run lives (about 3 KB a round at 16 nodes). What stays: every row a replay, a catch-up
        page's weights hash or a duplicate resubmission inside the retained window can still ask for."""
        with self._writing(f"pruning rows of run {run_id}"):
            self._tx(
                [
                    ("DELETE FROM submissions WHERE run_id = ? AND target_round < ?", (run_id, rounds_before)),
                    ("DELETE FROM versions WHERE run_id = ? AND version < ?", (run_id, versions_before)),
                ]
            )

    def drop_submissions(self, run_id: str, first: int, end: int) -> None:
        """Delete the frames of the updates counted in rounds ``first ≤ target_round < end`` (by their rows,
        so a submission being recorded, whose row is not committed yet, is never touched)."""
        for rec in self.submissions_between(run_id, first, end):
            self._remove(self.submission_path(rec.run_id, rec.round, rec.node_id, rec.sha256))
