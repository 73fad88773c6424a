"""``python -m gradwire_server [--host H] [--port P] [--data-dir D] ... [--check]``: serve; the same options as
``gradwire serve`` (:mod:`gradwire_server.cli`: every setting, options over GRADWIRE_* variables)."""

from __future__ import annotations

from .cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
