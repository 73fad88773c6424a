"""The server's listening socket, bound before anything else is made.

:func:`~gradwire_server.serving.serve` binds the port first, then takes the data directory's lock, then builds
the app (which generates the admin token and opens the store): a port another process holds stops the server
at once with :class:`PortInUse`, one line, before the data directory or the token exist. uvicorn is then handed
this socket, so nothing can take the port between the check and the serving.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["ListenError", "PortInUse", "bind_listen_socket"]


class ListenError(OSError):
    """The server cannot listen on the address it was given."""


class PortInUse(ListenError):
    """Another process listens on the port already."""


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (``port`` 0: any free one), as uvicorn binds its own
    (``SO_REUSEADDR``, inheritable); :class:`PortInUse` or :class:`ListenError` naming the address if not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port}: the host does not resolve ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(
                f"port {port} on {host} is in use by another process (another server?): stop it, or give this "
                "server another --port"
            ) from None
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock
