"""``serve``: the server under uvicorn until SIGINT/SIGTERM, with bounded connections and a bounded shutdown.

Connections are bounded by :mod:`.connections` (a cap, header and body deadlines). On SIGTERM uvicorn stops
accepting, closes idle connections and waits for requests in flight; the app is told first, so that long
polls on ``…/updates`` answer at once instead of holding the shutdown for up to a minute; requests still
running after ``shutdown_grace_s`` are cancelled; then the round drivers stop after any round close in
flight (docs/SERVER.md, "Connections and deadlines").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import uvicorn

from .app import create_app
from .connections import ConnectionLimits, ensure_descriptors, guarded_protocol
from .dirlock import DataDirLock
from .listen_socket import bind_listen_socket
from .logs import logging_config
from .settings import ServerSettings

__all__ = ["serve"]

log = logging.getLogger("gradwire_server")

#: uvicorn's own bound on an idle keep-alive connection between two requests.
KEEP_ALIVE_S = 5


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app that shutdown began before it waits for the requests in flight."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets=None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


def serve(settings: ServerSettings | None = None) -> None:
    """Run the server with uvicorn until SIGINT/SIGTERM (graceful shutdown within ``shutdown_grace_s``)."""
    settings = settings or ServerSettings()
    # The port first, then the data directory, then the app (the admin token, the store): a busy port, a
    # directory another server holds or an unusable one each stop the server here, at once and in one line,
    # before anything is created (listen_socket, dirlock). uvicorn serves on this very socket.
    sock = bind_listen_socket(settings.host, settings.port)
    try:
        dir_lock = DataDirLock(settings.data_dir).acquire()
    except BaseException:
        sock.close()
        raise
    try:
        log_config = logging_config(settings.log_json, settings.log_level)
        raised = ensure_descriptors(settings.max_connections)
        app = create_app(settings)
        protocol = guarded_protocol(ConnectionLimits.from_settings(settings))
        metrics = app.state.server.metrics
        protocol.guard.on_close = lambda cause: metrics.connections_closed.labels(cause=cause).inc()
        metrics.connections_open.set_function(lambda: float(len(protocol.guard.open)))
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=log_config,
            access_log=settings.log_level == "debug",
            http=protocol,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=settings.shutdown_grace_s,
        )
        if raised is not None:
            log.info(
                "raised the open-files limit (RLIMIT_NOFILE) from %d to %d for max_connections %d",
                raised[0],
                raised[1],
                settings.max_connections,
            )
        _Server(config, on_shutdown=app.state.server.begin_shutdown).run(sockets=[sock])
    finally:
        sock.close()
        dir_lock.release()
