"""Start the aggregation server on loopback in a subprocess: for the demo, the tests and the benches.

``LoopbackServer`` runs ``python -m gradwire_server`` on a free port of 127.0.0.1, waits (bounded, no
fixed sleeps) until ``/readyz`` answers 200, and stops it cleanly: SIGTERM, a bounded wait, then SIGKILL.
``kill()`` is a SIGKILL (a crash, for recovery tests); ``start()`` after ``kill()`` or ``stop()``, and
``restart()``, bring it back on the same port and data directory::

    with LoopbackServer(data_dir) as server:
        client = GradwireClient(server.url, server.admin_token)
        ...

Only the standard library is used here, so that importing the launcher costs nothing of the server's
own dependencies (FastAPI, torch): those load in the subprocess.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["LoopbackServer", "ServerStartError", "free_port"]

#: Tries with a fresh port when the one picked was taken between probing it and the server binding it.
_PORT_TRIES = 3


class ServerStartError(RuntimeError):
    """The server process exited, or was not ready in time, while starting."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackServer:
    """``python -m gradwire_server`` on 127.0.0.1 in a subprocess, as a context manager.

    ``data_dir``: the server's SQLite and safetensors files; ``None`` makes a temporary directory that is
    removed on ``close()``. ``admin_token``: the ``GRADWIRE_ADMIN_TOKEN`` it runs with (random if not
    given; read it back from ``.admin_token``). ``port``: fixed port, or ``None`` for a free one (picked
    once: ``restart()`` keeps it). ``env``: extra environment variables for the server (on top of this
    process's). ``extra_args``: more ``python -m gradwire_server`` flags. ``ready_timeout_s``: how long
    ``start()`` waits for ``/readyz``. ``stop_timeout_s``: how long a clean stop waits after SIGTERM
    before SIGKILL. The server's stdout and stderr go to ``log_path`` (default ``<data_dir>/server.log``).

    Entering the context starts the server (if not running) and leaving it calls ``close()``.
    """

    def __init__(
        self,
        data_dir: os.PathLike | str | None = None,
        *,
        admin_token: str | None = None,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = 60.0,
        stop_timeout_s: float = 30.0,
        log_path: os.PathLike | str | None = None,
        python: str = sys.executable,
    ):
        self._tmp: tempfile.TemporaryDirectory | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="gradwire-server-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir)
        self.admin_token = admin_token or secrets.token_urlsafe(24)
        self._port_given = port is not None
        self.port = port if port is not None else free_port()
        self.env = dict(env or {})
        self.extra_args = list(extra_args)
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_path = Path(log_path) if log_path is not None else self.data_dir / "server.log"
        self.python = python
        self.process: subprocess.Popen | None = None
        self._ever_ready = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> LoopbackServer:
        """Start the process (if not running) and wait until ``/readyz`` is 200; returns ``self``.

        Raises :class:`ServerStartError` (with the end of the server's log) if it exits or is not ready
        within ``ready_timeout_s``; the process is killed then.
        """
        if self.running:
            return self
        # A port picked here could be taken by someone else before the server binds it: on the first
        # start only, a server that exits at once is retried on a fresh port.
        tries = 1 if (self._port_given or self._ever_ready) else _PORT_TRIES
        for attempt in range(tries):
            self._spawn()
            try:
                self._wait_ready()
            except ServerStartError:
                exited = self.process is not None and self.process.poll() is not None
                self.kill()
                if exited and attempt + 1 < tries:
                    self.port = free_port()
                    continue
                raise
            except BaseException:
                self.kill()
                raise
            self._ever_ready = True
            return self
        raise AssertionError("unreachable")

    def _command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "gradwire_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            *self.extra_args,
        ]

    def _spawn(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "GRADWIRE_ADMIN_TOKEN": self.admin_token, **self.env}
        if env.get("PYTHONPATH"):
            # The server runs in its data directory: relative entries (PYTHONPATH=python:server from a
            # checkout) would otherwise silently import another, installed, copy of the code.
            env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self._command(),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(self.data_dir),
            )

    def _wait_ready(self) -> None:
        proc = self.process
        assert proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        # Loopback only: never through a proxy from the environment.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            if proc.poll() is not None:
                raise ServerStartError(f"gradwire server exited with {proc.returncode} while starting:\n{self.log()}")
            try:
                with opener.open(f"{self.url}/readyz", timeout=2.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(f"gradwire server not ready after {self.ready_timeout_s} s:\n{self.log()}")
            # Wait on the condition, not a fixed sleep: wake on the process exiting or 50 ms passing.
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: the server dies at once, as in a crash (its data directory stays)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self, timeout: float | None = None) -> int:
        """SIGTERM and wait for a graceful exit (SIGKILL after ``timeout``, default ``stop_timeout_s``).

        Returns the exit code (0 when it never ran).
        """
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.stop_timeout_s if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        return self.process.returncode

    def restart(self) -> LoopbackServer:
        """Stop (gracefully, if still running) and start again on the same port and data directory."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop cleanly and remove the data directory if this object made it. Safe to call twice."""
        try:
            self.stop()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- conveniences -----------------------------------------------------------------------------

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def log(self, limit: int = 20000) -> str:
        """The end of the server's combined stdout/stderr so far (for failure messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except FileNotFoundError:
            return ""

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<LoopbackServer {self.url} {state} data_dir={str(self.data_dir)!r}>"
