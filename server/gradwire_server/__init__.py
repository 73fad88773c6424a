"""gradwire-server: the aggregation server of gradwire (FastAPI on uvicorn).

Nodes submit compressed gradient bundles per round; the server validates them, aggregates them with a
robust rule in the codec's domain, applies AdamW to fp32 master weights and publishes the compressed
weight diff as the next version. See docs/API.md and docs/SERVER.md.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("gradwire-server")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = ["ServerSettings", "__version__", "create_app", "serve"]


def __getattr__(name):
    # Lazy so that `import gradwire_server` stays cheap (no FastAPI/torch until needed).
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "ServerSettings":
        from .settings import ServerSettings

        return ServerSettings
    raise AttributeError(name)


def serve(settings=None) -> None:
    """Run the server with uvicorn until SIGINT/SIGTERM (graceful shutdown)."""
    import uvicorn

    from .app import create_app
    from .logs import logging_config
    from .settings import ServerSettings

    settings = settings or ServerSettings()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=logging_config(settings.log_json, settings.log_level),
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=30,
    )
