"""``serve``: the server under uvicorn until SIGINT/SIGTERM, with a graceful shutdown."""

from __future__ import annotations

from typing import Optional

import uvicorn

from .app import create_app
from .logs import logging_config
from .settings import ServerSettings

__all__ = ["serve"]


def serve(settings: Optional[ServerSettings] = None) -> None:
    """Run the server with uvicorn until SIGINT/SIGTERM (graceful shutdown)."""
    settings = settings or ServerSettings()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=logging_config(settings.log_json, settings.log_level),
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=30,
    )
