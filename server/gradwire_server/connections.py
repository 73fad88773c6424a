"""Bounded connections: a cap on open connections, deadlines for a request's headers and body, a stall
bound on responses, and a short linger after answering a request whose body was not read.

uvicorn alone closes only idle keep-alive connections (``timeout_keep_alive``): a client that sends its
headers or its body a byte at a time holds a socket, and a file descriptor, for as long as it likes, and
``limit_concurrency`` answers 503 to everyone once such sockets fill it. :func:`guarded_protocol` makes
uvicorn's httptools protocol with these additions, all on the event loop's timers (no thread, no polling):

- **Header deadline.** The request line and headers must be complete within ``header_timeout_s`` of the
  connection opening or of the previous response ending; else the connection is closed.
- **Body rate.** After a grace of ``body_timeout_s`` a request body must have arrived at an average of at
  least ``min_body_rate`` bytes/s (the time the server itself is not reading — flow control while the
  route is busy — does not count); else the connection is closed.
- **Response stall.** A client that reads nothing of a response for ``body_timeout_s`` is closed.
- **Connection cap.** Beyond ``max_connections`` the oldest connection that is waiting for its request
  headers (a slow client, an idle keep-alive one, or one lingering) is closed to make room; when none is,
  the one stalled longest in a request body is (whichever has been silent longer: a connection that
  waits for headers counts from when it began to wait, a body from its last byte; a body the server
  itself stopped reading is never chosen); when none is either, the new connection is closed. An upload
  in progress receives bytes every few milliseconds, so it is the last to be chosen. Sockets that never send a request,
  or send a header block and
  then stall in its body, cost at most ``max_connections`` descriptors, and never keep out a client that
  sends its request promptly: that one is always the newest.
- **Per-address cap.** Beyond ``max_connections_per_address`` connections from one client address, that
  address's own oldest connection waiting for headers or stalled in a body is closed, else the new one:
  one client cannot take the whole cap.
- **Answered before the body.** The routes check what needs no body first (the token, the run, the round,
  one upload per node); a response that starts while the request body is still coming says
  ``Connection: close``, and once it completes the write side is shut (so the client reads its answer,
  not a reset) and whatever the client still sends is discarded, unparsed and unbuffered, for at most
  ``LINGER_S`` before the connection closes.

Connections closed by these rules are counted by cause and logged as one summary line every
``_LOG_EVERY_S`` at most (a thousand slow sockets do not flood the log).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["CAUSES", "ConnectionGuard", "ConnectionLimits", "LINGER_S", "ensure_descriptors", "guarded_protocol"]

log = logging.getLogger("gradwire_server.connections")

#: How long a connection answered before its body was read keeps discarding what the client still sends.
LINGER_S = 2.0
#: Descriptors kept beside the connections: SQLite, the files of catch-ups and submissions, the pools.
FD_RESERVE = 256
_LOG_EVERY_S = 10.0
#: Why the server closed a connection (the ``cause`` label of ``gradwire_connections_closed_total``).
CAUSES = {
    "header_deadline": "headers not complete within header_timeout_s",
    "body_rate": "body slower than min_body_rate",
    "response_stall": "read nothing of a response for body_timeout_s",
    "evicted": "waiting for headers, closed to make room at max_connections",
    "refused": "refused at max_connections (none waiting for headers or stalled in a body)",
    "evicted_body": "stalled in a request body, closed to make room at max_connections",
    "per_address": "closed at max_connections_per_address",
    "answered_before_body": "answered before its body was read, linger over",
}


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds of :mod:`.connections`, from ``ServerSettings`` (same names)."""

    max_connections: int = 512
    header_timeout_s: float = 10.0
    body_timeout_s: float = 20.0
    min_body_rate: int = 16 << 10
    max_connections_per_address: int = 128  # 0: no per-address cap

    @classmethod
    def from_settings(cls, settings) -> ConnectionLimits:
        return cls(
            settings.max_connections,
            settings.header_timeout_s,
            settings.body_timeout_s,
            settings.min_body_rate,
            settings.max_connections_per_address,
        )


def ensure_descriptors(max_connections: int) -> tuple[int, int] | None:
    """Make sure the process may open ``max_connections`` sockets plus :data:`FD_RESERVE` descriptors.

    Raises the soft ``RLIMIT_NOFILE`` only when it is below that (never above the hard limit); returns
    ``(old, new)`` when it did, ``None`` when nothing was needed. ``ValueError`` when the hard limit is too
    low, naming both numbers.
    """
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(
            f"max_connections {max_connections} needs {need} file descriptors, but RLIMIT_NOFILE "
            f"allows {hard} (hard limit): lower --max-connections or raise the limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return soft, need


class _Phase(enum.Enum):
    HEADERS = "waiting for request headers"
    BODY = "receiving a request body"
    APP = "handling a request"
    LINGER = "discarding an unread body"


class ConnectionGuard:
    """What the connections of one server share: the open ones, which of them may be closed to make room
    (oldest first), and the counts of closes by cause."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.open: set[_GuardedProtocol] = set()
        # Insertion-ordered, with the loop time each began to wait: the first has waited longest.
        self._evictable: dict[_GuardedProtocol, float] = {}
        # Connections receiving a request body, with the time of their last byte: the one silent longest
        # first (each byte moves its connection to the end).
        self._bodies: dict[_GuardedProtocol, float] = {}
        self._by_address: dict[str, int] = {}
        self.closed: dict[str, int] = {}
        self._unlogged: dict[str, int] = {}
        self._flush: asyncio.TimerHandle | None = None
        #: Called with the cause of every close (the server's metrics).
        self.on_close: Callable[[str], None] = lambda cause: None

    def admit(self, conn: _GuardedProtocol) -> None:
        """A new connection: make room if a cap is reached (see the module's docstring)."""
        self.open.add(conn)
        self.evictable(conn)
        address, per_address = conn.address, self.limits.max_connections_per_address
        if address is not None:
            self._by_address[address] = self._by_address.get(address, 0) + 1
            conn.counted_address = address
            while per_address and self._by_address.get(address, 0) > per_address:
                victim = self._victim(conn, lambda c: c.counted_address == address)
                if victim is None:
                    conn.close("per_address")
                    return
                victim.close("per_address")
        while len(self.open) > self.limits.max_connections:
            victim = self._victim(conn)
            if victim is None:
                conn.close("refused")
                return
            victim.close("evicted" if victim in self._evictable else "evicted_body")

    def _victim(self, new: _GuardedProtocol, among=lambda c: True) -> _GuardedProtocol | None:
        """The connection to close to make room for ``new``: of the one waiting longest for headers and the
        one silent longest in a body, whichever has been silent longer; ``None`` when neither exists
        (``new`` itself never is one)."""
        waiting = next(((c, t) for c, t in self._evictable.items() if c is not new and among(c)), None)
        # Not a body the server itself stopped reading (flow control while the route is busy).
        body = next(((c, t) for c, t in self._bodies.items() if among(c) and not c.flow.read_paused), None)
        if waiting is None or body is None:
            return (waiting or body or (None,))[0]
        return waiting[0] if waiting[1] <= body[1] else body[0]

    def evictable(self, conn: _GuardedProtocol) -> None:
        self._bodies.pop(conn, None)
        self._evictable.pop(conn, None)
        self._evictable[conn] = conn.loop.time()

    def receiving(self, conn: _GuardedProtocol) -> None:
        """``conn`` is receiving a body and a byte just came (or the body began)."""
        self._evictable.pop(conn, None)
        self._bodies.pop(conn, None)
        self._bodies[conn] = conn.loop.time()

    def busy(self, conn: _GuardedProtocol) -> None:
        self._evictable.pop(conn, None)
        self._bodies.pop(conn, None)

    def forget(self, conn: _GuardedProtocol) -> None:
        if conn in self.open and conn.counted_address is not None:
            left = self._by_address.get(conn.counted_address, 1) - 1
            if left > 0:
                self._by_address[conn.counted_address] = left
            else:
                self._by_address.pop(conn.counted_address, None)
        self.open.discard(conn)
        self._evictable.pop(conn, None)
        self._bodies.pop(conn, None)

    def count(self, cause: str, loop: asyncio.AbstractEventLoop) -> None:
        self.closed[cause] = self.closed.get(cause, 0) + 1
        self._unlogged[cause] = self._unlogged.get(cause, 0) + 1
        self.on_close(cause)
        if self._flush is None:
            self._flush = loop.call_later(_LOG_EVERY_S, self._log)

    def _log(self) -> None:
        self._flush = None
        counts, self._unlogged = self._unlogged, {}
        log.warning(
            "closed %d connection(s) in the last %.0f s: %s (%d open)",
            sum(counts.values()),
            _LOG_EVERY_S,
            ", ".join(f"{n} {CAUSES[cause]}" for cause, n in sorted(counts.items())),
            len(self.open),
        )


class _ClockedFlowControl(FlowControl):
    """uvicorn's flow control, also timing how long reading was paused (the server not reading: not the
    client's fault, so not counted against its body rate)."""

    def __init__(self, transport: asyncio.Transport, clock: Callable[[], float]):
        super().__init__(transport)
        self._clock = clock
        self._paused_at = 0.0
        self._paused_s = 0.0

    def pause_reading(self) -> None:
        if not self.read_paused:
            self._paused_at = self._clock()
        super().pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self._paused_s += self._clock() - self._paused_at
        super().resume_reading()

    def paused_seconds(self) -> float:
        return self._paused_s + (self._clock() - self._paused_at if self.read_paused else 0.0)

    def restart_clock(self) -> None:
        self._paused_s = 0.0
        if self.read_paused:
            self._paused_at = self._clock()


def _expects_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            try:
                return int(value) > 0
            except ValueError:
                return True  # the parser refuses it; the deadline still applies meanwhile
    return False


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of :mod:`.connections`; made by :func:`guarded_protocol`."""

    guard: ConnectionGuard  # set on the subclass that guarded_protocol makes

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._phase = _Phase.HEADERS
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._body_started = 0.0
        self._body_bytes = 0
        self._answered_early = False  # this response said Connection: close (it began before the body was in)
        self.counted_address: str | None = None  # the client address the guard counts this connection under

    # -- the phases ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _ClockedFlowControl(transport, self.loop.time)
        peer = transport.get_extra_info("peername")
        self.address: str | None = peer[0] if isinstance(peer, (tuple, list)) and peer else None
        self._wait_for_headers()
        self.guard.admit(self)

    def _wait_for_headers(self) -> None:
        self._phase = _Phase.HEADERS
        self.guard.evictable(self)
        self._arm(self.guard.limits.header_timeout_s, self._headers_late)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.transport.is_closing() or self._phase is not _Phase.HEADERS:
            return
        self.guard.busy(self)
        if _expects_body(self.headers):
            self._phase = _Phase.BODY
            self._body_started, self._body_bytes = self.loop.time(), 0
            self.guard.receiving(self)
            self.flow.restart_clock()
            self._arm(self.guard.limits.body_timeout_s, self._check_body_rate)
            self._say_close_if_answered_early(self.cycle)
        else:
            self._phase = _Phase.APP
            self._disarm()

    def _say_close_if_answered_early(self, cycle) -> None:
        """A response that starts before the request body is in carries ``Connection: close``.

        The connection lingers after such an answer and drops what arrives (:meth:`_linger`), so a client
        that finished sending the body and reused the connection would lose its next request
        ("server disconnected"). ``cycle.keep_alive = False`` makes uvicorn write the header; it is set back
        once the head is written, because uvicorn would otherwise close at the response's end with the body
        unread, and the client would read a reset instead of the answer: the linger closes instead.
        """
        send = cycle.send

        async def send_saying_close(message) -> None:
            if message["type"] != "http.response.start" or self._phase is not _Phase.BODY:
                await send(message)
                return
            self._answered_early = True
            cycle.keep_alive = False
            try:
                await send(message)
            finally:
                cycle.keep_alive = True

        cycle.send = send_saying_close  # run_asgi reads cycle.send when its task starts, after this

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._phase is _Phase.BODY:
            self.guard.receiving(self)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._phase is _Phase.BODY:
            self._phase = _Phase.APP
            self.guard.busy(self)
            self._disarm()

    def on_response_complete(self) -> None:
        early = self._phase is _Phase.BODY or self._answered_early
        self._answered_early = False
        if early and not self.transport.is_closing():
            # Answered before the body was read: no keep-alive on a connection whose next bytes are body.
            self.server_state.total_requests += 1
            self._linger()
            return
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._wait_for_headers()

    def _linger(self) -> None:
        self._phase = _Phase.LINGER
        self.guard.evictable(self)
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()  # sent once the response is flushed
        self._arm(LINGER_S, lambda: self.close("answered_before_body"))

    def data_received(self, data: bytes) -> None:
        if self._phase is _Phase.LINGER:
            return  # the rest of a body nobody reads: dropped, never parsed or kept
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self.guard.forget(self)
        super().connection_lost(exc)

    # -- deadlines ----------------------------------------------------------------------------------

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self.close("header_deadline")

    def _check_body_rate(self) -> None:
        """Close if the body is behind ``min_body_rate``; else check again when it would be."""
        limits = self.guard.limits
        elapsed = self.loop.time() - self._body_started - self.flow.paused_seconds()
        allowed = limits.body_timeout_s + self._body_bytes / limits.min_body_rate
        if elapsed >= allowed and not self.flow.read_paused:
            self.close("body_rate")
            return
        self._arm(max(0.05, allowed - elapsed), self._check_body_rate)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.guard.limits.body_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        self.close("response_stall")

    def close(self, cause: str) -> None:
        """Close this connection now, counting ``cause`` (a key of :data:`CAUSES`)."""
        if self.transport is not None and not self.transport.is_closing():
            self.guard.count(cause, self.loop)
            self.transport.close()
        # Off the books now: connection_lost comes on a later turn of the loop.
        self.guard.forget(self)

    def shutdown(self) -> None:
        # uvicorn's graceful shutdown: a connection waiting for headers or lingering closes now.
        if self._phase in (_Phase.HEADERS, _Phase.LINGER) and not self.transport.is_closing():
            self.transport.close()
            return
        super().shutdown()


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """A uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) bounded by ``limits``; its connections
    share one :class:`ConnectionGuard`, reachable as the class's ``guard``."""
    return type("GuardedHttpToolsProtocol", (_GuardedProtocol,), {"guard": ConnectionGuard(limits)})
