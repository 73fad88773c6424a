"""A joining replica group's state, served by a healthy group over HTTP as gradwire's own state bytes.

torchft's ``HTTPTransport`` pickles the state dict it sends and ``torch.load``-s what it receives; nothing
gradwire receives is unpickled. :class:`StateBytesTransport` is a torchft ``CheckpointTransport`` (the same
four methods) that serves the state as :func:`gradwire.torch.state_bytes.state_to_bytes` writes it (one
safetensors file, its structure as JSON) and reads it back with :func:`~gradwire.torch.state_bytes.
state_from_bytes`: a download longer than ``max_state_bytes`` is refused before it is read, and bytes that are
no state raise :class:`~gradwire.torch.state_bytes.StateBytesError`.

The state is written when torchft asks for it (``send_checkpoint``: at the quorum that admits the joiner),
so the bytes served are the state of that moment whatever the healthy group does next; they are dropped at
``disallow_checkpoint`` (the healthy group's next ``should_commit``).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .state_bytes import StateBytesError, state_from_bytes, state_to_bytes

__all__ = ["StateBytesTransport", "StateDownloadError"]


class StateDownloadError(RuntimeError):
    """A joiner could not download a healthy group's state in time, or the download was too large."""


class StateBytesTransport:
    """Serves this group's state at ``http://host:port/state/<step>`` while a joiner needs it, and downloads
    another group's. ``max_state_bytes`` bounds what a download may be (``None``: four times this group's own
    state the first time it is written, else 1 GiB); ``state_download`` is the seconds a download may take."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_state_bytes: int | None = None,
        state_download: float = 20.0,
    ):
        self.max_state_bytes = max_state_bytes
        self.state_download = float(state_download)
        self.bytes_served = 0
        self.bytes_downloaded = 0
        self._lock = threading.Lock()
        self._served: tuple[int, bytes] | None = None
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                with transport._lock:
                    served = transport._served
                want = self.path.rsplit("/", 1)[-1]
                if served is None or not self.path.startswith("/state/") or want != str(served[0]):
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(served[1])))
                self.end_headers()
                self.wfile.write(served[1])
                transport.bytes_served += len(served[1])

            def log_message(self, format: str, *args: Any) -> None:  # quiet: torchft logs the recovery
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="gradwire-state", daemon=True)
        self._thread.start()
        self._host = host

    # -- torchft's CheckpointTransport ---------------------------------------------------------------

    def metadata(self) -> str:
        return f"http://{self._host}:{self._server.server_address[1]}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        data = state_to_bytes(state_dict)
        if self.max_state_bytes is None:
            self.max_state_bytes = 4 * len(data) + (1 << 20)
        with self._lock:
            self._served = (int(step), data)

    def disallow_checkpoint(self) -> None:
        with self._lock:
            self._served = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        data = self.download(metadata, step, min(timeout.total_seconds(), self.state_download))
        try:
            return state_from_bytes(data)
        except StateBytesError as exc:
            raise StateBytesError(f"the state {metadata} served for step {step} is refused: {exc}") from exc

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- the download -----------------------------------------------------------------------------------

    def download(self, address: str, step: int, seconds: float) -> bytes:
        """The bytes ``address`` serves for ``step``, retried until it serves them (the healthy group writes
        them in its own quorum thread) or ``seconds`` pass; :class:`StateDownloadError` then, or when the
        announced length is over ``max_state_bytes``."""
        if not address.startswith("http://"):
            raise StateDownloadError(f"a state address must be http://host:port, got {address!r}")
        limit = self.max_state_bytes if self.max_state_bytes is not None else 1 << 30
        deadline = time.monotonic() + seconds
        url = f"{address}/state/{int(step)}"
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=max(0.05, deadline - time.monotonic())) as reply:
                    length = int(reply.headers.get("Content-Length", "-1"))
                    if not 0 <= length <= limit:
                        raise StateDownloadError(
                            f"{url} announced a state of {length} bytes, outside 0..{limit} (max_state_bytes)"
                        )
                    data = reply.read(length)
                    if len(data) != length:
                        raise StateDownloadError(f"{url} sent {len(data)} of the {length} bytes it announced")
                    self.bytes_downloaded += len(data)
                    return data
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last = exc
                time.sleep(0.02)
        raise StateDownloadError(f"no state from {url} within {seconds:g} s (state_download): {last}")
