"""One server per data directory: an exclusive OS lock on ``<data_dir>/server.lock``.

Two servers on one directory each keep their own in-memory view of the runs over one SQLite file: they
publish conflicting versions and answer uniqueness errors. The lock is ``flock(2)`` on an open file, so the
kernel drops it when the process dies however it dies (``kill -9`` leaves no stale lock to clear by hand),
and a second open in the same process conflicts too (an ``flock`` belongs to the open file, not the
process). The holder writes its pid into the file after locking, so the refusal can name it.

Inside one process the lock is counted: :func:`~gradwire_server.serving.serve` takes it before uvicorn
starts, so a second server fails at once with exit status 1, and the app's :class:`~.store.Store` takes
the same lock again when it opens (an app served by some other ASGI server is guarded too).
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path

__all__ = ["DataDirError", "DataDirLocked", "DataDirLock", "LOCK_NAME", "check_data_dir", "lock_holder"]

#: The lock file inside the data directory.
LOCK_NAME = "server.lock"


class DataDirError(OSError):
    """The data directory cannot be used: not creatable, not a directory, or not writable."""


class DataDirLocked(DataDirError):
    """Another live process serves this data directory."""

    def __init__(self, data_dir: Path, pid: int | None):
        self.data_dir = data_dir
        self.pid = pid
        holder = f"process {pid}" if pid is not None else "another process"
        super().__init__(
            f"data directory {str(data_dir)!r} is in use by {holder} (one server per data "
            f"directory: stop it, or give this server another --data-dir)"
        )


_held: dict[Path, tuple[int, int]] = {}  # resolved data dir -> (fd, count)
_held_lock = threading.Lock()


def _key(data_dir: os.PathLike | str) -> Path:
    return Path(data_dir).resolve()


def check_data_dir(data_dir: os.PathLike | str) -> Path:
    """Create ``data_dir`` if it is missing and prove it writable; :class:`DataDirError` naming it if not."""
    path = Path(data_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DataDirError(f"data directory {str(path)!r} exists and is not a directory") from None
    except OSError as exc:
        raise DataDirError(f"data directory {str(path)!r} cannot be created: {exc.strerror}") from None
    if not path.is_dir():
        raise DataDirError(f"data directory {str(path)!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise DataDirError(f"data directory {str(path)!r} is not writable by this user (uid {os.getuid()})")
    return path


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def lock_holder(data_dir: os.PathLike | str) -> int | None:
    """The pid of the live process holding ``data_dir``'s lock (``-1`` when it holds it but wrote no pid),
    or ``None`` when the directory is free. Takes nothing: the probe's own lock is released at once.
    This process's own lock counts as free (it is this process)."""
    if _key(data_dir) in _held:
        return None
    path = Path(data_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                pid = _read_pid(fd)
                return pid if pid is not None else -1
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class DataDirLock:
    """Holds ``data_dir``'s lock from :meth:`acquire` until :meth:`release` (or the process's end)."""

    def __init__(self, data_dir: os.PathLike | str):
        self.data_dir = Path(data_dir)
        self._key: Path | None = None

    def acquire(self) -> DataDirLock:
        check_data_dir(self.data_dir)
        key = _key(self.data_dir)
        with _held_lock:
            if key in _held:
                fd, count = _held[key]
                _held[key] = (fd, count + 1)
                self._key = key
                return self
            try:
                fd = os.open(key / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise DataDirError(
                    f"data directory {str(self.data_dir)!r}: cannot open its lock file: {exc.strerror}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                pid = _read_pid(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise DataDirLocked(self.data_dir, pid) from None
                raise DataDirError(f"data directory {str(self.data_dir)!r}: cannot lock: {exc.strerror}") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _held[key] = (fd, 1)
            self._key = key
        return self

    def release(self) -> None:
        if self._key is None:
            return
        with _held_lock:
            fd, count = _held[self._key]
            if count > 1:
                _held[self._key] = (fd, count - 1)
            else:
                del _held[self._key]
                # The pid goes first, so a reader never names a process that no longer holds the lock.
                try:
                    os.ftruncate(fd, 0)
                finally:
                    os.close(fd)
        self._key = None

    def __enter__(self) -> DataDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
