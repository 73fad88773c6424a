"""``python -m gradwire_server [--host H] [--port P] [--data-dir D] ...``: serve (flags override GRADWIRE_* env)."""

from __future__ import annotations

import sys

from .serving import serve
from .settings import ServerSettings


def main(argv: list[str] | None = None) -> None:
    settings = ServerSettings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    serve(settings)


if __name__ == "__main__":
    main()
