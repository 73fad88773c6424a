"""The ``gradwire`` command: ``gradwire demo`` (the distributed demo), ``gradwire serve`` and ``--version``.

Its dependencies come with the ``apps`` extra; without them :func:`main` says exactly what to install and
from where (:func:`gradwire_apps.install_hint`) instead of failing with a traceback. A wrong value is a usage
error (exit status 2) before anything starts. ``gradwire serve`` is the server's own command
(:func:`gradwire_server.cli.serve_command`): the same options as ``python -m gradwire_server``, made from the
fields of ``ServerSettings``, so every server setting is on both command lines and none can drift.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Literal

from . import install_hint
from .demo.settings import MODELS

__all__ = ["build_app", "main", "versions"]

#: ``--model``'s choices, as an annotation typer turns into a usage error for anything else.
ModelName = Literal[MODELS]  # type: ignore[valid-type]

#: What ``gradwire demo`` needs beyond the command line itself (import names).
DEMO_MODULES = ("rich", "tqdm", "sklearn", "matplotlib", "gradwire_server")


def _missing(modules) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


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
            help="Aggregation rule, one of gradwire.aggregation.RULES (a wrong name lists them); the default bounds "
            "one node's influence.",
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
            typer.echo(f"gradwire demo needs {', '.join(missing)}: {install_hint(missing)}", err=True)
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

    command, missing = None, "gradwire_server"
    if serve_settings:
        try:
            from gradwire_server.cli import serve_command

            command = serve_command("gradwire serve")  # reads ServerSettings (its module imports torch)
        except ModuleNotFoundError as exc:
            missing = exc.name or "gradwire_server"
    if command is None:
        said = "gradwire_server" if missing.startswith("gradwire_server") else f"gradwire_server's {missing}"

        @app.command(help=_SERVE_HELP, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
        def serve() -> None:
            # Only reached without the server package (main builds the options whenever serve is asked for).
            typer.echo(f"gradwire serve needs {said}: {install_hint(['gradwire_server'])}", err=True)
            raise typer.Exit(code=2)

        return app

    app.command(name="serve")(command)
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
        print(f"gradwire: the command line needs {exc.name}: {install_hint([exc.name])}", file=sys.stderr)
        raise SystemExit(2) from None
    app()


if __name__ == "__main__":
    main()
