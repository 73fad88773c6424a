"""The admin token where a server started with ``gradwire serve`` keeps it.

Without ``GRADWIRE_ADMIN_TOKEN`` (or ``--admin-token-file``) the server generates a token into
``<data_dir>/admin_token`` (mode 0600) on its first start. :func:`read_admin_token` reads it the way the server
chose it: the environment variable when it is set, else that file, so a script beside the server needs no
copying of tokens.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .errors import GradwireClientError

__all__ = ["AdminTokenError", "read_admin_token"]

#: The server's default data directory (``ServerSettings.data_dir``), relative to where it was started.
DEFAULT_DATA_DIR = "gradwire-data"


class AdminTokenError(GradwireClientError):
    """No admin token: ``GRADWIRE_ADMIN_TOKEN`` unset and no readable ``<data_dir>/admin_token``."""


def read_admin_token(data_dir: os.PathLike | str = DEFAULT_DATA_DIR, environ: Mapping[str, str] | None = None) -> str:
    """``GRADWIRE_ADMIN_TOKEN`` if it is set, else the first line of ``<data_dir>/admin_token``; an
    :class:`AdminTokenError` naming both places when neither holds one."""
    env = os.environ if environ is None else environ
    if env.get("GRADWIRE_ADMIN_TOKEN"):
        return env["GRADWIRE_ADMIN_TOKEN"]
    path = Path(data_dir) / "admin_token"
    try:
        lines = path.read_text().strip().splitlines()
    except OSError as exc:
        raise AdminTokenError(
            f"no admin token: GRADWIRE_ADMIN_TOKEN is not set and {path} cannot be read ({exc.strerror}); start "
            f"the server first (`gradwire serve --data-dir {data_dir}` writes it there), or export the token"
        ) from None
    if not lines or not lines[0].strip():
        raise AdminTokenError(f"no admin token: {path} is empty")
    return lines[0].strip()
