"""gradwire-server: the aggregation server of gradwire (FastAPI on uvicorn).

Nodes submit compressed gradient bundles per round; the server validates them, aggregates them with a
robust rule in the codec's domain, applies AdamW to fp32 master weights and publishes the compressed
weight diff as the next version. See docs/API.md and docs/SERVER.md.
"""

from __future__ import annotations

from .version import __version__

__all__ = ["ServerSettings", "__version__", "create_app", "serve"]


def __getattr__(name):
    # Lazy so that `import gradwire_server` stays cheap (no FastAPI/uvicorn/torch until needed).
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "ServerSettings":
        from .settings import ServerSettings

        return ServerSettings
    if name == "serve":
        from .serving import serve

        return serve
    raise AttributeError(name)
