"""``python -m gradwire_server [--host H] [--port P] [--data-dir D] ...``: serve (flags override GRADWIRE_* env)."""

from __future__ import annotations

import sys

from .memory import keep_freed_memory
from .openmp import prefer_passive_openmp


def main(argv: list[str] | None = None) -> None:
    prefer_passive_openmp()  # before torch loads (docs/SERVER.md, "Threads")
    keep_freed_memory()  # before threads start: one malloc arena (docs/SERVER.md, "Memory")
    from .serving import serve
    from .settings import ServerSettings

    args = sys.argv[1:] if argv is None else argv
    if any(a == "--admin-token" or a.startswith("--admin-token=") for a in args):
        # Any user of the machine reads another's command line (ps, /proc/<pid>/cmdline).
        print("gradwire-server: warning: --admin-token shows in `ps` to every user of this machine; pass it in "
              "GRADWIRE_ADMIN_TOKEN or a file (--admin-token-file) instead", file=sys.stderr, flush=True)
    serve(ServerSettings(_cli_parse_args=args))


if __name__ == "__main__":
    main()
