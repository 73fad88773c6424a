"""The FastAPI application: wiring of store, metrics, round engine and routers; startup and shutdown.

Lifespan: open the store, recover every run (last committed version plus the acknowledged updates of
its open round), start the round drivers, then ``/readyz`` turns 200. On shutdown (uvicorn handles
SIGTERM) the drivers stop after any round close in flight, and the store closes cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from pathlib import Path

from fastapi import FastAPI

from .auth import hash_token
from .http_errors import install_error_handlers
from .metrics import Metrics
from .object_store import ObjectStore, ObjectStoreUnavailable
from .rounds import RoundEngine
from .routes import health, nodes, objects, runs, state, updates, validators
from .settings import ServerSettings
from .store import Store
from .token_gate import TokenGate
from .traffic import TrafficCounter
from .version import __version__

__all__ = ["ServerContext", "create_app"]

log = logging.getLogger("gradwire_server")

#: While the store's writes fail, readiness probes it at most this often.
_PROBE_EVERY_S = 1.0


def _read_token_file(path: Path) -> str:
    """The admin token from the first line of ``path`` (a mounted secret, say)."""
    try:
        lines = path.read_text().strip().splitlines()
    except OSError as exc:
        raise ValueError(f"admin_token_file {path}: {exc.strerror or exc}") from None
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"admin_token_file {path} is empty")
    mode = path.stat().st_mode
    if mode & 0o077:
        log.warning("admin_token_file %s is readable by other users (mode %o); chmod 600 it", path, mode & 0o777)
    return token


class ServerContext:
    """What every request handler reaches through ``request.app.state.server``."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.ready = False
        self.store: Store | None = None
        self.objects: ObjectStore | None = None
        self.engine: RoundEngine | None = None
        self.metrics = Metrics(
            live_nodes=self._live_nodes,
            run_ids=settings.metrics_run_ids,
            store_writable=lambda: float(self.store is None or self.store.write_failure is None),
            stored_bytes=lambda: float(0 if self.store is None else self.store.stored_bytes()),
            run_statuses=lambda: [] if self.engine is None else self.engine.statuses(),
        )
        #: Only the admin token's hash is kept (auth compares hashes).
        self.admin_token_hash = hash_token(self._admin_token())
        self._probe_lock = asyncio.Lock()
        self._probed_at = 0.0

    async def store_writable(self) -> bool:
        """Whether the store writes: at once while its writes work; after one failed, a small probe write
        (at most one a second, whatever the number of callers), whose success wakes the round closes
        waiting for a retry."""
        store = self.store
        if store is None or store.write_failure is None:
            return store is not None
        async with self._probe_lock:
            if store.write_failure is not None and time.monotonic() - self._probed_at >= _PROBE_EVERY_S:
                self._probed_at = time.monotonic()
                if await asyncio.to_thread(store.probe) and self.engine is not None:
                    self.engine.wake_all()
        return store.write_failure is None

    def _admin_token(self) -> str:
        if self.settings.admin_token is not None:
            return self.settings.admin_token.get_secret_value()
        if self.settings.admin_token_file is not None:
            return _read_token_file(Path(self.settings.admin_token_file))
        path = Path(self.settings.data_dir) / "admin_token"
        if path.exists():
            return path.read_text().strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        log.warning("no admin token configured; generated one into %s", path)
        return token

    def begin_shutdown(self) -> None:
        """SIGTERM arrived (called by :mod:`.serving` before uvicorn waits for requests in flight): not ready
        any more, and every long poll answers now rather than at the end of its wait."""
        self.ready = False
        if self.engine is not None:
            self.engine.release_waiters()

    def _live_nodes(self) -> float:
        if self.store is None or not self.ready:
            return 0.0
        return float(self.store.live_nodes(self.settings.live_window_rounds))


def _object_store(settings: ServerSettings, metrics: Metrics) -> ObjectStore | None:
    """The object store of ``settings.object_store`` (None without one), its bytes and requests counted.
    A wrong bucket or credentials stop the start with a clear error; a store that cannot be reached yet
    does not (rounds wait for it)."""
    if settings.object_store is None:
        return None
    objects = ObjectStore(
        settings.object_store,
        public_url=settings.object_store_public_url,
        url_expiry_s=settings.object_store_url_expiry_s,
        timeout_s=settings.object_store_timeout_s,
        count=lambda direction, n: metrics.object_store_bytes.labels(direction=direction).inc(n),
        request=lambda op, ok: metrics.object_store_requests.labels(op=op, outcome="ok" if ok else "failed").inc(),
    )
    try:
        objects.check()
    except ObjectStoreUnavailable as exc:
        log.error("%s; starting anyway: uploads and round closes wait until it answers", exc.detail)
    return objects


def create_app(settings: ServerSettings | None = None) -> FastAPI:
    """The gradwire aggregation server as an ASGI app (serve it with uvicorn)."""
    settings = settings or ServerSettings()
    ctx = ServerContext(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.store = Store(settings.data_dir, max_stored_bytes=settings.max_stored_bytes)
        ctx.objects = await asyncio.to_thread(_object_store, settings, ctx.metrics)
        ctx.engine = RoundEngine(ctx.store, ctx.metrics, settings, ctx.objects)
        await ctx.engine.start()
        ctx.ready = True
        log.info(
            "gradwire server ready: data in %s%s, %d run(s)",
            settings.data_dir,
            "" if ctx.objects is None else f", frames and versions through the object store {ctx.objects.name}",
            len(ctx.engine.runs),
        )
        try:
            yield
        finally:
            ctx.ready = False
            await ctx.engine.stop()
            ctx.store.close()
            log.info("gradwire server stopped cleanly")

    app = FastAPI(
        title="gradwire aggregation server",
        version=__version__,
        summary="Compressed gradient submission, robust aggregation, AdamW on master weights, compressed updates back.",
        lifespan=lifespan,
    )
    app.state.server = ctx

    install_error_handlers(app, lambda reason, update: ctx.metrics.reject(reason, update=update))
    # A body with no valid token is refused before anything reads it; outside it, every byte is counted.
    app.add_middleware(TokenGate, server=ctx)
    app.add_middleware(TrafficCounter, metrics=ctx.metrics)

    # The submission route first: it is the one every node hits every round, and routes match in order.
    for module in (updates, objects, health, runs, nodes, state, validators):
        app.include_router(module.router)
    return app
