"""``python -m gradwire_server [--host H] [--port P] [--data-dir D] ...``: serve (flags override GRADWIRE_* env)."""

from __future__ import annotations

import sys

from .memory import keep_freed_memory
from .openmp import prefer_passive_openmp


def main(argv: list[str] | None = None) -> None:
    prefer_passive_openmp()  # before torch loads (docs/SERVER.md, "Threads")
    keep_freed_memory()  # before threads start: one malloc arena (docs/SERVER.md, "Memory")
    from .dirlock import DataDirError, DataDirLocked
    from .serving import serve
    from .settings import ServerSettings

    args = sys.argv[1:] if argv is None else argv
    if any(a == "--admin-token" or a.startswith("--admin-token=") for a in args):
        # Any user of the machine reads another's command line (ps, /proc/<pid>/cmdline).
        print(
            "gradwire-server: warning: --admin-token shows in `ps` to every user of this machine; pass it in "
            "GRADWIRE_ADMIN_TOKEN or a file (--admin-token-file) instead",
            file=sys.stderr,
            flush=True,
        )
    try:
        serve(ServerSettings(_cli_parse_args=args))
    except DataDirError as exc:
        # One line, no traceback: another server holds the directory (1), or it is unusable (2).
        print(f"gradwire-server: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1 if isinstance(exc, DataDirLocked) else 2) from None


if __name__ == "__main__":
    main()
