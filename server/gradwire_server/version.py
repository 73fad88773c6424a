"""The installed gradwire-server's version (``0.0.0`` from a source tree without an install)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("gradwire-server")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"
