"""A real gradwire server in a subprocess on 127.0.0.1, for tests that speak HTTP to it.

``LiveServer(data_dir)`` starts ``python -m gradwire_server`` on a free loopback port and waits (bounded)
until ``/readyz`` answers 200. ``kill()`` is a SIGKILL (a crash), ``stop()`` a SIGTERM (graceful
shutdown), ``restart()`` starts it again on the same port and data directory. Use it as a context manager
or call ``close()``; the process never outlives the test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Optional

import httpx

REPO = Path(__file__).resolve().parent.parent
SERVER_SRC = REPO / "server"

__all__ = ["LiveServer", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``python -m gradwire_server`` on loopback, with a bounded wait for readiness."""

    def __init__(
        self,
        data_dir: os.PathLike | str,
        admin_token: str = "test-admin",
        port: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        ready_timeout: float = 60.0,
    ):
        self.data_dir = Path(data_dir)
        self.admin_token = admin_token
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout = ready_timeout
        self._extra_env = dict(env or {})
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = self.data_dir / "server.log"
        self.start()

    # -- lifecycle --------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        # The source tree's server package (pure Python) wins over an installed copy, so tests run what is
        # checked out; gradwire itself comes from the installed wheel, which holds the compiled kernels.
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SERVER_SRC)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        env["GRADWIRE_ADMIN_TOKEN"] = self.admin_token
        # No thread-count override needed: DCT decoding sums in a fixed order (gradwire.dct.decode_chunks),
        # so the server and the nodes decode published frames bit-identically whatever their threads.
        env.update(self._extra_env)
        return env

    def start(self) -> None:
        """Start the process (if not running) and wait until ``/readyz`` is 200."""
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gradwire_server", "--host", "127.0.0.1", "--port", str(self.port),
                 "--data-dir", str(self.data_dir)],
                env=self._env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(self.data_dir),
            )
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"gradwire server exited with {self.proc and self.proc.returncode}:\n{self.log()}")
                try:
                    if client.get(f"{self.url}/readyz").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gradwire server not ready after {self.ready_timeout}s:\n{self.log()}")
                # Poll the condition, not a fixed sleep: wake on the process exiting or 50 ms passing.
                try:
                    self.proc.wait(timeout=0.05)
                except subprocess.TimeoutExpired:
                    pass

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the server dies at once, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait for a graceful exit (SIGKILL after ``timeout``); returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode

    def restart(self) -> None:
        """Stop (gracefully if still running) and start again with the same port and data directory."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.kill()

    def __enter__(self) -> "LiveServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- conveniences -----------------------------------------------------------------------------

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def log(self) -> str:
        """The server's combined stdout/stderr so far (for failure messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except FileNotFoundError:
            return ""
