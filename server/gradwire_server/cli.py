"""The server's command line, one surface for ``python -m gradwire_server``, ``gradwire-server`` and
``gradwire serve``: the same options, made from the fields of :class:`~gradwire_server.settings.ServerSettings`
(:func:`serve_options`), so every setting is an option and none can drift from the settings.

- Every field is ``--<field-name>`` and ``GRADWIRE_<NAME>``; an option given wins over the environment, which
  wins over the default. A boolean is a flag pair (``--log-json`` / ``--no-log-json``).
- Secrets (the admin token) are never options: a command line shows in ``ps`` to every user of the machine.
  ``--admin-token`` is a usage error that says to use ``GRADWIRE_ADMIN_TOKEN`` or ``--admin-token-file``.
  With neither, the server generates one into ``DATA_DIR/admin_token`` (mode 0600).
- ``--check`` prints the settings as JSON (secrets masked) and checks what serving would need first — the
  port free, the data directory usable and not held by a live server — without creating the token or the
  store, then exits.
- A setting the server refuses, a busy port, an unusable or held data directory: one line and exit status 2
  (usage), 1 (busy port, held directory) or 2 (unusable directory); never a traceback.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Optional

__all__ = ["build_serve_app", "main", "serve_command", "serve_options"]

#: What ``--help`` says of the command.
SERVE_HELP = "Run the aggregation server (the gradwire-server distribution) until SIGTERM or Ctrl-C."


def _is_secret(annotation: Any) -> bool:
    """A ``SecretStr`` field (or ``Optional[SecretStr]``): never an option, since argv shows in ``ps``."""
    return any(getattr(a, "__name__", "") == "SecretStr" for a in (annotation, *typing.get_args(annotation)))


def _option_type(annotation: Any) -> Any:
    """The type typer parses an option as: ``Optional[X]`` unwrapped to ``X``; bool, int, float, str, Path
    and ``Literal`` choices as they are; anything else read as text for pydantic to parse."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if annotation in (bool, int, float, str, Path) or typing.get_origin(annotation) is Literal:
        return annotation
    return str


def serve_options(settings_cls: type) -> list[tuple[str, Any, str]]:
    """``(field name, option type, help)`` for each field of ``settings_cls`` that the command offers as
    ``--<field-name>``: every field but the secrets, which come from the environment (``GRADWIRE_<NAME>``)."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    options = []
    for name, field in settings_cls.model_fields.items():
        if _is_secret(field.annotation):
            continue
        default = field.get_default(call_default_factory=True)
        shown = default if not isinstance(default, Path) else str(default)
        help_text = f"{field.description or ''} [{prefix}{name.upper()}; default {shown}]".strip()
        options.append((name, _option_type(field.annotation), help_text))
    return options


def _run(prog: str, settings_cls: type, check: bool, admin_token: str | None, given: dict[str, Any]) -> None:
    """Build the settings from what was given, then ``--check`` them or serve."""
    import typer
    from pydantic import ValidationError

    if admin_token is not None:
        raise typer.BadParameter(
            "the admin token is never an option: a command line shows in `ps` to every user of this machine; "
            "set GRADWIRE_ADMIN_TOKEN, or give a file with --admin-token-file "
            "(with neither, the server generates one into DATA_DIR/admin_token)",
            param_hint="'--admin-token'",
        )
    try:
        settings = settings_cls(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        errors = [(f"--{str(e['loc'][0]).replace('_', '-')}" if e["loc"] else None, e["msg"]) for e in exc.errors()]
        if len(errors) == 1:
            raise typer.BadParameter(errors[0][1], param_hint=f"'{errors[0][0]}'" if errors[0][0] else None) from None
        raise typer.BadParameter("; ".join(f"{opt}: {msg}" if opt else msg for opt, msg in errors)) from None

    from .dirlock import DataDirError, DataDirLocked, check_data_dir, lock_holder
    from .listen_socket import ListenError, PortInUse, bind_listen_socket

    def fail(exc: Exception, code: int) -> typer.Exit:
        typer.echo(f"{prog}: {exc}", err=True)
        return typer.Exit(code=code)

    if check:
        typer.echo(json.dumps(settings.model_dump(mode="json"), indent=2))
        try:
            bind_listen_socket(settings.host, settings.port).close()  # the port is free now
            check_data_dir(settings.data_dir)
        except ListenError as exc:
            raise fail(exc, 1 if isinstance(exc, PortInUse) else 2) from None
        except DataDirError as exc:
            raise fail(exc, 2) from None
        pid = lock_holder(settings.data_dir)
        if pid is not None:
            raise fail(DataDirLocked(Path(settings.data_dir), pid if pid > 0 else None), 1)
        return
    from .serving import serve

    try:
        serve(settings)
    except ListenError as exc:
        # One line, no traceback, before the data directory or the token exist: the port is taken (1).
        raise fail(exc, 1 if isinstance(exc, PortInUse) else 2) from None
    except DataDirError as exc:
        # Another server holds the directory (1), or it is unusable (2).
        raise fail(exc, 1 if isinstance(exc, DataDirLocked) else 2) from None


def serve_command(prog: str = "gradwire-server", settings_cls: type | None = None) -> Callable[..., None]:
    """The command as a function typer reads: one keyword parameter per option of :func:`serve_options`
    (default None: not given, so the environment or the field's default applies), ``--check`` and the
    refused ``--admin-token`` (hidden). ``prog`` names the command in its one-line errors."""
    import typer

    if settings_cls is None:
        from .settings import ServerSettings as settings_cls
    params = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Optional[kind],  # noqa: UP045 (typer reads typing.Optional)
            default=typer.Option(None, help=help_text, show_default=False),
        )
        for name, kind, help_text in serve_options(settings_cls)
    ]
    params.append(
        inspect.Parameter(
            "check",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=bool,
            default=typer.Option(
                False,
                "--check",
                help="Check the settings, the port and the data directory, print the settings as JSON (secrets "
                "masked) and exit without serving or creating anything.",
            ),
        )
    )
    params.append(
        inspect.Parameter(
            "admin_token_option",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Optional[str],  # noqa: UP045
            default=typer.Option(None, "--admin-token", hidden=True),
        )
    )

    def serve(**given: Any) -> None:
        check, admin_token = given.pop("check"), given.pop("admin_token_option")
        _run(prog, settings_cls, check, admin_token, given)

    serve.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    serve.__annotations__ = {p.name: p.annotation for p in params}
    serve.__doc__ = (
        f"{SERVE_HELP}\n\nEvery server setting is an option here and a GRADWIRE_<NAME> environment variable; an "
        "option given wins over the environment, which wins over the default. The admin token is never an "
        "option (a command line shows in `ps`): GRADWIRE_ADMIN_TOKEN, --admin-token-file, or one is generated "
        "into DATA_DIR/admin_token."
    )
    return serve


def build_serve_app(prog: str = "gradwire-server"):
    """A typer application whose one command is :func:`serve_command` (``python -m gradwire_server``)."""
    import typer

    app = typer.Typer(add_completion=False, rich_markup_mode=None, help=SERVE_HELP)
    app.command(name="serve")(serve_command(prog))
    return app


def main(argv: list[str] | None = None, prog: str = "gradwire-server") -> None:
    """``python -m gradwire_server`` / ``gradwire-server``: the command's options, as ``gradwire serve``."""
    from .memory import keep_freed_memory
    from .openmp import prefer_passive_openmp

    prefer_passive_openmp()  # before torch loads (docs/SERVER.md, "Threads")
    keep_freed_memory()  # before threads start: one malloc arena (docs/SERVER.md, "Memory")
    args = sys.argv[1:] if argv is None else list(argv)
    build_serve_app(prog)(args=args, prog_name=prog)
