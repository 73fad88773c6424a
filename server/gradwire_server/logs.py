"""Logging set-up: plain text, or one JSON object per line (``log_json``) for log collectors."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

__all__ = ["JsonFormatter", "logging_config"]


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", ...}``; exceptions go in ``exc_info``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def logging_config(log_json: bool, level: str) -> dict:
    """A ``logging.config.dictConfig`` for the server and uvicorn (passed as uvicorn's ``log_config``)."""
    formatter = {"()": JsonFormatter} if log_json else {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    lvl = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
        },
        "loggers": {
            "gradwire_server": {"handlers": ["stderr"], "level": lvl, "propagate": False},
            "uvicorn": {"handlers": ["stderr"], "level": lvl, "propagate": False},
            "uvicorn.error": {"level": lvl},
            "uvicorn.access": {"handlers": ["stderr"], "level": lvl, "propagate": False},
        },
    }
