"""``python -m gradwire_server [--host H] [--port P] [--data-dir D] ...``: serve (flags override GRADWIRE_* env)."""

from __future__ import annotations

import sys

from .openmp import prefer_passive_openmp


def main(argv: list[str] | None = None) -> None:
    prefer_passive_openmp()  # before torch loads (docs/SERVER.md, "Threads")
    from .serving import serve
    from .settings import ServerSettings

    settings = ServerSettings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    serve(settings)


if __name__ == "__main__":
    main()
