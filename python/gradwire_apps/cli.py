"""The ``gradwire`` command: ``gradwire demo`` (the distributed demo), ``gradwire serve`` and ``--version``.

Its dependencies come with the ``apps`` extra; without them :func:`main` says how to install them
instead of failing with a traceback. A wrong value is a usage error (exit status 2) before anything
starts. ``gradwire serve``'s options are made from the fields of ``gradwire_server.settings.ServerSettings``
(:func:`serve_options`), so every server setting is on the command line and none can drift from it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from . import INSTALL_HINT
from .demo.settings import MODELS

__all__ = ["build_app", "main", "serve_options", "versions"]

#: ``--model``'s choices, as an annotation typer turns into a usage error for anything else.
ModelName = Literal[MODELS]  # type: ignore[valid-type]

#: What ``gradwire demo`` needs beyond the command line itself (import names).
DEMO_MODULES = ("rich", "tqdm", "sklearn", "matplotlib", "gradwire_server")


def _missing(modules) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _server_hint() -> str:
    return f"{INSTALL_HINT} (gradwire-server is not on PyPI: from a gradwire checkout, pip install ./server)"


def versions() -> str:
    """``gradwire <version>``, and the installed gradwire-server's (read from the installed metadata:
    nothing is imported, so ``--version`` answers at once)."""
    lines = []
    for dist in ("gradwire", "gradwire-server"):
        try:
            lines.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{dist} not installed" if dist != "gradwire" else f"{dist} (not installed: a source tree)")
    return "\n".join(lines)


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
    """``(field name, option type, help)`` for each field of ``settings_cls`` that ``gradwire serve`` offers as
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


def _serve_command(run: Callable[..., None], settings_cls: type) -> Callable[..., None]:
    """A function with one keyword parameter per option of :func:`serve_options` (default None: not given,
    so the environment or the field's default applies) and ``check``, whose signature typer reads."""
    import typer

    params = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=kind | None,
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
                help="Check the settings, print them as JSON (secrets masked) and exit without serving.",
            ),
        )
    )

    def serve(**given: Any) -> None:
        run(**given)

    serve.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    serve.__annotations__ = {p.name: p.annotation for p in params}
    serve.__doc__ = run.__doc__
    return serve


_SERVE_HELP = "Run the aggregation server (the separate gradwire-server distribution) until SIGTERM or Ctrl-C."


def build_app(*, serve_settings: bool = True):
    """The typer application (needs typer, from the ``apps`` extra).

    ``serve_settings=False`` leaves ``serve``'s options out (it then takes any arguments and only says to
    ask for them): reading ServerSettings imports torch, seconds that ``gradwire --version`` or
    ``gradwire demo`` need not wait for. :func:`main` builds them whenever ``serve`` is on the command line.
    """
    import typer

    from .demo.settings import DEFAULT_RUNS, RUNS, DemoSettings

    # Plain click help, not rich panels: rich cuts long option names at 80 columns ("--checkpoint-eve…").
    app = typer.Typer(
        add_completion=False,
        no_args_is_help=True,
        rich_markup_mode=None,
        help="gradwire: compressed gradient transport.",
    )

    def show_version(value: bool) -> None:
        if value:
            typer.echo(versions())
            raise typer.Exit()

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False,
            "--version",
            is_eager=True,
            callback=show_version,
            help="Print gradwire's version (and gradwire-server's) and exit.",
        ),
    ) -> None:
        """gradwire: compressed gradient transport."""

    @app.command()
    def demo(
        model: ModelName = typer.Option(
            "digits", help="What to train: digits (MLP) or transformer (char LM on pydoc text)."
        ),
        workers: int = typer.Option(8, min=1, help="Worker processes (nodes) per run."),
        steps: int = typer.Option(
            320, min=1, help="Training steps per node in every run (a multiple of --sync-every)."
        ),
        runs: str = typer.Option(",".join(DEFAULT_RUNS), help=f"Which runs, comma-separated, of: {', '.join(RUNS)}."),
        sync_every: int = typer.Option(8, min=1, help="SparseLoCo: local steps per sync."),
        sparseloco_topk: int = typer.Option(
            256, min=1, help="SparseLoCo: DCT coefficients kept per 64×64 chunk, both ways."
        ),
        inner_lr: float = typer.Option(1e-2, help="SparseLoCo: each node's local AdamW learning rate."),
        outer_lr: float = typer.Option(1.0, help="SparseLoCo: the outer step's learning rate."),
        outer_momentum: float = typer.Option(0.0, help="SparseLoCo: the outer Nesterov momentum (0: plain SGD)."),
        topk: int = typer.Option(32, min=1, help="Panthalia run: DCT coefficients kept per chunk, both ways."),
        demo_topk: int = typer.Option(4, min=1, help="DeMo run: DCT coefficients of the momentum sent per chunk."),
        demo_lr: float = typer.Option(
            1e-2, help="DeMo run: the sign step (best of bench/convergence.py's grid on every task)."
        ),
        chunk: int = typer.Option(
            32, min=2, help="DCT chunk side of the DeMo and Panthalia runs: chunks are chunk×chunk."
        ),
        lr: float = typer.Option(1e-2, help="Dense AdamW's learning rate (on the server)."),
        batch_size: int = typer.Option(32, min=1, help="Examples per node per step."),
        hidden: int | None = typer.Option(None, min=1, help="Model width (MLP hidden units, transformer d_model)."),
        aggregation: str = typer.Option(
            "bounded_mean",
            help="Aggregation rule, one of gradwire.aggregation.RULES (a wrong name lists them); "
            "the default bounds one node's influence.",
        ),
        seed: int = typer.Option(0),
        out: Path = typer.Option(Path("demo_out"), help="Where the plot, results.json and worker logs go."),
        url: str | None = typer.Option(None, help="Use this running server instead of starting one on loopback."),
        admin_token: str | None = typer.Option(
            None, envvar="GRADWIRE_ADMIN_TOKEN", help="Admin token of --url's server."
        ),
        progress: bool = typer.Option(True, help="Draw a progress bar per run."),
    ) -> None:
        """Train a model on N worker processes through the aggregation server, compressed and not.

        Starts the server on loopback (unless --url), then runs the same training (same steps and samples per
        node) as SparseLoCo (local AdamW steps, a 2-bit top-k DCT pseudo-gradient up, the server's re-encoded
        mean down), DeMo (1-bit DCT momentum up, the re-encoded mean down) and dense AdamW (fp32 both ways),
        and prints the held-out loss, its gap to dense and the compression each way side by side, with a
        plot of loss against steps and against the bytes a node sent and received in OUT/loss.png.
        """
        missing = _missing(DEMO_MODULES if url is None else [m for m in DEMO_MODULES if m != "gradwire_server"])
        if missing:
            hint = _server_hint() if "gradwire_server" in missing else INSTALL_HINT
            typer.echo(f"gradwire demo needs {', '.join(missing)}, from the apps extra: {hint}", err=True)
            raise typer.Exit(code=2)
        try:
            settings = DemoSettings(
                model=model,
                workers=workers,
                steps=steps,
                hidden=hidden,
                batch_size=batch_size,
                lr=lr,
                sync_every=sync_every,
                sparseloco_topk=sparseloco_topk,
                inner_lr=inner_lr,
                outer_lr=outer_lr,
                outer_momentum=outer_momentum,
                demo_lr=demo_lr,
                demo_topk=demo_topk,
                topk=topk,
                chunk=chunk,
                runs=tuple(r.strip() for r in runs.split(",") if r.strip()),
                aggregation=aggregation,
                seed=seed,
                out_dir=str(out),
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        from gradwire.client import GradwireConnectionError, GradwireHTTPError

        from .demo.driver import run_demo

        try:
            results = run_demo(settings, url=url, admin_token=admin_token, progress=progress)
        except (GradwireConnectionError, GradwireHTTPError) as exc:
            # --url's server unreachable or refusing (a wrong admin token): one line, not a traceback.
            typer.echo(f"gradwire demo: the server {url or 'on loopback'} failed: {exc}", err=True)
            raise typer.Exit(code=1) from None
        if not all(r.in_sync for r in results):
            raise typer.Exit(code=1)

    server_missing = None
    if serve_settings:
        try:
            from gradwire_server.settings import ServerSettings
        except ImportError as exc:
            server_missing = str(exc)
    if not serve_settings or server_missing:

        @app.command(help=_SERVE_HELP, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
        def serve() -> None:
            # Only reached without the server package (main builds the options whenever serve is asked for).
            typer.echo(
                f"gradwire serve needs the aggregation server package ({server_missing}): {_server_hint()}", err=True
            )
            raise typer.Exit(code=2)

        return app

    def run_server(check: bool = False, **given: Any) -> None:
        """Run the aggregation server (the separate gradwire-server distribution) until SIGTERM or Ctrl-C.

        Every server setting is an option here and a GRADWIRE_<NAME> environment variable; an option given
        here wins over the environment, which wins over the default. Secrets (the admin token) are never
        options, since a command line shows in `ps`: GRADWIRE_ADMIN_TOKEN, or one is generated into
        DATA_DIR/admin_token.
        """
        from pydantic import ValidationError

        try:
            settings = ServerSettings(**{k: v for k, v in given.items() if v is not None})
        except ValidationError as exc:
            errors = [(f"--{str(e['loc'][0]).replace('_', '-')}" if e["loc"] else None, e["msg"]) for e in exc.errors()]
            if len(errors) == 1:
                raise typer.BadParameter(
                    errors[0][1], param_hint=f"'{errors[0][0]}'" if errors[0][0] else None
                ) from None
            raise typer.BadParameter("; ".join(f"{opt}: {msg}" if opt else msg for opt, msg in errors)) from None
        from gradwire_server.dirlock import DataDirError, DataDirLocked, check_data_dir, lock_holder

        if check:
            typer.echo(json.dumps(settings.model_dump(mode="json"), indent=2))
            # The data directory too: whether it is usable, and whether a live server holds it.
            try:
                check_data_dir(settings.data_dir)
            except DataDirError as exc:
                typer.echo(f"gradwire serve --check: {exc}", err=True)
                raise typer.Exit(code=2) from None
            pid = lock_holder(settings.data_dir)
            if pid is not None:
                typer.echo(
                    f"gradwire serve --check: {DataDirLocked(Path(settings.data_dir), pid if pid > 0 else None)}",
                    err=True,
                )
                raise typer.Exit(code=1)
            return
        import gradwire_server

        try:
            gradwire_server.serve(settings)
        except DataDirError as exc:
            # One line, no traceback: another server holds the directory (1), or it is unusable (2).
            typer.echo(f"gradwire serve: {exc}", err=True)
            raise typer.Exit(code=1 if isinstance(exc, DataDirLocked) else 2) from None

    app.command(name="serve")(_serve_command(run_server, ServerSettings))

    return app


def main() -> None:
    """The ``gradwire`` entry point."""
    if importlib.util.find_spec("gradwire_server") is not None:
        from gradwire_server.memory import keep_freed_memory
        from gradwire_server.openmp import prefer_passive_openmp

        prefer_passive_openmp()  # before torch loads: `gradwire serve` closes rounds faster
        if "serve" in sys.argv[1:]:
            keep_freed_memory()  # before threads start: one malloc arena (docs/SERVER.md, "Memory")
    try:
        app = build_app(serve_settings="serve" in sys.argv[1:])
    except ModuleNotFoundError as exc:
        if exc.name not in ("typer", "click", "rich"):
            raise
        print(f"gradwire: the command line needs {exc.name}, from the apps extra: {INSTALL_HINT}", file=sys.stderr)
        raise SystemExit(2) from None
    app()


if __name__ == "__main__":
    main()
